"""The front door: the `ddp` Typer app, and everything that serves only a command.
May import every layer of the product and ddp_cli.bench; nothing imports it but ddp_cli.__main__.

Bottom to top: the kit (`render`: what a person reads; `exits`: outcomes to stdout, stderr and exit
codes; `clikit`: declaring commands to Typer, and the options they share) beside the helpers of single
commands (`starter`: `ddp init`; `config_view`: `ddp config`; `envinfo`: `ddp env`); then `preflight`
(every rule the config and the machine decide), `plan` (`--dry-run`) and `commands/` (what each command
does, without Typer: the one door, a module per job); then the Typer apps, `ddp` (handed on here:
pyproject's console script and docs/hooks.py name ddp_cli.cli) and the sub-apps it mounts: `datasets`,
`config`, `sweep` and `bench` (`ddp bench`'s door).
"""

from ddp_cli.cli.ddp import app, entry_point, main

__all__ = ["app", "entry_point", "main"]
