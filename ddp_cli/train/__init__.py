"""Training and evaluation over loaders: Trainer, Checkpointer, optimisers, schedules, precision, metrics.
May import data, distributed, observe, models (zoo, user_model), config and the foundations; not run/."""
