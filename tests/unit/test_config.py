"""The run config: TOML in, typed sections out, every mistake a ConfigError naming file and key."""

from __future__ import annotations

import re
import tomllib
import typing

import pytest
from pydantic import BaseModel, ValidationError

from ddp_cli.config import AugmentConfig, DataConfig, RunConfig, apply_override, config_from_dict, load_config
from ddp_cli.config.resolve import Facts, resolve
from ddp_cli.errors import ConfigError

VALID = """\
name = "tiny-demo"
seed = 7

[data]
dataset = "demo"
classes = 5
batch_size = 16

[optim]
name = "adamw"
lr = 0.003

[schedule]
name = "onecycle"
warmup_epochs = 1.5

[distributed]
nproc_per_node = 2
"""


def write(tmp_path, text: str, name: str = "run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_valid_config_reads_every_section(tmp_path):
    cfg = load_config(write(tmp_path, VALID))
    assert cfg.name == "tiny-demo"
    assert cfg.seed == 7
    assert cfg.data.dataset == "demo"
    assert cfg.data.classes == 5
    assert cfg.data.batch_size == 16
    assert cfg.optim.name == "adamw"
    assert cfg.optim.lr == pytest.approx(0.003)
    assert cfg.schedule.name == "onecycle"
    assert cfg.schedule.warmup_epochs == pytest.approx(1.5)
    assert cfg.distributed.nproc_per_node == 2
    assert cfg.train.epochs == RunConfig().train.epochs  # untouched sections keep defaults


def test_toml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, 'name = "x"\n\n[data]\nbatch_size = = 3\n', name="broken.toml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "broken.toml" in message
    assert "line 4" in message


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml"):
        load_config(tmp_path / "nope.toml")


def test_unknown_key_names_section_and_suggests(tmp_path):
    path = write(tmp_path, "[optim]\nlrr = 0.1\n", name="typo.toml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "typo.toml" in message
    assert "optim.lrr: unknown key (did you mean 'lr'?)" in message


def test_unknown_key_in_nested_section_suggests_the_right_field(tmp_path):
    path = write(tmp_path, "[data]\nbatchsize = 8\n")
    with pytest.raises(ConfigError, match=r"data\.batchsize: unknown key \(did you mean 'batch_size'"):
        load_config(path)
    deeper = write(tmp_path, "[logging.wandb]\nproject = 'p'\nnmae = 'x'\n")  # two sections down
    with pytest.raises(ConfigError, match=r"logging\.wandb\.nmae: unknown key \(did you mean 'name'"):
        load_config(deeper)


@pytest.mark.parametrize(("text", "key"), [
    ("[optim]\nlr = -1.0\n", "optim.lr: "),
    ("[train]\nprecision = \"fp8\"\n", "train.precision: "),
    ("[data]\nbatch_size = \"many\"\n", "data.batch_size: "),
    ("[data]\nclasses = 3.5\n", "data.classes: "),
    ("[distributed]\nnproc_per_node = 0\n", "distributed.nproc_per_node: "),
])
def test_bad_value_is_reported_as_section_dot_key(tmp_path, text, key):
    path = write(tmp_path, text, name="bad.toml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {key}"), message


def test_config_error_exit_code_is_2(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "[optim]\nlr = 0\n"))
    assert info.value.exit_code == 2
    assert ConfigError("x").exit_code == 2


def test_override_parses_toml_values():
    raw: dict = {"optim": {"lr": 0.1}}
    apply_override(raw, "optim.lr=0.2")
    apply_override(raw, "train.epochs=3")
    apply_override(raw, "model.channels_last=true")
    apply_override(raw, "schedule.milestones=[1, 2.5]")
    assert raw == {"optim": {"lr": 0.2}, "train": {"epochs": 3}, "model": {"channels_last": True},
                   "schedule": {"milestones": [1, 2.5]}}
    assert isinstance(raw["optim"]["lr"], float)
    assert isinstance(raw["train"]["epochs"], int)


def test_override_creates_nested_sections():
    raw: dict = {}
    apply_override(raw, "a.b.c=1")
    assert raw == {"a": {"b": {"c": 1}}}


def test_override_bare_and_quoted_strings():
    raw: dict = {}
    apply_override(raw, "data.dataset=demo")
    assert raw["data"]["dataset"] == "demo"
    apply_override(raw, 'data.dataset="imagenet_local"')
    assert raw["data"]["dataset"] == "imagenet_local"
    apply_override(raw, "name='single-quoted'")
    assert raw["name"] == "single-quoted"


@pytest.mark.parametrize("item", ["foo", "=3", "  =x"])
def test_malformed_override_raises(item):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_override({}, item)


def test_override_through_a_value_raises():
    with pytest.raises(ConfigError, match="not a section"):
        apply_override({"seed": 0}, "seed.x=1")


def test_overrides_apply_before_validation(tmp_path):
    cfg = load_config(write(tmp_path, VALID), ["optim.lr=0.2", "data.dataset=other", "train.epochs=2"])
    assert cfg.optim.lr == pytest.approx(0.2)
    assert cfg.data.dataset == "other"
    assert cfg.train.epochs == 2
    with pytest.raises(ConfigError, match=r"optim\.lrr: unknown key"):
        load_config(write(tmp_path, VALID), ["optim.lrr=0.2"])


@pytest.mark.parametrize("raw", [
    {},
    {"name": "rt", "seed": 3, "data": {"classes": ["n01", "n02"], "on_bad_image": "skip"},
     "optim": {"lr": 0.05, "nesterov": True}, "schedule": {"milestones": [2, 4.5]},
     "distributed": {"nproc_per_node": 3, "reduce": "bf16"}},
    {"data": {"classes": 4}, "optim": {"lr_per_256": 0.4}},
])
def test_to_toml_round_trips(raw):
    cfg = config_from_dict(raw)
    text = cfg.to_toml()
    again = config_from_dict(tomllib.loads(text))
    assert again == cfg
    assert again.model_dump() == cfg.model_dump()


def test_the_config_is_frozen_and_resolved_only_as_a_validated_copy():
    cfg = config_from_dict({"data": {"batch_size": 16, "workers": "auto"}, "train": {"grad_accum": 2}})
    for section, key, value in (("data", "workers", 3), ("optim", "lr", 0.5), ("train", "epochs", 9)):
        with pytest.raises(ValidationError, match="frozen"):
            setattr(getattr(cfg, section), key, value)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.name = "other"
    resolved = cfg.resolved({"data.workers": 3, "logging.wandb.project": "p"})
    assert (resolved.data.workers, resolved.logging.wandb.project, cfg.data.workers) == (3, "p", "auto")
    assert (resolved.data.batch_size, resolved.train.grad_accum) == (16, 2)  # the rest of a section kept
    with pytest.raises(ConfigError, match=r"^resolved config: data\.workers: "):
        cfg.resolved({"data.workers": -1})
    with pytest.raises(ConfigError, match=r"^--set: data\.workers: "):
        cfg.resolved({"data.workers": -1}, "--set")


@pytest.mark.parametrize(("raw", "world", "batch", "lr"), [
    ({"data": {"batch_size": 16}, "train": {"grad_accum": 2}, "optim": {"lr_per_256": 0.1}}, 4, 128, 0.05),
    ({"data": {"batch_size": 32}, "optim": {"lr_per_256": 0.2}}, 3, 96, 0.075),
    ({"data": {"batch_size": 32}, "optim": {"lr": 0.3, "lr_per_256": 0.2}}, 8, 256, 0.3),  # absolute wins
])
def test_global_batch_and_the_lr_rule(raw, world, batch, lr):
    cfg = config_from_dict(raw)
    assert cfg.global_batch(world) == batch
    assert cfg.lr(world) == pytest.approx(lr)


REQUIRED = {"logging.wandb": {"project": "p"}}  # sections whose presence needs a key of their own


def sections(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every section's dotted path, nested ones included, walked from the models themselves."""
    found = []
    for name, field in model.model_fields.items():
        for candidate in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                found += [f"{prefix}{name}", *sections(candidate, f"{prefix}{name}.")]
    return found


def test_the_walk_finds_every_section():
    assert {"data", "optim", "logging", "logging.wandb"} <= set(sections())
    assert len(sections()) == len(set(sections())) >= 10


@pytest.mark.parametrize("section", ["", *sections()])
def test_every_section_refuses_an_unknown_key_naming_it(section):
    raw: dict = {}
    node, path = raw, []
    for part in section.split(".") if section else []:
        path.append(part)
        node = node.setdefault(part, dict(REQUIRED.get(".".join(path), {})))
    node["bogus_key"] = 1
    key = f"{section}.bogus_key" if section else "bogus_key"
    with pytest.raises(ConfigError, match=rf"^config: {re.escape(key)}: unknown key"):
        config_from_dict(raw)


@pytest.mark.parametrize(("mix_prob", "mixup", "cutmix", "mixing"), [
    (0.0, 0.2, 1.0, False), (0.5, 0.0, 0.0, False), (1.0, 0.2, 0.0, True), (1.0, 0.0, 1.0, True),
    (0.5, 0.8, 1.0, True), (1.0, 0.5, 0.0, True), (1.0, 0.0, 0.5, True),
])
def test_mixing_needs_a_probability_and_an_alpha(mix_prob, mixup, cutmix, mixing):
    cfg = AugmentConfig(mix_prob=mix_prob, mixup_alpha=mixup, cutmix_alpha=cutmix)
    assert cfg.mixing() is mixing


def test_an_override_value_may_hold_an_equals_sign():
    raw: dict = {}
    apply_override(raw, "data.dataset=a=b")
    assert raw == {"data": {"dataset": "a=b"}}


def test_progressive_sizes_are_every_train_crop_and_the_val_crop():
    cfg = DataConfig(image_size=256, min_image_size=128, ramp_epochs=[2, 6], val_image_size=288, ramp_step=32)
    assert cfg.sizes(8) == {128, 160, 192, 224, 256, 288}
    assert cfg.sizes(3) == {128, 288}
    assert DataConfig(image_size=224).sizes(3) == {224}
    off_grid = DataConfig(image_size=128, min_image_size=48, ramp_epochs=[2, 6], ramp_step=32)
    assert [off_grid.train_size(e) for e in (1, 2, 3)] == [48, 48, 64]  # the ramp's first epoch: still 48


@pytest.mark.parametrize(("raw", "message"), [
    ({"distributed": {"static_graph": True}, "train": {"grad_accum": 2}},
     "distributed.static_graph: DDP fails with it under no_sync, i.e. with train.grad_accum > 1 "
     "(pytorch/pytorch#143580); drop one of the two"),
    ({"checkpoint": {"best_metric": "ema_top1"}, "train": {"ema_decay": 0}},
     'checkpoint.best_metric: "ema_top1" needs an EMA; set train.ema_decay (e.g. 0.9998) or use "top1"'),
    ({"data": {"image_size": 64, "min_image_size": 96}},
     "data: min_image_size 96 is above image_size 64; progressive resizing only grows the crop"),
    ({"data": {"ramp_epochs": [-1, 2]}}, "data.ramp_epochs: expected [start, end] with 0 <= start <= end"),
    ({"data": {"ramp_epochs": [1, 2, 3]}}, "data.ramp_epochs: expected [start, end] with 0 <= start <= end"),
    ({"optim": {"betas": [1.0, 0.5]}}, "optim.betas: expected [beta1, beta2], each in [0, 1)"),
    ({"optim": {"betas": [0.9, 0.99, 0.9]}}, "optim.betas: expected [beta1, beta2], each in [0, 1)"),
])
def test_the_rules_across_keys_refuse_in_their_own_words(raw, message):
    with pytest.raises(ConfigError) as refused:
        config_from_dict(raw)
    assert str(refused.value) == f"config: {message}"


@pytest.mark.parametrize("raw", [
    {"distributed": {"static_graph": True}},  # grad_accum 1
    {"train": {"grad_accum": 2}},
    {"checkpoint": {"best_metric": "ema_top1"}, "train": {"ema_decay": 0.9}},
    {"data": {"image_size": 64, "min_image_size": 64, "ramp_epochs": [0, 0]}},  # the edges allowed
    {"data": {"ramp_epochs": [2, 2]}},
    {"optim": {"betas": [0.0, 0.5]}},
])
def test_the_rules_across_keys_let_their_edges_through(raw):
    config_from_dict(raw)


def test_more_problems_than_the_first_are_counted():
    with pytest.raises(ConfigError, match=r"^config: seed: .* \(and 1 more problem\)$"):
        config_from_dict({"seed": "x", "deterministic": "maybe"})
    with pytest.raises(ConfigError, match=r"^config: seed: .* \(and 2 more problems\)$"):
        config_from_dict({"seed": "x", "deterministic": "maybe", "data": {"batch_size": 0}})


@pytest.mark.parametrize(("section", "key", "before", "now"), [
    ("optim", "label_smoothing", 0.0, 0.1),
    ("data", "min_crop_scale", 0.08, 0.25),
])
def test_a_run_dirs_config_keeps_what_it_trained_with_when_a_default_changes(section, key, before, now):
    """config.toml is written in full: a run from before a default changed (its old value written out)
    resumes with that value; a config that leaves the key out gets the new default."""
    written = tomllib.loads(config_from_dict({section: {key: before}}).to_toml())
    assert written[section][key] == before
    assert getattr(getattr(config_from_dict(written), section), key) == before
    assert getattr(getattr(resolve(config_from_dict({}), Facts()), section), key) == now


@pytest.mark.parametrize(("policy", "interpolation", "bicubic"), [
    ("trivialaugment", "bicubic", True), ("trivialaugment", "bilinear", False), ("none", "bicubic", False)])
def test_a_policy_rotates_bicubic_only_when_there_is_a_policy(policy, interpolation, bicubic):
    assert AugmentConfig(policy=policy, interpolation=interpolation).bicubic_policy() is bicubic


def test_unknown_key_says_where_the_key_is_missing_and_what_a_section_holds():
    """The sweep space's check of its keys (sweep/space.py): the owner of the missing part, or the run
    config at the top; a section is not a key, with the first six of its keys; a part below a key."""
    from ddp_cli.config import OptimConfig, unknown_key

    assert unknown_key("optim.lr_per_256") is None
    assert unknown_key("optimiser").startswith("optimiser: unknown key: the run config has no 'optimiser'")
    assert unknown_key("optim.lrr").startswith("optim.lrr: unknown key: optim has no 'lrr'")
    assert unknown_key("optim.lr.scale").startswith("optim.lr.scale: unknown key: optim.lr has no 'scale'")
    six = ", ".join(list(OptimConfig.model_fields)[:6])
    assert unknown_key("optim") == f"optim: a section, not a key; name one of its keys ({six})"


def test_a_malformed_model_name_says_the_forms_it_takes():
    with pytest.raises(ConfigError, match=r'give "package\.module:factory" or "path/to/file\.py:factory" '
                                          r"\(relative to the run config's folder\)$"):
        config_from_dict({"model": {"name": "a b:make"}})
    with pytest.raises(ConfigError, match=r'give "timm/<architecture>" or "timm/<architecture>\.<pretrained '
                                          r'tag>", e\.g\. "timm/resnet50\.a1_in1k"$'):
        config_from_dict({"model": {"name": "timm/res net"}})


def test_an_unresolved_first_crop_trains_at_the_full_size_until_the_ramp_is_known():
    """A first crop given, the ramp left to the resolve pass: before the pass every epoch reads image_size
    (nothing has run yet), and no error."""
    assert DataConfig(image_size=32, min_image_size=16).train_size(0) == 32


def test_a_bicubic_strong_view_names_the_key_that_keeps_the_cpu_decode():
    """RunConfig.bicubic_replay: FixMatch's strong view resamples at augment.interpolation, which the device
    path replays bilinear only; a bicubic one names semi.strong, unless the strong view has no policy."""
    def replay(interpolation: str, strong: str) -> str | None:
        return config_from_dict({"augment": {"interpolation": interpolation},
                                 "semi": {"method": "fixmatch", "strong": strong}}).bicubic_replay()

    assert replay("bicubic", "randaugment") == 'semi.strong "randaugment"'
    assert replay("bicubic", "none") is None
    assert replay("bilinear", "randaugment+cutout") is None
    assert config_from_dict({"augment": {"interpolation": "bicubic"}}).bicubic_replay() is None


SIMCLR = {"pretrain": {"method": "simclr"}, "data": {"image_size": 16}, "model": {"name": "resnet_tiny"}}


@pytest.mark.parametrize(("keys", "message"), [
    ({"semi": {"method": "fixmatch", "labels_per_class": 2}}, "semi.method"),
    ({"semi": {"labels_per_class": 2}}, "semi.labels_per_class"),
    ({"augment": {"mixup_alpha": 0.2}}, "mixup_alpha"),
    ({"augment": {"cutmix_alpha": 1.0}}, "mixup_alpha"),
    ({"data": {"progressive": True}}, "data.progressive"),
    ({"data": {"min_image_size": 8}}, "data.min_image_size"),
    ({"data": {"end_image_size": 8}}, "data.end_image_size"),
    ({"optim": {"head_lr_mult": 10}}, "head_lr_mult"),
])
def test_what_would_read_labels_mix_or_resize_simclr_s_views_is_refused_naming_the_key(keys, message):
    raw = {**SIMCLR, **keys, "data": {**SIMCLR["data"], **keys.get("data", {})}}
    with pytest.raises(ConfigError, match=f"pretrain.method.*{message}"):
        config_from_dict(raw)
    config_from_dict(SIMCLR)  # alone: fine
    config_from_dict({k: v for k, v in raw.items() if k != "pretrain"})  # without it: fine
