"""What `ddp export` hands over, used as someone without ddp would: torch, torchvision, PIL and
the model card, nothing else. This file never imports ddp_cli; it runs `ddp` as a command.

- A resnet18 trained by `ddp train` (2 steps: only the weights matter): its state_dict export loads
  strictly into the builder the card names and gives the checkpoint's own logits (the checkpoint read
  with torch.load(weights_only=True) too). safetensors, of both weights: tests/unit/test_export.py.
- The trained demo's TorchScript, fed the val images prepared as the card says (PIL decoding,
  torchvision's transforms), scores the top-1 that training measured for those weights.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import torchvision
from conftest import last_json, run_ddp
from PIL import Image
from torchvision.transforms import v2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def resnet18_checkpoint(demo_registry, tmp_path_factory) -> Path:
    """A resnet18 checkpoint as `ddp train` writes it, made cheaply (one worker, 2 steps, 8 px)."""
    run_dir = tmp_path_factory.mktemp("resnet18") / "run"
    sets = ["model.name=resnet18", "train.epochs=1", "train.max_steps_per_epoch=2", "train.precision=fp32",
            "data.image_size=8", "data.val_resize=8", "data.workers=0"]
    last_json(run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                      str(run_dir), "--nproc-per-node", "1", "--quiet", "--json",
                      *[a for s in sets for a in ("--set", s)]))
    return run_dir / "checkpoints/last.pt"


def build(card: dict) -> torch.nn.Module:
    """The network the card names, from torchvision alone."""
    assert card["builder"].startswith("torchvision.models.")
    builder = getattr(torchvision.models, card["builder"].removeprefix("torchvision.models."))
    return builder(num_classes=card["num_classes"], **card["builder_kwargs"])


def export(checkpoint: Path, fmt: str, out: Path) -> tuple[dict, str]:
    """`ddp export ... --weights model --json` (the trained weights, the checkpoint's "model", which the
    tests compare with): the card it wrote, and its stderr."""
    result = run_ddp("export", "--checkpoint", str(checkpoint), "--format", fmt, "--weights", "model",
                     "--out", str(out), "--json")
    return json.loads(Path(last_json(result)["card"]).read_text()), result.stderr


def test_a_resnet18_state_dict_loads_into_torchvision_and_gives_the_checkpoints_logits(
        resnet18_checkpoint, tmp_path):
    card, _ = export(resnet18_checkpoint, "state_dict", tmp_path / "resnet18.pt")
    assert (card["builder"], card["num_classes"]) == ("torchvision.models.resnet18", 10)
    exported = build(card)
    exported.load_state_dict(torch.load(tmp_path / "resnet18.pt", weights_only=True))  # strict
    checkpoint = torch.load(resnet18_checkpoint, map_location="cpu", weights_only=True)
    original = torchvision.models.resnet18(num_classes=10)
    original.load_state_dict(checkpoint["model"])
    size = card["input"]["image_size"]
    x = torch.randn(6, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(x), original.eval()(x), rtol=0, atol=0)


def val_split(root: Path) -> list[tuple[Path, str]]:
    """(image, synset) of the demo's val split, read from the Kaggle layout's own files."""
    with open(root / "LOC_val_solution.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    folder = root / "ILSVRC/Data/CLS-LOC/val"
    return [(folder / f"{row['ImageId']}.JPEG", row["PredictionString"].split()[0]) for row in rows]


def read(path: Path, spec: dict) -> Image.Image:
    """The image decoded as the card's `decode` says: a JPEG at a coarser DCT scale (PIL's draft)."""
    image = Image.open(path)
    s = spec["resize"] / min(image.size)
    k = next(k for k in (8, 4, 2, 1) if all(-(-n // k) >= math.ceil(n * s) for n in image.size))
    image.draft("RGB", (image.width // k, image.height // k))
    return image.convert("RGB")


def prepare(spec: dict) -> v2.Compose:
    """The card's input section as torchvision transforms."""
    assert (spec["layout"], spec["channels"], spec["interpolation"], spec["value_range"]) == (
        "NCHW", "RGB", "bilinear", [0.0, 1.0])
    return v2.Compose([
        v2.PILToTensor(),
        v2.Resize(spec["resize"], interpolation=v2.InterpolationMode.BILINEAR, antialias=spec["antialias"]),
        v2.CenterCrop(spec["image_size"]),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(spec["mean"], spec["std"]),
    ])


def test_the_demos_torchscript_scores_its_top1_on_images_prepared_as_the_card_says(
        trained_demo, demo_root, tmp_path):
    card, stderr = export(trained_demo / "checkpoints/last.pt", "torchscript", tmp_path / "demo.ts")
    assert "TorchScript is deprecated" in stderr  # ddp's one line, not torch's advice to its caller:
    assert "torch.jit.trace` is deprecated" not in stderr
    graph = torch.jit.load(tmp_path / "demo.ts")
    label = {c["synset"]: c["index"] for c in card["classes"]}
    spec = card["input"]
    transform = prepare(spec)
    images = val_split(demo_root)
    x = torch.stack([transform(read(path, spec)) for path, _ in images])
    labels = torch.tensor([label[synset] for _, synset in images])
    with torch.no_grad():
        right = (graph(x).argmax(1) == labels).sum().item()
    assert len(images) == card["final"]["images"] and card["final"]["top1"] > 0.5
    assert abs(right - card["final"]["top1"] * len(images)) <= 1  # a near-tie may round the other way
