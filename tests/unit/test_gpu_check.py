"""tools/gpu_check.py (`make gpu-check`) on a CPU: the stages' bookkeeping with stages faked, the checks of
the step and train stages on canned `ddp` answers, and the CPU-only exit 2 for real."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
gc = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(gc)


class Clock:
    """A clock the stages advance by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stage(name: str, result=None, raises: Exception | None = None, needs=(), budget=10.0, takes=1.0,
          clock: Clock | None = None, seen: dict | None = None):
    def check(ctx):
        if seen is not None:
            seen[name] = ctx.seconds_left()
        if clock:
            clock.now += takes
        if raises:
            raise raises
        return result or (f"{name} fine", {"from": name})

    return gc.Stage(name, budget, check, needs)


def test_a_failure_is_its_own_and_the_report_and_summary_say_so(tmp_path, capsys):
    stages = [
        stage("a"),
        stage("b", raises=gc.Failed("b did not hold", {"measured": 2})),
        stage("c", needs=("b",)),
        stage("d", raises=RuntimeError("a bug")),
        stage("e", raises=gc.Skipped("no bf16 here")),
        stage("f", needs=("a",)),
    ]
    assert gc.main(["--out", str(tmp_path)], stages=stages) == 1
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["held"] is False
    got = {s["stage"]: (s["status"], s["detail"], s["data"]) for s in doc["stages"]}
    assert got == {"a": ("ok", "a fine", {"from": "a"}), "b": ("failed", "b did not hold", {"measured": 2}),
                   "c": ("not run", "needs b", {}), "d": ("failed", "RuntimeError: a bug", {}),
                   "e": ("skipped", "no bf16 here", {}), "f": ("ok", "f fine", {"from": "f"})}
    out = capsys.readouterr().out
    assert "not all held" in out and str(tmp_path / "report.json") in out and "b did not hold" in out


def test_all_held_or_skipped_is_exit_0(tmp_path, capsys):
    stages = [stage("a"), stage("e", raises=gc.Skipped("no bf16 here"))]
    assert gc.main(["--out", str(tmp_path)], stages=stages) == 0
    assert json.loads((tmp_path / "report.json").read_text())["held"] is True
    assert "all held" in capsys.readouterr().out


def test_each_stage_gets_its_budget_capped_by_what_is_left_of_the_whole(tmp_path):
    clock, seen = Clock(), {}
    ctx = gc.Context(tmp_path, clock=clock)
    stages = [stage("a", budget=10, takes=7, clock=clock, seen=seen),
              stage("b", budget=10, takes=6, clock=clock, seen=seen),
              stage("c", budget=10, clock=clock, seen=seen)]
    outcomes = gc.run_stages(stages, ctx, total_s=12)
    assert seen == {"a": 10, "b": 5}  # b starts at 7 of 12: 5 s left, under its budget of 10
    assert [(o.status, round(o.seconds)) for o in outcomes] == [("ok", 7), ("ok", 6), ("not run", 0)]
    assert outcomes[2].detail == "the check's 12 s were spent"
    clock.now = ctx.deadline + 1
    with pytest.raises(gc.Failed, match="out of time"):
        ctx.seconds_left()


@pytest.mark.processes
def test_a_command_past_its_stage_budget_is_killed(tmp_path):
    ctx = gc.Context(tmp_path, deadline=time.monotonic() + 0.5)
    started = time.monotonic()
    with pytest.raises(gc.Failed, match="ran out of the stage's time"):
        ctx.run("sleep", "30")
    assert time.monotonic() - started < 10


class Canned(gc.Context):
    """`ddp` answered from a table, keyed by the command's first two words."""

    def __init__(self, work: Path, answers: dict, results: dict | None = None) -> None:
        super().__init__(work, results or {})
        self.answers = answers

    def ddp(self, *args: str):
        answer = self.answers[" ".join(args[:2])]
        return answer(args) if callable(answer) else answer


