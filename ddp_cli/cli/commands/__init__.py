"""What each command does, without Typer: resolve inputs, check them (preflight), launch workers.
May import the product below cli/ and, in cli/, the kit, preflight and plan; never the Typer apps nor bench.

Every `ddp` command but `bench` (a tool beside the product: ddp_cli/bench) comes through here from the
Typer apps (cli/ddp.py, cli/datasets.py, cli/config.py), which parse flags and draw results. One module
per job: `training` (`ddp train`, its dry run, the launch), `checkpoints` (`validate`, `predict`,
`export`), `datasets` (`ddp datasets ...`), `reports` (`ddp report`), `machine` (`ddp env`) and
`run_config` (`ddp config ...`, `ddp init`); beneath them `run_dirs` (where a run or a checkpoint is: a
folder or s3://, and who holds it).

Imports: at the top of each module only modules that leave torch unimported; those that import it
(run.launch, preflight, train, export, envinfo, ...) are imported in the function that needs them, so
`datasets list`, `config show`, `init` and `report` start without paying torch's import (seconds), and
`train` builds its index in a process forked before torch is loaded (`training.indexed`).
tests/unit/test_cli_startup.py checks.
"""
