"""How every `ddp` command is declared to Typer: the options they share, -v after a command's
name, torchrun's spellings, and help that reads well in an 80-column terminal.

`command(group)` registers a function as a command: its errors become exit codes
(`exits.exits`), it takes -v/--verbose after its name, and its help and parsing are
`DdpCommand`'s. Help shows conventional metavars (N, PATH, KEY=VALUE, ...) instead of Typer's
type names (`<int range>`, `<list[str]>`, `{config}`), and torchrun's underscore spellings
(`--nproc_per_node`) are accepted without being listed.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from ddp_cli.cli.exits import exits
from ddp_cli.errors import ConfigError
from ddp_cli.run.logenv import LOG_ENV  # the levels without -v and with it (torch warnings show)

RegistryOpt = Annotated[str | None, typer.Option(
    "--registry", metavar="PATH", help="data.toml to use (else $DDP_DATA_TOML, else ./data.toml).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
VerboseOpt = Annotated[bool, typer.Option("-v", "--verbose", help="Debug logging.")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KEY=VALUE", help="Override a config key: --set optim.lr=0.2 (TOML value syntax).")]

# torchrun's options, spelled its way; `ddp` lists the dashed form and accepts both
TORCHRUN_SPELLINGS = {f"--{name}": f"--{name.replace('_', '-')}" for name in (
    "nproc_per_node", "node_rank", "rdzv_endpoint", "rdzv_id", "max_restarts", "master_addr", "master_port")}

# the metavar an option without its own gets, by its type; flags get none
METAVARS: dict[Any, str] = {int: "N", float: "NUM", str: "TEXT", Path: "PATH"}


def dashed(args: list[str]) -> list[str]:
    """`args` with torchrun's spellings (`--nproc_per_node 4`, `--node_rank=1`) in ddp's (dashes),
    up to a `--` (after it, arguments are not options)."""
    out = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        name, eq, value = arg.partition("=")
        out.append(TORCHRUN_SPELLINGS.get(name, name) + eq + value)
    return out


class PlainArgument(TyperArgument):
    """An argument shown as its metavar (CONFIG, [INPUT]...), without Typer's type and braces."""

    @property
    def display_name_raw(self) -> str:
        return self.metavar or self.name.upper()

    def display_type_rich(self, ctx: typer.Context) -> str | None:
        return None

    def _usage_display_name(self) -> str:
        name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
        return name + ("..." if self.nargs != 1 else "")


class PlainOption(TyperOption):
    """An option shown with its metavar (or N, NUM, TEXT, PATH by type); a flag with none."""

    def display_type_rich(self, ctx: typer.Context) -> str | None:
        if self.metavar is not None:
            return self.metavar
        if self.is_flag:
            return None
        return METAVARS.get(self.type_descriptor.annotation, "VALUE")

    def _get_number_range_help_str(self) -> str | None:
        return None  # `[1<=x<=65535]` beside every number crowds the table; a value out of range says it


def plain(params: list[Any]) -> list[Any]:
    """Typer's parameters as `PlainArgument`/`PlainOption` (what they show in help differs only)."""
    for param in params:
        if type(param) is TyperArgument:
            param.__class__ = PlainArgument
        elif type(param) is TyperOption:
            param.__class__ = PlainOption
    return params


class DdpCommand(TyperCommand):
    """A command that reads torchrun's spellings as ddp's and shows plain metavars in its help."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, dashed(args))

    def get_params(self, ctx: typer.Context) -> list[Any]:
        return plain(super().get_params(ctx))

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        """The help without flags' `--no-...` twins (accepted, not listed: a column of their own
        would narrow every option's description)."""
        twins = {param: param.secondary_opts for param in self.params if isinstance(param, TyperOption)}
        try:
            for param in twins:
                param.secondary_opts = []
            super().format_help(ctx, formatter)
        finally:
            for param, opts in twins.items():
                param.secondary_opts = opts


class DdpGroup(TyperGroup):
    """A command group whose own options (--version, -v) show plain metavars too."""

    def get_params(self, ctx: typer.Context) -> list[Any]:
        return plain(super().get_params(ctx))


def group(help_text: str, **settings: Any) -> typer.Typer:
    """A command group: its help when called bare, its commands `DdpCommand`s (see `command`)."""
    return typer.Typer(cls=DdpGroup, no_args_is_help=True, help=help_text, **settings)


def command(group: typer.Typer, name: str | None = None) -> Callable[[Callable], Callable]:
    """Register a ddp command on `group`: its errors become exit codes (`exits`) and it takes
    -v/--verbose after its name (`takes_verbose`)."""
    return lambda function: group.command(name, cls=DdpCommand)(takes_verbose(exits(function)))


def takes_verbose(command: Callable) -> Callable:
    """Give a command `-v/--verbose` of its own, so `ddp train ... -v` works as `ddp -v train ...`."""

    @functools.wraps(command)
    def wrapper(*args: Any, verbose: bool = False, **kwargs: Any) -> None:
        if verbose:
            configure_logging(True)
        command(*args, **kwargs)

    # Typer reads the options from the signature: the command's own, and this one
    signature = inspect.signature(command, eval_str=True)
    verbose = inspect.Parameter("verbose", inspect.Parameter.KEYWORD_ONLY, default=False,
                                annotation=VerboseOpt)
    wrapper.__signature__ = signature.replace(parameters=[*signature.parameters.values(), verbose])
    return wrapper


# Libraries whose INFO lines would reach the user's stderr through the root logger's INFO level.
LIBRARY_LOGGERS = ("botocore", "aiobotocore", "boto3", "s3fs", "fsspec", "urllib3")


def configure_logging(verbose: bool) -> None:
    """Debug logging with -v (before or after the command's name: both call this); -v wins over
    the environment, and without it a level the user exported stays."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s",
                        stream=sys.stderr)
    if verbose:
        logging.getLogger().setLevel(logging.DEBUG)  # after the command's name: basicConfig already ran
    for name in LIBRARY_LOGGERS:  # their INFO lines are not ddp's ("Found credentials in environment ...")
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)
    for name, (quiet, loud) in LOG_ENV.items():
        if verbose:
            os.environ[name] = loud
        else:
            os.environ.setdefault(name, quiet)


def lazy_module(name: str) -> ModuleType:
    """Module `name`, executed on its first attribute access (importlib's LazyLoader): for modules
    that import torch, which `ddp --help` and `ddp --version` should not wait for."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None, name
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)
    return module


def one_of(value: str, allowed: tuple[str, ...], flag: str) -> str:
    """`value` if `allowed`; else the usage error naming the flag and what it takes."""
    if value not in allowed:
        raise ConfigError(f"{flag} {value}: use {' or '.join(allowed)}")
    return value
