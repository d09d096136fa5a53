"""Failures that once ended as a bug's wall of text, each now one clear line: /dev/shm filling up after
the check before the run (exit 2 naming it), and a bug in a rank (exit 1, one line under 500 characters
on stderr and in the JSON error, the traceback in the rank's log)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_ddp

pytestmark = pytest.mark.slow

TINY = ["data.image_size=8", "data.val_resize=8", "train.epochs=1", "train.precision=fp32"]


def sets(*names: str) -> list[str]:
    return [a for s in names for a in ("--set", s)]


def can_mount_own_shm() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not can_mount_own_shm(), reason="needs unshare -rm (user and mount namespaces)")
def test_dev_shm_full_at_run_time_is_exit_2_naming_it(demo_registry, tmp_path):
    """A 1 MiB /dev/shm of the run's own (a mount namespace), which passes the check before the run and
    is filled by another process as soon as the run dir is prepared: the loaders meet it at run time."""
    run_dir = tmp_path / "run"
    ddp = shlex.join([sys.executable, "-m", "ddp_cli", "train", "configs/demo.toml", "--registry",
                      str(demo_registry), "--run-dir", str(run_dir), "--json",
                      *sets(*TINY, "data.workers=1", "data.prefetch_factor=1")])
    filler = (f"while [ ! -f {run_dir}/job.json ]; do sleep 0.02; done; "
              "dd if=/dev/zero of=/dev/shm/filler bs=4k 2>/dev/null")
    script = f"mount -t tmpfs -o size=1m tmpfs /dev/shm || exit 99; ({filler}) & exec {ddp}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(["unshare", "-rm", "sh", "-c", script], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        os.killpg(proc.pid, 9) if proc.poll() is None else None
    assert proc.returncode == 2, stderr[-3000:]
    error = json.loads(stdout.strip().splitlines()[-1])
    assert error["error"].startswith("/dev/shm ran out during the run (1 MiB in all"), error
    assert "--shm-size" in error["error"] and "data.prefetch_factor" in error["error"]
    assert "Traceback" not in stderr and "a bug" not in stderr, stderr[-3000:]


BROKEN_NET = '''
import torch
import torch.distributed as dist
from torch import nn


class Broken(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.head = nn.Linear(3, num_classes)

    def forward(self, x):
        if dist.is_initialized():  # the check before the run passes; the rank's first step does not
            raise RuntimeError("deliberate bug\\n" + "  a second line of detail\\n" * 100)
        return self.head(x.mean((2, 3)))


def make(num_classes):
    return Broken(num_classes)
'''


def test_a_bug_in_a_rank_is_one_line_with_its_traceback_in_the_rank_log(demo_registry, tmp_path):
    (tmp_path / "broken.py").write_text(BROKEN_NET)
    config = tmp_path / "run.toml"
    config.write_text((REPO / "configs/demo.toml").read_text().replace('name = "resnet_tiny"',
                                                                       'name = "broken.py:make"'))
    run_dir = tmp_path / "run"
    result = run_ddp("train", str(config), "--registry", str(demo_registry), "--run-dir", str(run_dir),
                     "--json", *sets(*TINY, "data.workers=0", "model.channels_last=false"))
    assert result.returncode == 1, result.stderr[-3000:]
    error = json.loads(result.stdout.strip().splitlines()[-1])["error"]
    lines = [line for line in result.stderr.splitlines() if "deliberate bug" in line]
    assert len(lines) == 1 and len(lines[0]) < 500 and len(error) < 500, result.stderr[-3000:]
    assert "second line" not in result.stderr and "Traceback" not in result.stderr
    assert "RuntimeError: deliberate bug; its traceback: " in error
    log = Path(error.rsplit(": ", 1)[1])
    assert log.parent == tmp_path / "run" / "logs" and log.name.endswith(".traceback.log")
    assert "second line" in log.read_text() and "Traceback (most recent call last)" in log.read_text()
