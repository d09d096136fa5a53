"""A wheel user can start: build the wheel, install it into a fresh venv, `ddp init`, train the demo.

No Makefile, no checkout: the wheel is built from a copy of what it packages, installed with
--no-deps into a new venv that borrows this environment's packages (torch is too big to install
per test) through a path entry, and run from a folder outside the checkout. The venv holds the
core only: every extra's module (and scikit-learn) is hidden, as if never installed; the demo's
digits ship in the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

HIDDEN_EXTRAS = ("s3fs", "tensorboard", "wandb", "matplotlib", "sklearn", "safetensors", "onnxscript", "onnx",
                 "onnxruntime")  # the core install only
SHORT = ["--set", "train.epochs=1", "--set", "train.max_steps_per_epoch=3", "--set", "data.workers=0"]


def run(*cmd: str | Path, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "DDP_DATA_TOML",
                        "PYTHONPATH")}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def build_wheel(out: Path) -> Path:
    """`pip wheel` from a copy of the sources (an in-tree build would leave build/ in the checkout)."""
    source = out / "source"
    shutil.copytree(REPO / "ddp_cli", source / "ddp_cli", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                "-w", out / "dist", source, cwd=out)
    assert built.returncode == 0, built.stderr
    assert "warning" not in (built.stdout + built.stderr).lower(), built.stdout + built.stderr
    (wheel,) = (out / "dist").glob("ddp_cli-*.whl")
    return wheel


def core_venv(folder: Path) -> Path:
    """A venv seeing this environment's packages, every extra hidden; its bin folder.

    The packages come in as plain path entries, whose own .pth files (this checkout's editable
    install among them) are not run.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", folder], check=True)
    site = run(folder / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
               cwd=folder).stdout.strip()
    borrowed = dict.fromkeys(sysconfig.get_paths()[kind] for kind in ("purelib", "platlib"))
    hide = f"import sys; sys.modules.update(dict.fromkeys({HIDDEN_EXTRAS!r}))"
    (Path(site) / "borrowed.pth").write_text("".join(f"{path}\n" for path in borrowed) + hide + "\n")
    return folder / "bin"


def test_wheel_installs_inits_and_trains_the_demo_outside_the_checkout(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    packaged = {"ddp_cli/templates/demo.toml", "ddp_cli/templates/data.toml",
                "ddp_cli/data/sources/digits.csv.gz"}
    assert packaged <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: MIT" in metadata and "Provides-Extra: s3" in metadata

    bin_dir = core_venv(tmp_path / "venv")
    installed = run(bin_dir / "python", "-m", "pip", "install", "--no-deps", "--no-index",
                    "--ignore-installed", wheel, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    home = tmp_path / "home"  # outside the checkout
    home.mkdir()
    where = run(bin_dir / "python", "-c", "import ddp_cli; print(ddp_cli.__file__)", cwd=home)
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout + where.stderr

    init = run(bin_dir / "ddp", "init", "starter", "--json", cwd=home)
    assert init.returncode == 0, init.stderr
    starter = home / "starter"
    assert json.loads(init.stdout.splitlines()[-1]) == {
        "dir": str(starter), "files": [str(starter / "demo.toml"), str(starter / "data.toml")]}
    again = run(bin_dir / "ddp", "init", "starter", cwd=home)
    assert again.returncode == 2 and f"{starter / 'demo.toml'}: already exists" in again.stderr, again.stderr

    trained = run(bin_dir / "ddp", "train", "starter/demo.toml", "--registry", "starter/data.toml", *SHORT,
                  "--json", cwd=home)
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = json.loads(trained.stdout.splitlines()[-1])
    assert result["final"]["images"] == 359 and result["run_dir"].startswith(str(home / "runs"))
    assert (starter / ".data/demo/.complete").is_file()  # built on first use, beside its data.toml

    # the extras left out: one line naming the install, exit 2 (in DIR: ./data.toml is the registry)
    s3 = run(bin_dir / "ddp", "datasets", "show", "imagenet_s3", cwd=starter)
    assert (s3.returncode, s3.stderr.strip()) == (2, "error: s3://my-bucket/imagenet: the s3fs package is "
                                                  "not installed; pip install 'ddp-cli[s3]'")
    report = run(bin_dir / "ddp", "report", result["run_dir"], cwd=home)
    assert report.returncode == 2 and report.stderr.strip().endswith("pip install 'ddp-cli[report]'"), \
        report.stderr
