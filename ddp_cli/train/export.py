"""`ddp export`: a checkpoint's weights as a file that other programs load, with a model card beside it.

A checkpoint is a training state that only ddp reads. An export is what
serving code, another framework or a colleague without ddp takes: a plain
state dict (or its safetensors twin) that loads strictly into the model's own
builder, or a self-contained graph (TorchScript, ONNX), always on the CPU, in
fp32 and in eval mode. The card (`<out>.card.json`) says how to build the
network and how to prepare its input, so the file can be used without the run
config that trained it.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_cli import __version__
from ddp_cli.config.model_names import is_timm_model, is_user_model, parse_timm
from ddp_cli.data.pipeline.transforms import normalising
from ddp_cli.errors import ConfigError, require_extra
from ddp_cli.io import atomic_write, write_text
from ddp_cli.models.zoo import TINY, builder_kwargs, first_line
from ddp_cli.train.checkpoint import read_manifest
from ddp_cli.train.checkpoint_model import Trained, load_trained, warn_if_changed

log = logging.getLogger("ddp")

FORMATS = ("state_dict", "safetensors", "torchscript", "onnx")
WEIGHTS = ("auto", "model", "ema")
CARD_SUFFIX = ".card.json"
CARD_VERSION = 1
ONNX_INPUT, ONNX_OUTPUT = "images", "logits"
ONNX_OPSET = 20  # torch 2.14's default, stated rather than inherited: the card names it, runtimes need it
ONNX_ONE_FILE = 2**31  # protobuf's limit: above it ONNX keeps weights in a second file
FORMAT_PACKAGES = {"safetensors": ("safetensors",), "onnx": ("onnx", "onnxscript")}
ONNX_LOGGERS = ("onnxscript", "onnx_ir")  # their optimiser's INFO lines: "Removed 83 unused nodes"
JIT_DEPRECATED = r"`torch\.jit\.(trace|trace_method|save)` is deprecated"


def card_path(out: Path) -> Path:
    return out.with_name(out.name + CARD_SUFFIX)


def export_checkpoint(checkpoint: Path, fmt: str, weights: str, out: Path) -> dict[str, Any]:
    """Write the chosen weights of `checkpoint` to `out` in `fmt`, and the card beside it."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: unknown format; use {', '.join(FORMATS)}")
    if weights not in WEIGHTS:
        raise ConfigError(f"--weights {weights}: use auto, model or ema")
    out = writable(Path(out), Path(checkpoint))
    if fmt == "safetensors":
        require_extra("safetensors", "--format safetensors", "use --format state_dict")
    if fmt == "onnx":
        require_extra("export", "--format onnx")
    trained = load_trained(checkpoint, weights)
    warn_if_changed(trained.cfg.model, trained.path)
    model = trained.build()
    sha256, size = WRITERS[fmt](model, trained, out)
    card = model_card(trained, fmt, out, sha256, size)
    write_text(card_path(out), json.dumps(card, indent=2) + "\n")
    return {"out": str(out), "format": fmt, "weights": trained.weights, "sha256": sha256,
            "card": str(card_path(out)), "bytes": size, "model": trained.cfg.model.name}


def writable(out: Path, checkpoint: Path) -> Path:
    """`out`, absolute, once its folder exists: a path that cannot be written is refused before the
    export's work, not after it."""
    out = out.expanduser().resolve()
    if out == checkpoint.expanduser().resolve():
        raise ConfigError(f"--out {out}: that is the checkpoint itself; write the export elsewhere")
    if out.is_dir():
        raise ConfigError(f"--out {out}: is a folder; give a file name, e.g. {out / 'model.pt'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror}); choose another path") from e
    return out