def bench(ratio=0.99, ratio_ema=0.975, syncs=(0, 0, 0), peaks=(1000.0, 1000.0)) -> dict:
    row = {"precision": "bf16", "channels_last": True}
    return {"fast_precision": "bf16", "ratio_vs_bare": ratio, "ratio_ema_vs_bare": ratio_ema,
            "host_syncs_per_step": list(syncs), "host_syncs_from": ["trainer.py:200"],
            "rows": [{**row, "loop": "ddp", "images_per_second": 990.0, "peak_memory_mib": peaks[0]},
                     {**row, "loop": "bare", "images_per_second": 1000.0, "peak_memory_mib": peaks[1]},
                     {**row, "loop": "ddp_ema", "images_per_second": 975.0, "peak_memory_mib": peaks[0]}]}


@pytest.mark.parametrize(("answer", "why"), [
    (bench(), None),
    (bench(ratio=0.97), "want >= 0.98"),
    (bench(ratio_ema=0.96), "want >= 0.98, >= 0.97 with EMA"),
    (bench(peaks=(1100.0, 1000.0)), "peak memory <= x1.05"),
    (bench(syncs=(0, 1, 0)), "trainer.py:200"),
])
def test_the_step_stage_holds_ddp_to_the_bare_loop(tmp_path, answer, why):
    ctx = Canned(tmp_path, {"bench step": answer})
    if why is None:
        line, _ = gc.check_step(ctx)
        assert "x0.990" in line and "host syncs per step [0, 0, 0]" in line
    else:
        with pytest.raises(gc.Failed, match=why.replace("+", r"\+").replace(".", r"\.")):
            gc.check_step(ctx)


def trained(steps: list[int]):
    """`ddp train` as a canned answer that leaves these step files and last.pt in its run dir."""
    def answer(args):
        folder = Path(args[args.index("--run-dir") + 1]) / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        for name in [f"step-{s:09d}.pt" for s in steps] + ["last.pt"]:
            (folder / name).write_bytes(b"x")
        return {"epochs": 2, "world_size": 1, "precision": "bf16", "images_per_second": 500.0,
                "final": {"images": gc.VAL, "loss": 1.2, "top1": 0.5}, "final_ema": {"top1": 0.4}}
    return answer


def test_the_train_stage_wants_a_checkpoint_of_the_every_n_steps_saves(tmp_path):
    results, key = {"data": {"registry": "data.toml"}}, "train configs/resnet50.toml"
    _, data = gc.check_train(Canned(tmp_path, {key: trained([12, 15, 16])}, results))
    assert data["resume_from"].endswith("step-000000012.pt")
    with pytest.raises(gc.Failed, match="no step checkpoint at a multiple of 3"):
        gc.check_train(Canned(tmp_path / "2", {key: trained([8, 16])}, results))


def test_the_driver_stage_names_a_gpu_torch_cannot_use(tmp_path):
    env = {"gpu_problem": "the NVIDIA driver shows 8 GPUs (H100) but torch cannot use them: ...",
           "cuda_available": False, "gpus": [], "backends": {"nccl": True}, "torch": "2.14.1"}
    with pytest.raises(gc.Failed, match="driver shows 8 GPUs"):
        gc.check_driver(Canned(tmp_path, {"env": env}))


@pytest.mark.skipif(gc.gpu_here(), reason="a GPU here: make gpu-check would run for real")
def test_on_a_cpu_only_machine_it_says_so_and_exits_2(tmp_path, capsys):
    assert gc.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA GPU on this machine" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


@pytest.mark.skipif(gc.gpu_here(), reason="a GPU here: the bench would run")
def test_bench_step_on_cuda_without_a_gpu_is_refused_before_any_worker():
    from conftest import ddp_in_process

    refused = ddp_in_process("bench", "step", "--device", "cuda", "--json")
    assert refused.returncode == 2 and "--device cuda: 0 CUDA GPUs here" in refused.stdout
    assert ddp_in_process("bench", "step", "--device", "tpu").returncode == 2
