"""Training and evaluation over loaders: Trainer, Checkpointer, optimisers, schedules, precision, metrics.
May import data, distributed, observe, models, config and the foundations; not run/."""
