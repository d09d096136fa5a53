"""The syntax of `model.name`: a model of the user's own ("package.module:factory" or
"path/to/file.py:factory") or timm's ("timm/<architecture>[.<tag>]"). Read here, without importing
anything, so the config can refuse a malformed name; models/ finds and builds what the name points at."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddp_cli.errors import ConfigError

REFERENCE = re.compile(r"(?P<target>[^:]+):(?P<factory>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
MODULE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
TIMM_PREFIX = "timm/"
TIMM_NAME = re.compile(r"timm/(?P<arch>[A-Za-z0-9_]+)(?:\.(?P<tag>[A-Za-z0-9_-]+))?")


@dataclass(frozen=True)
class Reference:
    target: str  # a dotted module, or a .py file
    factory: str  # a dotted attribute of it

    @property
    def is_file(self) -> bool:
        return self.target.endswith(".py")


@dataclass(frozen=True)
class TimmName:
    architecture: str
    tag: str | None

    @property
    def timm_name(self) -> str:
        """The name timm's `create_model` takes: "arch" or "arch.tag"."""
        return f"{self.architecture}.{self.tag}" if self.tag else self.architecture


def is_user_model(name: str) -> bool:
    """`name` names a factory (it has a colon), not a model of the zoo."""
    return ":" in name


def is_timm_model(name: str) -> bool:
    return name.startswith(TIMM_PREFIX)


def parse_reference(name: str) -> Reference:
    """`name` as module-or-file and factory; a malformed one is a ConfigError saying the two forms."""
    match = REFERENCE.fullmatch(name)
    if match is None or not (match["target"].endswith(".py") or MODULE.fullmatch(match["target"])):
        raise ConfigError(f"model.name: {name!r} is not a model reference; give \"package.module:factory\" "
                          "or \"path/to/file.py:factory\" (relative to the run config's folder)")
    return Reference(match["target"], match["factory"])


def parse_timm(name: str) -> TimmName:
    """`timm/<architecture>[.<tag>]` split; anything else is a ConfigError showing the form."""
    match = TIMM_NAME.fullmatch(name)
    if match is None:
        raise ConfigError(f"model.name: {name!r} is not a timm model name; give \"timm/<architecture>\" or "
                          "\"timm/<architecture>.<pretrained tag>\", e.g. \"timm/resnet50.a1_in1k\"")
    return TimmName(match["arch"], match["tag"])