def plain_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own state dict (the builder's names), as CPU tensors each with storage of its own.

    Contiguous and unshared: safetensors refuses tensors that share storage or are strided, and
    a torch.save of a view would carry its whole base along.
    """
    return {key: value.detach().cpu().clone(memory_format=torch.contiguous_format)
            for key, value in model.state_dict().items()}


def write_state_dict(model: nn.Module, trained: Trained, out: Path) -> tuple[str, int]:
    tensors = plain_tensors(model)
    return atomic_write(out, lambda f: torch.save(tensors, f))


def write_safetensors(model: nn.Module, trained: Trained, out: Path) -> tuple[str, int]:
    from safetensors.torch import save

    meta = {"format": "pt", "model": trained.cfg.model.name, "num_classes": str(len(trained.classes))}
    data = save(plain_tensors(model), metadata=meta)
    return atomic_write(out, lambda f: f.write(data))


def write_torchscript(model: nn.Module, trained: Trained, out: Path) -> tuple[str, int]:
    """A traced graph (trace, not script: every torchvision classifier traces, not all script),
    checked against the model on a batch of another size.

    That check replaces trace's own, which compares the graphs of two traces and refuses ViT's
    (they differ in names only). torch.jit is deprecated (torch 2.14's trace and save tell their
    caller to move to torch.export); that advice is for ddp, so the user gets one line instead.
    Tracer warnings (an input-dependent branch) pass through.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", JIT_DEPRECATED, FutureWarning)
        try:
            traced = torch.jit.trace(model, example_input(trained), check_trace=False)
        except Exception as e:  # whatever the model's forward does that tracing cannot follow
            raise ConfigError(f"--format torchscript: {trained.cfg.model.name} cannot be traced "
                              f"({first_line(e)}); use --format onnx or state_dict") from e
        if not reproduces(traced, model, trained):
            raise ConfigError(f"--format torchscript: the trace of {trained.cfg.model.name} does not "
                              "reproduce the model; use --format onnx or state_dict")
        written = atomic_write(out, lambda f: torch.jit.save(traced, f))
    log.warning("note: TorchScript is deprecated in PyTorch; the file loads with torch.jit.load "
                "today, --format onnx is the graph format to build on")
    return written


def reproduces(graph: Callable[[torch.Tensor], torch.Tensor], model: nn.Module, trained: Trained) -> bool:
    """Whether `graph` gives the model's logits (to float rounding) on 3 images, not the 2 it saw."""
    x = example_input(trained, batch=3)
    with torch.no_grad():
        want, got = model(x), graph(x)
    return got.shape == want.shape and bool((got - want).abs().max() <= 1e-4 * (1 + want.abs().max()))


def write_onnx(model: nn.Module, trained: Trained, out: Path) -> tuple[str, int]:
    """torch.export-based ONNX (the exporter torch recommends; the TorchScript one is deprecated),
    with the batch dimension dynamic and the weights inside the one file."""
    if sum(t.numel() * t.element_size() for t in model.state_dict().values()) >= ONNX_ONE_FILE:
        raise ConfigError(f"--format onnx: {trained.cfg.model.name}'s weights exceed the 2 GiB an ONNX "
                          "file holds in one piece; use --format safetensors")
    batch = torch.export.Dim("batch", min=1)
    try:
        with quiet_below_debug(ONNX_LOGGERS):
            program = torch.onnx.export(model, (example_input(trained),), dynamo=True, external_data=False,
                                        input_names=[ONNX_INPUT], output_names=[ONNX_OUTPUT],
                                        dynamic_shapes=({0: batch},), opset_version=ONNX_OPSET,
                                        verbose=False)
    except torch.onnx.OnnxExporterError as e:
        reason = re.sub(r"\x1b\[[0-9;]*m", "", first_line(e))  # it colours its messages
        raise ConfigError(f"--format onnx: torch.onnx cannot export {trained.cfg.model.name} "
                          f"({reason}); use --format safetensors or torchscript") from e
    data = program.model_proto.SerializeToString()
    return atomic_write(out, lambda f: f.write(data))


@contextmanager
def quiet_below_debug(names: tuple[str, ...]) -> Iterator[None]:
    """These loggers at WARNING for a while, unless -v asked for debug output (ddp logs INFO to stderr,
    and so would every library's progress notes)."""
    if log.isEnabledFor(logging.DEBUG):
        yield
        return
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


WRITERS: dict[str, Callable[[nn.Module, Trained, Path], tuple[str, int]]] = {
    "state_dict": write_state_dict, "safetensors": write_safetensors,
    "torchscript": write_torchscript, "onnx": write_onnx,
}


def example_input(trained: Trained, batch: int = 2) -> torch.Tensor:
    """Images at the validation size; graphs are recorded on a batch of 2 (not 1: torch.export takes
    a dimension of size 1 for a constant). From a generator of its own: the global RNG is left alone."""
    size = input_size(trained)
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))


