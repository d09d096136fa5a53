"""`ddp export` on the trained demo: each format, run on the demo's val split, gets the top-1 that
`ddp validate` measures for the checkpoint (and the EMA export the EMA's own, as training measured it).

Exported in-process (`export_checkpoint`, what the command calls) to keep this under ~20 s; the command
line itself: tests/unit/test_export.py and tests/e2e/test_plain_pytorch.py.
"""

from __future__ import annotations

import importlib
import json
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import last_json, run_ddp, val_split_of
from safetensors.torch import load_file

from ddp_cli.train.export import export_checkpoint

pytestmark = pytest.mark.slow
FORMATS = {"state_dict": "pt", "safetensors": "safetensors", "torchscript": "ts", "onnx": "onnx"}


@pytest.fixture(scope="module")
def sizes(trained_demo) -> tuple[int, int]:
    """The run's val crop and resize (data.image_size, data.val_resize)."""
    data = tomllib.loads((trained_demo / "config.toml").read_text())["data"]
    return data.get("val_image_size") or data["image_size"], data["val_resize"]


@pytest.fixture(scope="module")
def val_split(demo_registry, sizes) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    return val_split_of(demo_registry, *sizes)


@pytest.fixture(scope="module")
def validated(trained_demo) -> dict:
    return last_json(run_ddp("validate", "--checkpoint", str(trained_demo / "checkpoints/last.pt"), "--json"))


def logits_of(result: dict, card: dict, x: torch.Tensor) -> torch.Tensor:
    """Run the exported file as its card says: weights into the card's builder, or the graph alone."""
    out, fmt = result["out"], result["format"]
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(out, providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run(None, {card["input"]["name"]: x.numpy()})[0])
    if fmt == "torchscript":
        model = torch.jit.load(out)
    else:
        module, name = card["builder"].rsplit(".", 1)
        model = getattr(importlib.import_module(module), name)(num_classes=card["num_classes"],
                                                              **card["builder_kwargs"])
        model.load_state_dict(torch.load(out, weights_only=True) if fmt == "state_dict" else load_file(out))
    with torch.no_grad():
        return model.eval()(x)


def top1(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return (logits.argmax(1) == labels).double().mean().item()


EXPORTS = [*((fmt, "model") for fmt in FORMATS), ("safetensors", "ema")]


@pytest.mark.parametrize(("fmt", "weights"), EXPORTS)
def test_each_export_scores_the_checkpoints_top1_on_the_val_split(
        trained_demo, sizes, val_split, validated, tmp_path, fmt, weights):
    x, labels, classes = val_split
    result = export_checkpoint(trained_demo / "checkpoints/last.pt", fmt, weights,
                               tmp_path / f"demo.{FORMATS[fmt]}")
    card = json.loads(Path(result["card"]).read_text())
    assert (card["builder"], card["dataset"], card["num_classes"]) == ("ddp_cli.models.TinyResNet", "demo",
                                                                       len(classes))
    assert [c["synset"] for c in card["classes"]] == classes
    assert card["classes"][3]["description"] == "digit three"
    assert (card["input"]["image_size"], card["input"]["resize"]) == sizes
    expected = validated["top1"] if weights == "model" else card["final"]["top1"]  # the EMA's, from training
    assert card["final"]["images"] == len(labels) == validated["images"]
    # the same images right, give or take one near-tie that another kernel's rounding may flip
    assert abs(top1(logits_of(result, card, x), labels) - expected) * len(labels) <= 1
    assert expected > 0.3  # agreement on a classifier (10 classes: chance is 0.1), not on noise
