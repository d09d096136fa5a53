"""Write constraints.txt: the installed versions of everything ddp-cli[all] and the dependency groups
(test, docs) need.

`make setup` installs with `-c constraints.txt`, so a fresh machine gets the set the suite
passed with here. Run it (`make constraints`) in a .venv whose `make test` passed; the versions
are `pip freeze`'s, kept only for packages the project needs, so nothing else installed in the
venv by hand leaks in.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "ddp-cli"
HEADER = """\
# The versions `make test` passed with (tools/constraints.py wrote this from `pip freeze`).
# `make setup` installs with `-c constraints.txt`; torch and torchvision stay a matched pair.
"""


def needed() -> set[str]:
    """Canonical names of the project's full closure: ddp-cli[all] and every dependency group."""
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["dependency-groups"]
    todo = [Requirement(f"{PROJECT}[all]"), *(Requirement(r) for group in groups.values() for r in group)]
    seen: dict[str, set[str]] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        extras = set(req.extras) - seen.get(name, {"-"})
        if name in seen and not extras:
            continue
        seen.setdefault(name, set()).update(extras)
        for line in metadata.requires(req.name) or []:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append(dep)
    return set(seen) - {PROJECT}


def main() -> None:
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    keep = needed()
    pins = [line for line in freeze if "==" in line and canonicalize_name(line.split("==")[0]) in keep]
    pins.sort(key=lambda line: canonicalize_name(line.split("==")[0]))
    (ROOT / "constraints.txt").write_text(HEADER + "\n".join(pins) + "\n")


if __name__ == "__main__":
    main()
