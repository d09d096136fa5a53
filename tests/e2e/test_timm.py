"""A timm model fine-tuned from pretrained weights in a test-made Hugging Face cache (any download attempt
would meet a dead proxy), then validated and exported from its checkpoint with the cache gone: the
checkpoint holds the weights, and the data config the weights carried (mean, std, crop) travels in its
config, so validation matches training's to the image."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import REPO, last_json, run_ddp
from synthetic import write_timm_cache

from ddp_cli.train.checkpoint_model import load_trained
from ddp_cli.train.export import card_path, export_checkpoint

pytestmark = pytest.mark.slow

SETS = ["model.name=timm/test_resnet.r160_in1k", "model.weights=pretrained", "data.image_size=16",
        "data.val_resize=16", "data.workers=0", "train.epochs=1", "train.precision=fp32",
        "optim.head_lr_mult=10", "data.classes=4", "distributed.nproc_per_node=1",  # 575 images: 17 steps
        "train.ema_decay=0"]  # the trained weights throughout (--weights auto: them, without an EMA)
DEAD_PROXY = "http://127.0.0.1:9"


def test_fine_tuned_from_the_cache_then_validated_and_exported_without_it(demo_registry, tmp_path):
    hf_home = tmp_path / "hf"
    written = write_timm_cache(hf_home)
    env = {"HF_HOME": str(hf_home), "HTTPS_PROXY": DEAD_PROXY, "HTTP_PROXY": DEAD_PROXY}
    run_dir = tmp_path / "run"
    sets = [a for s in SETS for a in ("--set", s)]
    trained = run_ddp("train", str(REPO / "configs/demo.toml"), "--registry", str(demo_registry),
                      "--run-dir", str(run_dir), "--quiet", "--json", *sets, env=env)
    assert trained.returncode == 0, trained.stderr
    result = last_json(trained)
    resolved = tomllib.loads((run_dir / "config.toml").read_text())
    assert resolved["data"]["mean"] == resolved["data"]["std"] == [0.5, 0.5, 0.5]  # the weights' own
    assert resolved["model"]["source"] == {"revision": "0" * 40, "from_weights": [
        "data.mean", "data.std", "data.val_interpolation"]}  # val_resize given, image_size given
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if row["split"] == "train"]
    assert losses[-1] < losses[0]  # it learns

    shutil.rmtree(hf_home)
    checkpoint = run_dir / "checkpoints/last.pt"
    validated = run_ddp("validate", "--checkpoint", str(checkpoint), "--registry", str(demo_registry),
                        "--nproc-per-node", "1", "--json", env=env)
    assert validated.returncode == 0, validated.stderr
    assert last_json(validated)["top1"] == result["final"]["top1"]  # the same preprocessing, exactly

    exported = export_checkpoint(checkpoint, "state_dict", "model", tmp_path / "net.pt")
    card = json.loads(card_path(Path(exported["out"])).read_text())
    assert card["builder"] == "timm.create_model"
    assert card["builder_kwargs"] == {"model_name": "test_resnet.r160_in1k"}
    assert (card["input"]["mean"], card["input"]["resize"]) == ([0.5, 0.5, 0.5], 16)
    import timm

    net = timm.create_model(**card["builder_kwargs"], num_classes=card["num_classes"])
    net.load_state_dict(torch.load(exported["out"], weights_only=True))
    assert not torch.equal(net.state_dict()["conv1.0.weight"], written["conv1.0.weight"])  # fine-tuned
    x = torch.randn(3, 3, 16, 16)
    traced = export_checkpoint(checkpoint, "torchscript", "model", tmp_path / "net.ts")
    with torch.no_grad():
        want = net.eval()(x)
        torch.testing.assert_close(load_trained(checkpoint).build()(x), want)
        torch.testing.assert_close(torch.jit.load(traced["out"])(x), want)
