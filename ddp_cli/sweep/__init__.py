"""`ddp sweep`: a hyperparameter search on Optuna, each trial a whole `ddp train` run.
May import config, data.registry, observe and the foundations (space.py and storage.py sit low, pruning.py
below run/, whose workers import it; the loop and the report above run/); never run/ or cli/.

space.py reads SPACE.toml against the run config's schema; pruning.py is the trial's side (each
epoch's validation reported to the study, the run stopped at the epoch end the pruner names);
storage.py opens the study; trials.py runs one trial as a process; study.py is the search loop;
report.py the table, the best config and the plots.
"""
