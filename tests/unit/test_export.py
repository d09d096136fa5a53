"""`ddp export`: every format loads into the plain builder (or runs on its own) and gives the checkpoint's
logits, for the trained weights and their EMA; the card describes the file; mistakes are one line, exit 2.

The checkpoint is made here: a torchvision resnet18 for 3 classes at 32 px, its EMA a different network,
the CLI run in-process (typer's CliRunner). The demo run end to end: tests/e2e/test_export_demo.py.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from safetensors.torch import load_file
from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.config import RunConfig
from ddp_cli.data.pipeline.transforms import MEAN, STD
from ddp_cli.train.checkpoint import save_checkpoint, write_manifest

CLI_ENV = {"LOGLEVEL": "CRITICAL", "TORCH_CPP_LOG_LEVEL": "FATAL", "DDP_LOG_LEVEL": "INFO"}
CLASSES = ["n001", "n002", "n003"]
DESCRIPTIONS = ["one", "two", "three"]
SIZE, RESIZE = 32, 36
SUFFIX = {"state_dict": "pt", "safetensors": "safetensors", "torchscript": "ts", "onnx": "onnx"}
DATASET = {"name": "tiny", "layout": "imagefolder", "storage": {"driver": "FileSystem", "path": "x"}}
FINAL = {"model": {"top1": 0.5, "top5": 1.0, "loss": 1.1, "images": 30},
         "ema": {"top1": 0.6, "top5": 1.0, "loss": 1.0, "images": 30}}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env=CLI_ENV)


def trained_resnet18(seed: int) -> dict[str, torch.Tensor]:
    """A resnet18 whose BatchNorm statistics have moved, its convolutions saved channels_last (as
    a channels_last run saves them): strided tensors the export must make plain."""
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=len(CLASSES))
    with torch.no_grad():
        model(torch.randn(8, 3, SIZE, SIZE))  # train mode: running stats move
    return {k: v.to(memory_format=torch.channels_last) if v.dim() == 4 else v
            for k, v in model.state_dict().items()}


def reference(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = torchvision.models.resnet18(num_classes=len(CLASSES))
    model.load_state_dict(state)
    return model.eval()


@pytest.fixture(scope="module")
def states() -> dict[str, dict[str, torch.Tensor]]:
    return {"model": trained_resnet18(0), "ema": trained_resnet18(1)}


def write_checkpoint(path: Path, states: dict[str, dict[str, torch.Tensor]], ema: bool = True) -> Path:
    cfg = RunConfig(name="tiny", data={"dataset": "tiny", "image_size": SIZE, "val_resize": RESIZE},
                    model={"name": "resnet18"}, checkpoint={"best_metric": "ema_top1"})  # as resolved
    save_checkpoint({
        "config": cfg.model_dump(mode="json"), "classes": CLASSES, "descriptions": DESCRIPTIONS,
        "dataset": DATASET,
        "model": states["model"], "final": FINAL["model"],
        "ema": {"module": states["ema"], "updates": 12} if ema else None,
        "final_ema": FINAL["ema"] if ema else None,
    }, path)
    write_manifest(path, {"epoch": 3, "step": 12})  # as CheckpointStore writes it beside every checkpoint
    return path


@pytest.fixture(scope="module")
def checkpoint(states, tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "last.pt", states)


# ONNX costs ~5 s an export (torch.export's decompositions): here of the EMA only, whose weights
# differ from the model's, so the right weights went in too; the model's: tests/e2e/test_export_demo.py
EXPORTED = [(fmt, weights) for weights in ("model", "ema") for fmt in SUFFIX
            if (fmt, weights) != ("onnx", "model")]


@pytest.fixture(scope="module")
def exports(checkpoint, tmp_path_factory) -> dict[tuple[str, str], dict]:
    """(format, weights) -> the --json result, for each of EXPORTED."""
    folder = tmp_path_factory.mktemp("exports")
    found = {}
    for fmt, weights in EXPORTED:
        result = invoke("export", "--checkpoint", str(checkpoint), "--format", fmt, "--weights", weights,
                        "--out", str(folder / f"{weights}.{SUFFIX[fmt]}"), "--json")
        assert result.exit_code == 0, result.stderr
        found[fmt, weights] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


def batch(n: int) -> torch.Tensor:
    return torch.randn(n, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(n))


BOTH = pytest.mark.parametrize("weights", ["model", "ema"])


@BOTH
@pytest.mark.parametrize("fmt", ["state_dict", "safetensors"])
def test_weights_load_strictly_into_torchvisions_builder_and_give_the_checkpoints_logits(
        exports, states, fmt, weights):
    out = exports[fmt, weights]["out"]
    tensors = torch.load(out, weights_only=True) if fmt == "state_dict" else load_file(out)
    assert not [k for k in tensors if k.startswith(("module.", "_orig_mod."))]
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors.values())
    model = torchvision.models.resnet18(num_classes=len(CLASSES))
    model.load_state_dict(tensors)  # strict
    x = batch(5)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), reference(states[weights])(x), rtol=0, atol=0)


@BOTH
def test_torchscript_runs_alone_and_agrees(exports, states, weights):
    graph = torch.jit.load(exports["torchscript", weights]["out"])
    x = batch(5)
    with torch.no_grad():
        torch.testing.assert_close(graph(x), reference(states[weights])(x), rtol=1e-4, atol=1e-5)


def test_onnx_runs_in_onnxruntime_with_another_batch_size(exports, states, weights="ema"):
    import onnxruntime

    session = onnxruntime.InferenceSession(exports["onnx", weights]["out"],
                                           providers=["CPUExecutionProvider"])
    (given,), (taken,) = session.get_inputs(), session.get_outputs()
    assert (given.name, taken.name) == ("images", "logits")
    assert isinstance(given.shape[0], str) and given.shape[1:] == [3, SIZE, SIZE]  # the batch is dynamic
    assert given.type == taken.type == "tensor(float)"
    with torch.no_grad():
        for n in (1, 5):  # exported with a batch of 2
            x = batch(n)
            (logits,) = session.run(None, {"images": x.numpy()})
            torch.testing.assert_close(torch.from_numpy(logits), reference(states[weights])(x),
                                       rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("fmt", "weights"), EXPORTED)
def test_the_json_result_and_the_card_describe_the_file(exports, checkpoint, fmt, weights):
    result = exports[fmt, weights]
    out, card_file = Path(result["out"]), Path(result["card"])
    assert (result["format"], result["weights"]) == (fmt, weights)
    assert card_file == out.with_name(out.name + ".card.json")
    assert result["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    card = json.loads(card_file.read_text())
    assert {k: card[k] for k in ("file", "format", "sha256", "weights", "bytes")} == {
        "file": out.name, "format": fmt, "sha256": result["sha256"], "weights": weights,
        "bytes": out.stat().st_size}
    assert (card["model"], card["builder"], card["builder_kwargs"]) == (
        "resnet18", "torchvision.models.resnet18", {})
    assert card["num_classes"] == 3
    assert card["classes"][2] == {"index": 2, "synset": "n003", "description": "three"}
    assert {k: card["input"][k] for k in ("layout", "channels", "image_size", "resize", "interpolation")} == {
        "layout": "NCHW", "channels": "RGB", "image_size": SIZE, "resize": RESIZE,
        "interpolation": "bilinear"}
    assert (card["input"]["mean"], card["input"]["std"]) == (list(MEAN), list(STD))
    assert card["input"]["value_range"] == [0.0, 1.0] and "draft" in card["input"]["decode"]
    assert card["final"] == {k: FINAL[weights][k] for k in ("top1", "top5", "images")}
    assert (card["checkpoint"], card["dataset"]) == (str(checkpoint.resolve()), "tiny")
    assert card["checkpoint_sha256"] == hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    assert card["versions"]["torch"].startswith(torch.__version__.split("+")[0])
    assert ("onnx_opset" in card["versions"]) == (fmt == "onnx")


def test_without_json_a_summary_on_stderr_and_nothing_on_stdout(checkpoint, tmp_path):
    result = invoke("export", "--checkpoint", str(checkpoint), "--format", "state_dict", "--out",
                    str(tmp_path / "m.pt"))
    assert result.exit_code == 0 and result.stdout == ""
    # --weights auto: the EMA's, by which a run with the default EMA judged its best
    assert f"wrote {tmp_path / 'm.pt'} (state_dict, ema weights" in result.stderr
    assert f"{tmp_path / 'm.pt.card.json'}" in result.stderr


def one_line_error(result, code: int, as_json: bool = True) -> str:
    assert result.exit_code == code, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    if as_json:
        assert json.loads(result.stdout.strip().splitlines()[-1])["exit_code"] == code
    return lines[0]


def test_ema_weights_from_a_run_without_ema(states, tmp_path):
    bare = write_checkpoint(tmp_path / "no-ema.pt", states, ema=False)
    result = invoke("export", "--checkpoint", str(bare), "--format", "state_dict", "--weights", "ema",
                    "--out", str(tmp_path / "m.pt"), "--json")
    assert "holds no EMA weights" in one_line_error(result, 2)
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.parametrize(("flag", "value"), [("--format", "pickle"), ("--weights", "best")])
def test_an_unknown_format_or_weights(checkpoint, tmp_path, flag, value):
    args = {"--format": "state_dict", "--weights": "model", flag: value}
    result = invoke("export", "--checkpoint", str(checkpoint), *[a for kv in args.items() for a in kv],
                    "--out", str(tmp_path / "m.pt"), "--json")
    line = one_line_error(result, 2)
    assert f"{flag} {value}" in line and ("onnx" in line if flag == "--format" else "ema" in line)


def test_an_out_that_cannot_be_written(checkpoint, tmp_path):
    (tmp_path / "file").write_text("x")
    before = checkpoint.read_bytes()
    for out, says in ((tmp_path / "file" / "m.pt", "cannot write there"), (tmp_path, "is a folder"),
                      (checkpoint, "the checkpoint itself")):
        result = invoke("export", "--checkpoint", str(checkpoint), "--format", "state_dict",
                        "--out", str(out))
        assert says in one_line_error(result, 2, as_json=False)
    assert checkpoint.read_bytes() == before


def test_a_missing_checkpoint(tmp_path):
    result = invoke("export", "--checkpoint", str(tmp_path / "gone.pt"), "--format", "onnx",
                    "--out", str(tmp_path / "m.onnx"), "--json")
    assert "no such file" in one_line_error(result, 2)


@pytest.mark.parametrize(("fmt", "module", "extra"), [("safetensors", "safetensors", "safetensors"),
                                                      ("onnx", "onnxscript", "export")])
def test_a_format_without_its_extra_names_the_install(checkpoint, tmp_path, monkeypatch, fmt, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # as if never installed
    result = invoke("export", "--checkpoint", str(checkpoint), "--format", fmt, "--out", str(tmp_path / "m"))
    assert f"pip install 'ddp-cli[{extra}]'" in one_line_error(result, 2, as_json=False)
    plain = invoke("export", "--checkpoint", str(checkpoint), "--format", "state_dict",
                   "--out", str(tmp_path / "m.pt"))
    assert plain.exit_code == 0, plain.stderr  # the core install exports a state dict



def test_a_model_torch_onnx_cannot_export(checkpoint, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise torch.onnx.OnnxExporterError("Failed to export. \x1b[96mThis is step 1/3\x1b[0m of ...")

    monkeypatch.setattr(torch.onnx, "export", refuse)
    result = invoke("export", "--checkpoint", str(checkpoint), "--format", "onnx",
                    "--out", str(tmp_path / "m"))
    line = one_line_error(result, 2, as_json=False)
    assert "cannot export resnet18 (Failed to export. This is step 1/3 of ...)" in line  # no colour codes
    assert "--format safetensors" in line and not (tmp_path / "m").exists()


def test_a_trace_that_does_not_reproduce_the_model_is_refused(checkpoint, tmp_path, monkeypatch):
    """A trace fixes what Python decided while recording (a branch on the data, a batch size): it is
    run on a batch of another size against the model before it is written."""
    monkeypatch.setattr(torch.jit, "trace", lambda model, x, check_trace: lambda y: model(y)[: len(x)])
    result = invoke("export", "--checkpoint", str(checkpoint), "--format", "torchscript",
                    "--out", str(tmp_path / "m.ts"))
    assert "the trace of resnet18 does not reproduce the model" in one_line_error(result, 2, as_json=False)
    assert not (tmp_path / "m.ts").exists()


def test_a_model_tracing_cannot_follow_is_refused_in_one_line(checkpoint, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("Tracer cannot infer type of output[0]\nsecond line")

    monkeypatch.setattr(torch.jit, "trace", refuse)
    result = invoke("export", "--checkpoint", str(checkpoint), "--format", "torchscript",
                    "--out", str(tmp_path / "m.ts"))
    line = one_line_error(result, 2, as_json=False)
    assert "resnet18 cannot be traced (Tracer cannot infer type of output[0]); use --format onnx" in line
