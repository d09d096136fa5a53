"""A model of the user's own, from a file beside the run config, through every command: trained on 2
ranks, validated by spawned workers, predicted, exported (a state dict that loads into the factory, an
ONNX graph that onnxruntime scores as `ddp validate` does), and the warning when the file has changed.

The file imports a helper beside it: forked and spawned workers find it as the launcher did. Every
command runs from another folder than the config's (paths are the config's, not the working directory's).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, last_json, run_ddp, val_split_of
from synthetic import OWN_NET

from ddp_cli.models.user_model import factory
from ddp_cli.train.checkpoint_model import load_trained
from ddp_cli.train.export import card_path, export_checkpoint

pytestmark = pytest.mark.slow

NET = "from blocks import conv_bn  # beside this file: found in every worker\n" + OWN_NET

SETS = ["data.image_size=8", "data.val_resize=8", "data.workers=0", "train.epochs=1", "train.precision=fp32",
        "train.ema_decay=0.9", "checkpoint.best_metric=top1",  # so --weights auto = the trained weights
        "model.channels_last=false", "optim.head_lr_mult=2"]


@pytest.fixture(scope="module")
def trained(demo_registry, tmp_path_factory) -> tuple[Path, Path, dict]:
    """The config folder (config, nets/tiny.py, nets/blocks.py) and the run dir of a 1-epoch run."""
    folder = tmp_path_factory.mktemp("own")
    (folder / "nets").mkdir()
    (folder / "nets/blocks.py").write_text("conv_bn = None\n")
    (folder / "nets/tiny.py").write_text(NET)
    demo = (REPO / "configs/demo.toml").read_text()
    config = demo.replace('name = "resnet_tiny"', 'name = "nets/tiny.py:make"')
    (folder / "run.toml").write_text(config + "\n[model.kwargs]\nwidth = 16\n")
    run_dir = folder / "run"
    result = last_json(train(folder, demo_registry, run_dir))
    return folder, run_dir, result


def train(folder: Path, registry: Path, run_dir: Path, *more: str):
    sets = [a for s in [*SETS, *more] for a in ("--set", s)]
    return run_ddp("train", str(folder / "run.toml"), "--registry", str(registry), "--run-dir", str(run_dir),
                   "--quiet", "--json", *sets)


def test_a_file_model_trains_validates_predicts_and_exports(trained, demo_registry, demo_root, tmp_path):
    folder, run_dir, result = trained
    checkpoint = run_dir / "checkpoints/last.pt"
    resolved = (run_dir / "config.toml").read_text()
    assert f'name = "{folder / "nets/tiny.py"}:make"' in resolved  # made absolute, recorded with its hash
    assert "sha256 = " in resolved and f'root = "{folder / "nets"}"' in resolved
    assert result["world_size"] == 2

    spawned = {"DDP_WORKER_START": "spawn"}
    validated = last_json(run_ddp("validate", "--checkpoint", str(checkpoint), "--registry",
                                  str(demo_registry), "--json", cwd=tmp_path, env=spawned))
    assert validated["top1"] == pytest.approx(result["final"]["top1"])

    image = next((demo_root / "ILSVRC/Data/CLS-LOC/val").iterdir())
    answer = last_json(run_ddp("predict", str(image), "--checkpoint", str(checkpoint), "--json",
                               cwd=tmp_path))
    assert answer["path"].endswith(image.name) and answer["topk"][0]["synset"].startswith("n")

    # the state dict loads strictly into the factory the card names, and gives the checkpoint's logits
    exported = export_checkpoint(checkpoint, "state_dict", "model", tmp_path / "net.pt")
    card = json.loads(card_path(Path(exported["out"])).read_text())
    assert card["builder"] == f"{folder / 'nets/tiny.py'}:make" and card["builder_kwargs"] == {"width": 16}
    net = factory(card["builder"], card["model_source"]["root"])(num_classes=10, **card["builder_kwargs"])
    net.load_state_dict(torch.load(exported["out"], weights_only=True))
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        want = net.eval()(x)
        torch.testing.assert_close(load_trained(checkpoint).build()(x), want)

    (folder / "nets/tiny.py").write_text(NET + "\n# edited after training\n")
    onnx = run_ddp("export", "--checkpoint", str(checkpoint), "--format", "onnx", "--out",
                   str(tmp_path / "net.onnx"), "--json", cwd=tmp_path)
    assert onnx.returncode == 0, onnx.stderr
    then = card["model_source"]["sha256"]
    assert f"sha256 {then} then" in onnx.stderr and "now)" in onnx.stderr and "changed" in onnx.stderr
    resumed = train(folder, demo_registry, run_dir, "train.epochs=2")  # resuming says so too, once
    assert last_json(resumed)["epochs"] == 2 and resumed.stderr.count(f"sha256 {then} then") == 1

    import onnxruntime

    session = onnxruntime.InferenceSession(str(tmp_path / "net.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"images": x.numpy()})[0], want.numpy(), atol=1e-4)
    images, labels, _ = val_split_of(demo_registry, 8, 8)  # scored as `ddp validate` scores it
    right = (session.run(None, {"images": images.numpy()})[0].argmax(1) == labels.numpy()).sum()
    assert abs(right - validated["top1"] * len(labels)) <= 1  # give or take one near-tie