def input_size(trained: Trained) -> int:
    return trained.cfg.data.val_image_size or trained.cfg.data.image_size


def builder(trained: Trained) -> tuple[str, dict[str, Any]]:
    """The callable that makes the network (with `num_classes=`), and its other keyword arguments."""
    name, kwargs = trained.cfg.model.name, builder_kwargs(trained.cfg.model, trained.cfg.data.image_size)
    if is_user_model(name):
        return name, kwargs  # "package.module:factory" or "/abs/file.py:factory"
    if is_timm_model(name):  # timm.create_model("resnet50.a1_in1k", num_classes=..., **kwargs)
        return "timm.create_model", {"model_name": parse_timm(name).timm_name, **kwargs}
    return ("ddp_cli.models.TinyResNet" if name == TINY else f"torchvision.models.{name}"), kwargs


def model_card(trained: Trained, fmt: str, out: Path, sha256: str, size: int) -> dict[str, Any]:
    """What a program needs to use the exported file, and where it came from."""
    make, kwargs = builder(trained)
    manifest = read_manifest(trained.path) or {}
    return {
        "card_version": CARD_VERSION,
        "file": out.name, "format": fmt, "sha256": sha256, "bytes": size,
        "model": trained.cfg.model.name, "builder": make, "builder_kwargs": kwargs,
        **({"model_source": trained.cfg.model.source.model_dump()} if trained.cfg.model.source else {}),
        "num_classes": len(trained.classes),
        "classes": [{"index": i, "synset": synset, "description": text} for i, (synset, text)
                    in enumerate(zip(trained.classes, trained.descriptions, strict=True))],
        "input": input_spec(trained, fmt),
        "output": {**({"name": ONNX_OUTPUT} if fmt == "onnx" else {}),
                   "shape": ["batch", len(trained.classes)], "meaning": "logits (softmax: probabilities)"},
        "weights": trained.weights,
        "checkpoint": str(trained.path.resolve()), "checkpoint_sha256": manifest.get("sha256"),
        "final": {k: trained.final[k] for k in ("top1", "top5", "images") if k in trained.final},
        "dataset": trained.dataset.get("name"),
        "versions": versions(fmt),
    }


def input_spec(trained: Trained, fmt: str) -> dict[str, Any]:
    """Validation's preprocessing (ddp_cli.data.pipeline.images.decode, transforms.ValTransform and
    to_model_input), for a program that prepares images without ddp."""
    mean, std = normalising(trained.cfg.data)
    return {
        **({"name": ONNX_INPUT} if fmt == "onnx" else {}),
        "layout": "NCHW", "channels": "RGB", "dtype": "float32",
        "image_size": input_size(trained), "resize": trained.cfg.data.val_resize,
        "interpolation": trained.cfg.data.val_interpolation or trained.cfg.augment.interpolation,
        "antialias": True, "value_range": [0.0, 1.0],
        "mean": list(mean), "std": list(std),
        "decode": "JPEGs at the coarsest DCT scale 1/k (k = 8, 4, 2) whose sides, ceil(side / k), "
                  "still cover the resized image's, ceil(side * s) with s = resize / shorter side; in "
                  "PIL, image.draft('RGB', (width // k, height // k)); pixel values a little off a "
                  "full decode",
        "steps": "resize the shorter side to `resize` (`interpolation`, antialiased), centre-crop "
                 "image_size x image_size, scale to value_range (uint8 / 255), then (x - mean) / std "
                 "per channel",
    }


def versions(fmt: str) -> dict[str, Any]:
    """What wrote the file: ddp, torch and the format's own packages."""
    found = {name: version(name) for name in ("torch", "torchvision", *FORMAT_PACKAGES.get(fmt, ()))}
    return {"ddp": __version__, **found, **({"onnx_opset": ONNX_OPSET} if fmt == "onnx" else {})}
