"""`python -m ddp_cli` (and `torchrun -m ddp_cli train ...`) run the CLI."""

from ddp_cli.cli import entry_point

entry_point()
