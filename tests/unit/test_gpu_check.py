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


def test_the_bf16_stage_is_skipped_where_the_train_stage_ran_in_bf16_or_the_gpu_has_none(tmp_path):
    bf16 = next(s for s in gc.STAGES if s.name == "bf16")
    answer = {"epochs": 1, "precision": "bf16", "images_per_second": 9.0,
              "final": {"images": gc.VAL, "loss": 2.0}}
    hopper, volta = {"gpus": [{"capability": "9.0"}]}, {"gpus": [{"capability": "7.0"}]}
    for results, why in [({"driver": volta}, "no bf16"), ({"driver": hopper, "train": {"precision": "bf16"}},
                                                           "train stage ran in bf16")]:
        with pytest.raises(gc.Skipped, match=why):
            bf16.check(Canned(tmp_path, {}, {"data": {"registry": "r"}, **results}))
    ran = {"driver": hopper, "train": {"precision": "fp32"}, "data": {"registry": "r"}}
    line, _ = bf16.check(Canned(tmp_path, {"train configs/resnet50.toml": answer}, ran))
    assert line.startswith("bf16")


def test_the_driver_stage_names_a_gpu_torch_cannot_use(tmp_path):
    env = {"gpu_problem": "the NVIDIA driver shows 8 GPUs (H100) but torch cannot use them: ...",
           "cuda_available": False, "gpus": [], "backends": {"nccl": True}, "torch": "2.14.1"}
    with pytest.raises(gc.Failed, match="driver shows 8 GPUs"):
        gc.check_driver(Canned(tmp_path, {"env": env}))


def test_stages_picks_some_and_total_s_caps_the_whole_check(tmp_path, capsys):
    stages = [stage("a"), stage("b", needs=("a",)), stage("c")]
    assert gc.main(["--out", str(tmp_path / "1"), "--stages", "b,c"], stages=stages) == 1
    doc = json.loads((tmp_path / "1/report.json").read_text())
    got = {s["stage"]: (s["status"], s["detail"]) for s in doc["stages"]}
    assert got == {"b": ("not run", "needs a"), "c": ("ok", "c fine")}
    assert gc.main(["--out", str(tmp_path / "2"), "--total-s", "0"], stages=stages) == 1
    doc = json.loads((tmp_path / "2/report.json").read_text())
    assert doc["total_budget_s"] == 0 and {s["status"] for s in doc["stages"]} == {"not run"}
    with pytest.raises(SystemExit) as e:
        gc.main(["--out", str(tmp_path / "3"), "--stages", "a,nope"], stages=stages)
    assert e.value.code == 2 and "no stage nope" in capsys.readouterr().err


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


# ---- the input stage ----------------------------------------------------------------------------------


def test_cpu_time_busy_share_and_peak_memory_from_the_samples():
    stat = "cpu  100 5 50 800 45 0 10 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    assert gc.cpu_jiffies(stat) == (165, 1010)  # idle (800) and iowait (45) are not busy
    samples = [(1.0, 100, 1000), (2.0, 160, 1100), (3.0, 250, 1200), (4.0, 260, 1300)]
    assert gc.busy_between(samples, 2.5, 3.5) == pytest.approx(100 / 200)  # samples 2.0 to 4.0
    assert gc.busy_between(samples, 0.5, 3.0) is None  # nothing before the start
    assert gc.busy_between(samples, 2.0, 9.0) is None  # nothing after the end
    assert gc.peak_memory(["1200", "81000", "  640 ", "[N/A]"]) == 81000.0
    assert gc.peak_memory([]) is None


def test_the_steady_rate_leaves_out_the_first_logging_window():
    records = [{"split": "startup", "time": 0.0}, {"split": "train", "step": 4, "time": 10.0},
               {"split": "train", "step": 8, "time": 10.5}, {"split": "train", "step": 16, "time": 11.0},
               {"split": "val", "step": 16, "time": 12.0}]
    assert gc.steady_rate(records, 256) == (12 * 256 / 1.0, 10.0, 11.0)
    earlier = [{"split": "startup", "time": -9.0}, {"split": "train", "step": 4, "time": -5.0}]
    assert gc.steady_rate(earlier + records, 256) == (12 * 256 / 1.0, 10.0, 11.0)  # the last run's only
    with pytest.raises(gc.Failed, match="1 logging windows"):
        gc.steady_rate(records[:2], 256)
    # 8 batches decoded ahead of the first step (4 workers x 2): timed from the record at step 8
    assert gc.steady_rate(records, 256, ahead=8) == (8 * 256 / 0.5, 10.5, 11.0)
    with pytest.raises(gc.Failed, match="1 logging windows in metrics.jsonl from step 9"):
        gc.steady_rate(records, 256, ahead=9)


class Watched:
    """A monitor that saw the CPU `busy` and `peak` MiB used."""

    def __init__(self, busy: float, peak: float) -> None:
        self.busy, self.peak = busy, peak

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def busy_share(self, start: float, end: float) -> float:
        return self.busy

    def peak_mib(self) -> float:
        return self.peak


