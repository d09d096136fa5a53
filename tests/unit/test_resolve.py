"""The resolve pass (ddp_cli/config/resolve.py): every "auto" and derived key made concrete from the run's
facts, in one place; and a test that no other module of the package resolves one."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from ddp_cli.config import config_from_dict, load_config
from ddp_cli.config.resolve import (
    AUTO_KEYS,
    DERIVED_KEYS,
    PROGRESSIVE_FLOOR,
    PROGRESSIVE_FROM,
    Facts,
    Pretrained,
    autos,
    decode_measured,
    decode_pending,
    default_min_image_size,
    for_inference,
    method_recipe,
    prefetch_for,
    ramp_step,
    require_resolved,
    resolve,
    resume,
)
from ddp_cli.errors import ConfigError
from ddp_cli.run.as_trained import kept_lines
from ddp_cli.train.checkpoint import load_checkpoint

PACKAGE = Path(__file__).resolve().parents[2] / "ddp_cli"


def resolved(raw: dict, steps: int = 22, **facts) -> object:
    return resolve(config_from_dict(raw), Facts(steps_per_epoch=steps, **facts))


@pytest.mark.parametrize(("data", "resize"), [
    ({}, 256), ({"image_size": 112}, 128), ({"image_size": 32}, 37),
    ({"image_size": 112, "val_image_size": 144}, 165),   # the val crop's, not the train crop's
    ({"image_size": 112, "val_resize": 112}, 112),       # given: kept
])
def test_the_val_resize_follows_the_val_crop_as_the_usual_centre_crop(data, resize):
    """Unset val_resize is the val crop / 0.875: a 112 px crop from 128, not from a fixed 256 (which left
    a small image's val crop a 44% centre patch of what training saw)."""
    assert config_from_dict({"data": data}).data.val_resize == data.get("val_resize")  # unset until resolved
    assert resolved({"data": data}).data.val_resize == resize


@pytest.mark.parametrize(("decay", "steps", "at"), [
    ("auto", 22, 0.99),  # the demo's 22 steps an epoch: at least 100 steps averaged
    ("auto", 1250, 1 - 1 / 1250),  # ImageNet at 1,024 a step: an epoch
    (0.9, 1250, 0.9), (0, 22, 0),  # given: kept (0 = no EMA)
])
def test_the_ema_decay_averages_over_an_epoch_of_at_least_100_steps_unless_given(decay, steps, at):
    assert resolved({"train": {"ema_decay": decay}}, steps).train.ema_decay == pytest.approx(at)


def test_best_pt_follows_the_ema_by_default_and_the_trained_weights_without_one():
    """checkpoint.best_metric unset: the EMA's top-1 where the run has an EMA (by default), else top1;
    given, kept; an old run dir's config.toml (both written out) keeps what it trained with."""
    assert config_from_dict({}).checkpoint.best_metric is None
    assert resolved({}).checkpoint.best_metric == "ema_top1"
    assert resolved({"train": {"ema_decay": 0.999}}).checkpoint.best_metric == "ema_top1"
    assert resolved({"train": {"ema_decay": 0}}).checkpoint.best_metric == "top1"
    given = {"train": {"ema_decay": 0.999}, "checkpoint": {"best_metric": "top1"}}
    assert resolved(given).checkpoint.best_metric == "top1"
    old = resolved({"train": {"ema_decay": 0.0}, "checkpoint": {"best_metric": "top1"}})
    assert (old.train.ema_decay, old.checkpoint.best_metric) == (0.0, "top1")
    # a --set or a sweep's trial that turns the EMA off before the pass: derived from what it says
    off = config_from_dict({}).resolved({"train.ema_decay": 0})
    assert resolve(off, Facts()).checkpoint.best_metric == "top1"


@pytest.mark.parametrize(("method", "smoothing", "decay", "best"), [
    ("none", 0.1, 0.99, "ema_top1"),  # the default recipe: smoothing, an EMA that best.pt serves
    ("fixmatch", 0.0, 0.0, "top1"),  # a fixed threshold on the confidence: no smoothing; the live weights
    ("freematch", 0.1, 0.0, "top1"),  # a threshold that follows the confidence: smoothing kept
    ("softmatch", 0.1, 0.0, "top1"),
])
def test_a_semi_method_gets_the_recipe_fitted_to_it_where_the_config_leaves_the_keys_to_ddp(
        method, smoothing, decay, best):
    """Unset smoothing and an "auto" EMA under a semi-supervised method: the values measured for it
    (docs/semi-supervised.md), each with the plan's reason; given ones, and the EMA a teacher needs, kept."""
    cfg = resolved({"semi": {"method": method}})
    assert config_from_dict({}).optim.label_smoothing is None  # unset until resolved
    assert (cfg.optim.label_smoothing, cfg.train.ema_decay, cfg.checkpoint.best_metric) == (
        smoothing, pytest.approx(decay), best)
    fitted = method_recipe(config_from_dict({"semi": {"method": method}}), Facts(steps_per_epoch=22))
    assert ("optim.label_smoothing" in fitted) is (method == "fixmatch")
    assert ("train.ema_decay" in fitted) is (method != "none")
    assert all(isinstance(why, str) and why for _, why in fitted.values())
    given = {"semi": {"method": method}, "optim": {"label_smoothing": 0.05}, "train": {"ema_decay": 0.9}}
    assert (lambda c: (c.optim.label_smoothing, c.train.ema_decay))(resolved(given)) == (0.05, 0.9)
    assert method_recipe(config_from_dict(given), Facts()).keys() <= {"semi.stats_momentum"}
    if method != "none":  # the EMA teacher's pseudo-labels need an EMA: "auto" keeps its horizon
        teacher = resolved({"semi": {"method": method, "ema_teacher": True}})
        assert teacher.train.ema_decay == pytest.approx(0.99)


@pytest.mark.parametrize(("steps", "epochs", "accum", "momentum"), [
    (12, 12, 1, 0.99),  # the demo's 144 micro-steps: 100, the floor
    (1000, 100, 1, 0.99),  # 100,000
    (1000, 100, 5, 1 - 1 / 500),  # 500,000 micro-steps
    (1000, 1000, 1, 0.999),  # a million, the papers': 0.999
    (1000, 10000, 1, 0.999),  # beyond: the papers' still
])
def test_the_semi_statistics_momentum_follows_the_runs_micro_steps(steps, epochs, accum, momentum):
    """semi.stats_momentum unset: 1 - 1/horizon, the horizon 1/1000 of the micro-steps within 100-1000;
    derived only for the methods that read it (a fixmatch run's config.toml leaves it unset); given, kept."""
    for method in ("freematch", "softmatch"):
        raw = {"semi": {"method": method}, "train": {"epochs": epochs, "grad_accum": accum}}
        assert resolved(raw, steps).semi.stats_momentum == pytest.approx(momentum)
        given = {**raw, "semi": {"method": method, "stats_momentum": 0.9}}
        assert resolved(given, steps).semi.stats_momentum == 0.9
    for method in ("none", "fixmatch"):
        cfg = resolved({"semi": {"method": method}})
        assert cfg.semi.stats_momentum is None and autos(cfg) == set()
    assert autos(config_from_dict({"semi": {"method": "softmatch"}})) >= {"semi.stats_momentum"}


def test_a_resolved_semi_config_resolves_to_itself():
    """A semi run's config.toml holds the values fitted to its method: read back (a resume) on other
    facts, the pass changes none of them."""
    for method in ("fixmatch", "freematch", "softmatch"):
        cfg = resolved({"semi": {"method": method}, "train": {"epochs": 12}}, 12)
        again = config_from_dict(tomllib.loads(cfg.to_toml()))
        assert resolve(again, Facts(steps_per_epoch=99_999)) == again == cfg


@pytest.mark.parametrize(("sections", "steps", "epochs"), [
    ({"data": {"image_size": 32}}, 22, 4),     # the demo: 100 steps hold 4 epochs
    ({"data": {"image_size": 32}}, 25, 4),     # an epoch ending on the horizon's last step is within it
    ({"data": {"image_size": 32}}, 26, 3),
    ({"data": {"image_size": 112}}, 47, 2),    # the photos: 2 epochs within 100 steps
    ({"data": {"image_size": 32}, "train": {"epochs": 16}}, 5, 16),  # 20 epochs within: all 16 of the run
    ({"data": {"image_size": 224}, "train": {"epochs": 90}}, 1250, 1),  # ImageNet at 1,024 a step
    ({"data": {"image_size": 112}, "train": {"ema_decay": 0.99}}, 101, 0),  # an epoch past the horizon
    ({"data": {"image_size": 112}, "train": {"ema_decay": 0.999}}, 47, 8),  # 21 epochs within: all 8
    ({"data": {"image_size": 48}}, 22, 4),     # no progressive resizing by default at 48 px: the same rule
    ({"data": {"image_size": 112, "progressive": False}}, 22, 4),
    ({"data": {"image_size": 112}, "train": {"ema_decay": 0}}, 22, 0),  # no EMA
    ({"data": {"image_size": 112}, "train": {"ema_bn_epochs": 3}}, 47, 3),  # given: kept
    ({"data": {"image_size": 112}, "train": {"epochs": 3}}, 22, 3),  # 4 epochs within, of a run of 3
    ({"data": {"image_size": 32}, "train": {"epochs": 40, "ema_decay": 0.9}}, 1, 10),  # 10 one-step epochs
])
def test_the_ema_statistics_are_recomputed_within_its_horizon(sections, steps, epochs):
    """train.ema_bn_epochs "auto": the epochs that end within the EMA's horizon (1 / (1 - decay) steps), with
    progressive resizing or without; made concrete for the run's steps an epoch, and written out so."""
    raw = {"train": {"epochs": 8}, **{k: v for k, v in sections.items() if k != "train"}}
    raw["train"].update(sections.get("train", {}))
    cfg = resolved(raw, steps)
    assert cfg.train.ema_bn_epochs == epochs
    assert tomllib.loads(cfg.to_toml())["train"]["ema_bn_epochs"] == epochs
    assert config_from_dict({}).train.ema_bn_epochs == "auto"


def test_recomputing_the_ema_statistics_needs_an_ema():
    with pytest.raises(ConfigError, match=r"train.ema_bn_epochs: .*no EMA; set train.ema_decay"):
        config_from_dict({"train": {"ema_decay": 0, "ema_bn_epochs": 2}})
    for left in ("auto", 0):  # "auto" finds none to do
        assert resolved({"train": {"ema_decay": 0, "ema_bn_epochs": left}}).train.ema_bn_epochs == 0


def test_the_default_first_crop_at_its_edges():
    """default_min_image_size: on from PROGRESSIVE_FROM (32) px exactly; half the side to a multiple of 8
    (a half up) but never under PROGRESSIVE_FLOOR (24); off by default where the model may not be resized;
    None where the first crop would be the whole image (24 px) even when asked for."""
    def first(may_resize=True, **data):
        return default_min_image_size(config_from_dict({"data": data}).data, may_resize)

    assert first(image_size=PROGRESSIVE_FROM) == PROGRESSIVE_FLOOR == 24
    assert first(image_size=PROGRESSIVE_FROM - 1) is None
    assert first(image_size=PROGRESSIVE_FROM - 1, progressive=True) == 24
    assert [first(image_size=s) for s in (40, 47, 48, 56, 64, 72, 80)] == [24, 24, 24, 32, 32, 40, 40]
    assert first(image_size=24, progressive=True) is None
    assert first(False, image_size=112) is None and first(False, image_size=112, progressive=True) == 56


def test_the_device_decides_precision_decode_and_the_loaders_as_the_facts_say():
    cpu = resolved({}, loader_workers=3)
    assert (cpu.train.precision, cpu.data.decode, cpu.data.workers, cpu.data.prefetch_factor) == (
        "fp32", "cpu", 3, 2)
    gpu = resolved({"data": {"prefetch_factor": "auto"}}, device="cuda", native_precision="bf16",
                   gpu_decode=True, loader_workers=1)
    assert (gpu.train.precision, gpu.data.decode, gpu.data.workers, gpu.data.prefetch_factor) == (
        "bf16", "auto", 1, 4)  # both paths run: left to the workers' measurement
    assert autos(gpu) == {"data.decode"} and decode_pending(gpu)
    bicubic = {"augment": {"policy": "randaugment", "interpolation": "bicubic"}}
    assert resolved(bicubic, gpu_decode=True).data.decode == "cpu"  # v2's tensor kernels rotate bilinear
    strong = {"semi": {"method": "fixmatch"}, "augment": {"interpolation": "bicubic"}}  # the strong view's
    assert resolved(strong, gpu_decode=True).data.decode == "cpu"
    given = {"train": {"precision": "fp32"}, "data": {"decode": "cpu", "workers": 0}}
    assert (lambda c: (c.train.precision, c.data.decode, c.data.workers))(
        resolved(given, native_precision="bf16", gpu_decode=True, loader_workers=5)) == ("fp32", "cpu", 0)


def test_a_resolved_config_has_nothing_left_and_resolves_to_itself():
    """What the run writes out (config.toml) holds every key concrete: read back and resolved again (a
    resume from it, on the same facts) it is the same config, so the run resumes as it trained."""
    facts = Facts(steps_per_epoch=22, loader_workers=1)
    cfg = resolve(config_from_dict({"data": {"image_size": 32}, "train": {"epochs": 8}}), facts)
    assert autos(cfg) == set()
    again = config_from_dict(tomllib.loads(cfg.to_toml()))
    assert resolve(again, Facts(steps_per_epoch=99, loader_workers=7)) == again == cfg
    assert autos(config_from_dict({})) == (set(AUTO_KEYS) | set(DERIVED_KEYS)) - {"data.prefetch_factor"}


def test_what_runs_a_config_refuses_one_left_unresolved():
    with pytest.raises(ValueError, match=r"the Trainer needs a resolved config .*train\.ema_decay"):
        require_resolved(config_from_dict({}), "the Trainer")
    require_resolved(resolved({}), "the Trainer")


def test_a_resume_keeps_a_run_that_trained_without_recomputing_its_ema_statistics_without():
    cfg = resolved({"train": {"epochs": 8}})
    assert cfg.train.ema_bn_epochs == 4
    assert resume(cfg, config_from_dict({"train": {"ema_bn_epochs": 0}})).train.ema_bn_epochs == 0
    assert resume(cfg, config_from_dict({"train": {"ema_bn_epochs": 2}})) is cfg  # it had them: as resolved


def test_a_resume_keeps_the_ramp_step_it_trained_with_unless_the_config_names_another():
    """A checkpoint from before data.ramp_step (migrate gives it 32) goes on in 32 px steps where this
    config derives the rule's; a step the config names is the user's; a checkpoint without one (a bare
    config) changes nothing. What the resume keeps is said (`run.as_trained.kept_lines`)."""
    cfg = resolved({"data": {"image_size": 64}, "train": {"epochs": 30}})
    assert cfg.data.ramp_step == ramp_step(64) == 8
    kept = resume(cfg, config_from_dict({"data": {"image_size": 64, "ramp_step": 32}}))
    assert kept.data.ramp_step == 32 and kept.data.min_image_size == cfg.data.min_image_size
    assert kept_lines(cfg, kept) == [
        "data.ramp_step: 32 px, as the checkpoint trained (this config derives 8)"]
    named = resolved({"data": {"image_size": 64, "ramp_step": 16}})
    assert resume(named, config_from_dict({"data": {"ramp_step": 32}})) is named
    assert resume(cfg, config_from_dict({"data": {"image_size": 64}})) is cfg
    assert kept_lines(cfg, cfg) == []


def test_a_resume_keeps_the_ramps_end_it_trained_with_unless_the_config_names_another():
    """A checkpoint from before data.end_image_size (migrate gives it image_size: its ramp rose there) goes
    on at image_size where this config derives FixRes' end; an end the config names is the user's."""
    cfg = resolved({"data": {"image_size": 112}, "train": {"epochs": 8}})
    assert cfg.data.end_image_size == 96
    trained = config_from_dict({"data": {"image_size": 112, "min_image_size": 56, "ramp_step": 16,
                                         "end_image_size": 112}})
    kept = resume(cfg, trained)
    assert kept.data.end_image_size == 112 and kept.data.train_size(7) == 112
    assert kept_lines(cfg, kept) == [
        "data.end_image_size: 112 px, as the checkpoint trained (this config derives 96)"]
    named = resolved({"data": {"image_size": 112, "end_image_size": 104}, "train": {"epochs": 8}})
    assert resume(named, trained) is named
    off = resolved({"data": {"image_size": 112, "progressive": False}})
    assert resume(off, trained) is off  # no ramp now: nothing to keep
    other = config_from_dict({"data": {"image_size": 112, "min_image_size": 16, "ramp_step": 16,
                                       "end_image_size": 24}})
    assert resume(cfg, other).data.end_image_size == 96  # another ramp's end (under this first crop) goes


def test_the_workers_measurement_makes_decode_concrete_and_a_resume_keeps_the_checkpoints_path():
    """data.decode left "auto" (both paths can run) takes what the workers measured; a resume takes the
    path its checkpoint trained with, measuring nothing; "cpu" and "gpu" given are never changed."""
    pending = resolved({}, gpu_decode=True)
    with pytest.raises(ValueError, match=r"the Trainer needs a resolved config .*data\.decode"):
        require_resolved(pending, "the Trainer")
    measured = decode_measured(pending, "gpu")
    assert measured.data.decode == "gpu" and autos(measured) == set()
    assert decode_measured(pending, "cpu").data.decode == "cpu"
    with pytest.raises(ValueError, match="cpu or gpu"):
        decode_measured(pending, "auto")
    forced = resolved({"data": {"decode": "cpu"}}, gpu_decode=True)
    assert decode_measured(forced, "gpu") is forced  # a path given is the user's
    trained = config_from_dict({"data": {"decode": "gpu"}})
    assert resume(pending, trained).data.decode == "gpu"
    assert resume(forced, trained) is forced
    assert decode_pending(resume(pending, config_from_dict({})))  # a checkpoint left it to measure


def test_inference_resolves_a_checkpoints_precision_and_loaders_on_this_machine():
    old = config_from_dict({"train": {"precision": "auto"}, "data": {"workers": "auto"}})
    cfg = for_inference(old, "bf16", 2)
    assert (cfg.train.precision, cfg.data.workers, cfg.data.prefetch_factor) == ("bf16", 2, 2)
    kept = config_from_dict({"train": {"precision": "fp32"}, "data": {"workers": 0}})
    assert (lambda c: (c.train.precision, c.data.workers))(for_inference(kept, "bf16", 2)) == ("fp32", 0)


@pytest.mark.parametrize(("trained", "here", "path"), [
    ("gpu", False, "cpu"),  # trained on GPUs, validated on a CPU-only machine: decoded on its CPU
    ("gpu", True, "gpu"), ("cpu", True, "cpu"),  # a concrete path, where this machine has it, is kept
    ("auto", True, "cpu"), ("auto", False, "cpu"),  # never measured for one pass: the CPU path
])
def test_inference_decodes_on_the_path_this_machine_has(trained, here, path):
    cfg = for_inference(config_from_dict({"data": {"decode": trained}}), "fp32", 0, gpu_decode=here)
    assert cfg.data.decode == path


def test_a_timm_models_pretrained_data_config_fills_only_what_the_config_leaves_unset():
    weights = Pretrained("timm/resnet50.a1_in1k", "abc123", {
        "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], "interpolation": "bicubic",
        "input_size": [3, 160, 160], "crop_pct": 0.95})
    cfg = resolved({"model": {"name": "timm/resnet50", "weights": "pretrained"}}, pretrained=weights)
    assert (cfg.model.name, cfg.model.source.revision) == ("timm/resnet50.a1_in1k", "abc123")
    assert (cfg.data.mean, cfg.data.val_interpolation, cfg.data.val_image_size, cfg.data.val_resize) == (
        (0.5, 0.5, 0.5), "bicubic", 160, 168)
    assert cfg.model.source.from_weights == ["data.mean", "data.std", "data.val_image_size",
                                             "data.val_interpolation", "data.val_resize"]
    given = resolved({"model": {"name": "timm/resnet50", "weights": "pretrained"},
                      "data": {"image_size": 128, "mean": [0.1, 0.2, 0.3]}}, pretrained=weights)
    assert (given.data.mean, given.data.val_image_size, given.data.val_resize) == ((0.1, 0.2, 0.3), None, 134)


# The one resolve pass, held by reading the package: a comparison of one of the keys resolve makes concrete
# with "auto" anywhere but in ddp_cli/config/ is a module resolving it on its own; so is a `resolved()`
# call that fills one of those keys, or a derived one.
RESOLVED_LEAVES = {key.split(".")[1] for key in (*AUTO_KEYS, *DERIVED_KEYS, "data.min_image_size")}


def outside_config() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "config" not in p.relative_to(PACKAGE).parts[:1]]


def auto_reads(tree: ast.AST) -> list[int]:
    """Lines comparing `<...>.<a key resolve owns>` with "auto"."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = {s.attr for s in sides if isinstance(s, ast.Attribute)}
            autos_ = [s for s in sides if isinstance(s, ast.Constant) and s.value == "auto"]
            if autos_ and names & RESOLVED_LEAVES:
                lines.append(node.lineno)
    return lines


def derived_fills(tree: ast.AST) -> list[int]:
    """Lines calling `.resolved({...})` with a key resolve owns."""
    owned = {*AUTO_KEYS, *DERIVED_KEYS, "data.min_image_size"}
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "resolved"
            and any(isinstance(arg, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in owned
                                                      for k in arg.keys) for arg in node.args)]


def test_no_module_but_the_resolve_pass_makes_an_auto_concrete_or_fills_a_derived_key():
    found = {str(p.relative_to(PACKAGE)): lines for p in outside_config()
             if (lines := auto_reads(tree := ast.parse(p.read_text())) + derived_fills(tree))}
    assert found == {}


def test_the_scan_finds_what_it_looks_for():
    """The two probes above on code that breaks the rule, so a blind scan cannot pass."""
    assert auto_reads(ast.parse('x = cfg.train.precision == "auto"')) == [1]
    assert auto_reads(ast.parse('x = "auto" != cfg.data.workers')) == [1]
    assert auto_reads(ast.parse('x = resume == "auto"')) == []  # not a config key: --resume's own "auto"
    assert derived_fills(ast.parse('cfg = cfg.resolved({"data.val_resize": 128})')) == [1]
    assert derived_fills(ast.parse('cfg = cfg.resolved({"data.batch_size": 8})')) == []


def test_a_run_dir_of_the_release_before_the_resolve_pass_resolves_to_itself():
    """tests/fixtures/run-0.1.0: a demo run dir written by ddp 0.1.0 (before the config package). Its
    config.toml holds every key as that release resolved it but data.ramp_step and data.end_image_size,
    keys since; the pass changes none of the others on any facts, and the resume keeps the step and the
    end its checkpoint trained with (migrated: 32 px steps up to image_size, 32 px), so the run resumes as
    it trained (tests/e2e/test_old_run_dir.py: the same weights)."""
    fixture = PACKAGE.parent / "tests/fixtures/run-0.1.0"
    written = load_config(fixture / "config.toml")
    assert autos(written) == {"data.ramp_step"}
    trained = config_from_dict(load_checkpoint(fixture / "checkpoints/step-000000008.pt")["config"])
    for facts in (Facts(), Facts("cuda", "bf16", 8, 1250, False, True, 7)):
        again = resolve(written, facts)
        assert again == written.resolved({"data.ramp_step": 8, "data.end_image_size": 24})
        assert resume(again, trained) == written.resolved({"data.ramp_step": 32, "data.end_image_size": 32})


def test_the_facts_each_reach_their_key():
    """Each fact lands in its own key, and two at once both land (a pure pass: what a caller hands in)."""
    assert resolved({}, weights_file="/w/model.pt").model.weights == "/w/model.pt"
    weights = Pretrained("timm/resnet50.a1_in1k", "abc123", {"interpolation": "bilinear",
                                                               "input_size": [3, 150, 160]})
    both = resolved({"model": {"name": "timm/resnet50", "weights": "pretrained"}}, pretrained=weights,
                    weights_file="/w/model.pt")
    assert (both.model.weights, both.model.name) == ("/w/model.pt", "timm/resnet50.a1_in1k")
    assert (both.data.val_interpolation, both.data.val_image_size) == ("bilinear", 160)  # (C, H, W): W
    assert [prefetch_for(w) for w in (0, 1, 2, 3, 8)] == [2, 4, 2, 2, 2]
    assert for_inference(config_from_dict({}), "fp32", 1).data.prefetch_factor == 2  # as given: 2
    one = for_inference(config_from_dict({"data": {"prefetch_factor": "auto"}}), "fp32", 1)
    assert (one.data.workers, one.data.prefetch_factor) == (1, 4)


def test_progressive_resizing_at_its_edges():
    """Asked for where its first crop would be the whole image: asked, but nothing to ramp (no first crop);
    off: the ramp written as [0, 0], as config.toml always held it; a ramp given from epoch 0: on."""
    tiny = resolved({"data": {"image_size": 24, "progressive": True}})
    assert (tiny.data.progressive, tiny.data.min_image_size, tiny.data.ramp_epochs) == (True, None, [0, 0])
    off = resolved({"data": {"image_size": 112, "progressive": False}})
    assert (off.data.progressive, off.data.ramp_epochs) == (False, [0, 0])
    early = resolved({"data": {"image_size": 112, "ramp_epochs": [0, 8]}, "train": {"epochs": 8}})
    assert (early.data.progressive, early.data.min_image_size, early.data.ramp_epochs) == (True, 56, [0, 8])
    with pytest.raises(ValueError, match=r"still left to ddp: checkpoint\.best_metric, data\.decode, "):
        require_resolved(config_from_dict({}), "the Trainer")


def test_the_plan_says_why_the_recipe_fits_the_method():
    """The dry-run plan's `semi.recipe_for_the_method` reasons, word for word (what the user reads), and the
    horizon of a run past 100,000 micro-steps is their whole thousandth (150 of 150,500, not 150.5)."""
    def why(method: str, steps: int = 12, epochs: int = 12) -> dict:
        cfg = config_from_dict({"semi": {"method": method}, "train": {"epochs": epochs}})
        return {key: reason for key, (_, reason) in method_recipe(cfg, Facts(steps_per_epoch=steps)).items()}

    live = "the live weights validated as well as or better than their average, and best.pt serves them"
    assert why("fixmatch") == {
        "optim.label_smoothing": "off under fixmatch: smoothing caps the confidence its fixed semi.threshold "
                                 "(0.95) reads",
        "train.ema_decay": f"no EMA under fixmatch: {live}"}
    assert why("freematch")["semi.stats_momentum"] == (
        "1 - 1/100: the run's 144 micro-steps (the papers' 0.999 is for a million)")
    long_run = resolved({"semi": {"method": "softmatch"}, "train": {"epochs": 1}}, 150_500)
    assert long_run.semi.stats_momentum == pytest.approx(1 - 1 / 150)


def test_simclr_runs_without_an_ema_and_without_progressive_resizing_and_the_plan_says_why():
    raw = {"data": {"image_size": 64}, "model": {"name": "resnet_tiny"}}
    supervised, simclr = resolved(raw), resolved({**raw, "pretrain": {"method": "simclr"}})
    assert supervised.train.ema_decay > 0 and supervised.data.progressive is True  # the default recipe
    assert simclr.train.ema_decay == 0 and simclr.data.progressive is False
    assert simclr.checkpoint.best_metric == "top1"
    pretrain = {**raw, "pretrain": {"method": "simclr"}}
    fitted = method_recipe(config_from_dict(pretrain), Facts(steps_per_epoch=22))
    assert fitted["train.ema_decay"] == (0.0, "no EMA under pretrain.method = simclr: its checkpoint is a "
                                         "start, and a later run starts from the live weights")
    kept = config_from_dict({**pretrain, "train": {"ema_decay": 0.9}})
    assert "train.ema_decay" not in method_recipe(kept, Facts(steps_per_epoch=22))  # the config's kept