class InputContext(Canned):
    """The input stage's `ddp` answers: bench step at `synthetic` img/s, each run at its rate; the JPEGs
    taken as made."""

    def __init__(self, work: Path, synthetic: float, rates: dict[str, float], gpu: str) -> None:
        step = {"rows": [{"loop": "ddp", "channels_last": True, "precision": "bf16",
                          "images_per_second": synthetic, "peak_memory_mib": 30000.0},
                         {"loop": "ddp", "channels_last": False, "precision": "fp32",
                          "images_per_second": 1.0, "peak_memory_mib": 1.0}]}
        super().__init__(work, {"bench step": step, "train configs/resnet50.toml": self.train},
                         {"driver": {"gpus": [{"name": gpu}]}})
        self.rates, self.runs = rates, []
        self.monitor = lambda: Watched(0.4, 42000.0)

    def run(self, *argv: str):
        assert argv[1] == "benchmarks/make_jpegs.py" and "--copies" in argv
        return gc.subprocess.CompletedProcess(argv, 0, "6400 JPEGs, mean 108 KB", "")

    def train(self, args):
        """Logging windows at steps 4 to 24: the first two at once (the loader's batches ahead), then at the
        run's rate."""
        sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
        name = ("gpu_decode_compiled" if "train.compile=true" in sets else
                "gpu_decode" if 'data.decode="gpu"' in sets else "cpu_decode")
        self.runs.append((name, args[args.index("--nproc-per-node") + 1], sets))
        run_dir = Path(args[args.index("--run-dir") + 1])
        run_dir.mkdir(parents=True)
        seconds = 4 * gc.INPUT_BATCH / self.rates[name]
        # 8 batches prefetched (4 workers x 2): served at once, then one window each `seconds`
        records = [{"split": "train", "step": 4 * k, "time": 100 + max(0, k - 2) * seconds}
                   for k in range(1, 7)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return {"epochs": 1, "images_per_second": 0.8 * self.rates[name],
                "data_workers": {"workers": 4, "prefetch_factor": 2},
                "final": {"images": gc.INPUT_VAL, "loss": 6.9, "top1": 0.1}}


RATES = {"cpu_decode": 1500.0, "gpu_decode": 3100.0, "gpu_decode_compiled": 3300.0}


def test_the_input_stage_measures_each_decode_against_synthetic_and_holds_its_goal_on_h100s(tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setattr(gc.os, "cpu_count", lambda: 16)
    ctx = InputContext(tmp_path, 3300.0, RATES, "NVIDIA H100 80GB HBM3")
    line, data = gc.check_input(ctx)
    assert [name for name, _, _ in ctx.runs] == ["cpu_decode", "gpu_decode", "gpu_decode_compiled"]
    assert all(nproc == "1" and "data.batch_size=256" in sets and 'train.precision="bf16"' in sets
               and "model.channels_last=true" in sets for _, nproc, sets in ctx.runs)
    runs = data["runs"]
    assert runs["gpu_decode"]["images_per_second"] == pytest.approx(3100.0)
    assert runs["cpu_decode"]["ratio_to_synthetic"] == pytest.approx(1500 / 3300)
    assert (runs["gpu_decode"]["cpu_busy_share"], runs["gpu_decode"]["peak_gpu_memory_mib"]) == (0.4, 42000.0)
    assert data["synthetic"] == {"images_per_second": 3300.0, "peak_memory_mib": 30000.0}
    assert data["goal_applies"] and data["goal"] == gc.INPUT_GOAL
    assert line.startswith("synthetic 3,300 img/s; cpu decode 1,500 img/s x0.45 (CPU 40%, 41.0 GiB); "
                           "gpu decode 3,100 img/s x0.94")


@pytest.mark.parametrize(("rates", "why"), [
    ({**RATES, "gpu_decode": 2900.0}, "want GPU decode >= x0.9"),  # x0.88
    ({**RATES, "gpu_decode": 2990.0, "gpu_decode_compiled": 2995.0}, r"and >= 3,000 img/s"),
])
def test_the_input_stage_fails_short_of_its_goal_where_it_applies(tmp_path, monkeypatch, rates, why):
    monkeypatch.setattr(gc.os, "cpu_count", lambda: 16)
    synthetic = 3300.0 if rates["gpu_decode"] == 2900.0 else 3000.0
    with pytest.raises(gc.Failed, match=why) as failed:
        gc.check_input(InputContext(tmp_path, synthetic, rates, "NVIDIA H200"))
    assert failed.value.data["runs"]["gpu_decode"]["images_per_second"] == pytest.approx(rates["gpu_decode"])


@pytest.mark.parametrize(("gpu", "cpus"), [("NVIDIA A10G", 16), ("NVIDIA H100 PCIe", 8)])
def test_the_input_stage_reports_without_its_goal_elsewhere(tmp_path, monkeypatch, gpu, cpus):
    monkeypatch.setattr(gc.os, "cpu_count", lambda: cpus)
    line, data = gc.check_input(InputContext(tmp_path, 3300.0, {**RATES, "gpu_decode": 900.0}, gpu))
    assert not data["goal_applies"] and f"not applied on {gpu}" in line


def test_the_input_stage_lands_in_the_report_and_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gc.os, "cpu_count", lambda: 16)
    ctx = InputContext(tmp_path / "work", 3300.0, RATES, "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(gc, "Context", lambda out: ctx)
    assert gc.main(["--out", str(tmp_path)], stages=[gc.Stage("input", 240, gc.check_input)]) == 0
    (stage,) = json.loads((tmp_path / "report.json").read_text())["stages"]
    assert stage["status"] == "ok" and stage["data"]["runs"]["gpu_decode"]["ratio_to_synthetic"] > 0.9
    out = capsys.readouterr().out  # the table folds the line at the terminal's width
    assert "synthetic" in out and "x0.94" in out and "all held" in out
