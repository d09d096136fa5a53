"""The resolve pass: the one place where "auto" values become concrete and unset keys are derived.

A validated config says what the user asked; `resolve` adds what the run's facts decide (the
device and its native precision, the world size, the steps per epoch, the model family, the
measured loader processes, a timm model's pretrained data config) and returns the frozen config
the run uses and writes out as its run dir's config.toml. Nothing else fills these keys:

- `train.precision` "auto": bf16 where the device computes it natively, else fp32;
- `data.decode` "auto": "cpu" where the rank cannot decode on its device (no nvJPEG torchvision, or
  an augment policy that does not replay there); where it can, left "auto" for the workers to measure
  both paths on the run's own data (`decode_measured` makes their choice concrete; a resume keeps
  the checkpoint's, `resume`);
- `data.workers` / `data.prefetch_factor` "auto": the measured rule (`data.pipeline.autotune`);
- `data.progressive`, `data.min_image_size`, `data.ramp_epochs`, `data.ramp_step`, `data.end_image_size`
  unset: the default recipe's progressive resizing (`progressive_defaults`), ending at FixRes' size
  (`fixres_size`); off by default under semi.method and pretrain.method;
- `data.val_resize` unset: the val crop over VAL_CROP_SHARE (or a timm model's crop_pct);
- `train.ema_decay` "auto": an average over about an epoch of steps, at least EMA_HORIZON (none under a
  semi-supervised method without an EMA teacher, nor under pretrain.method: `method_recipe`);
- `train.ema_bn_epochs` "auto": the epochs that end within the EMA's horizon;
- `checkpoint.best_metric` unset: the EMA's top-1 where the run has an EMA;
- `optim.label_smoothing` unset: LABEL_SMOOTHING (0 under FixMatch: `method_recipe`);
- `semi.stats_momentum` unset, under FreeMatch or SoftMatch: from the run's micro-steps (`stats_momentum`);
- a timm model's pretrained weights: their tag, revision and the `data.*` keys their data config sets.

`resume` reconciles a resolved config with the config of the checkpoint a run resumes from, and
`for_inference` resolves a checkpoint's config on the machine that validates or predicts with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ddp_cli.config.data import RAMP_ALIGN, DataConfig
from ddp_cli.config.run import RunConfig

VAL_CROP_SHARE = 0.875  # val: the centre crop's share of the resized side (224 of 256), as torchvision's
PROGRESSIVE_FROM = 32  # the smallest image_size progressive resizing is on for by default
PROGRESSIVE_SCALE = 0.5  # the default first crop, of image_size (Composer's initial_scale)
PROGRESSIVE_FLOOR = 24  # ... and at least this: below it a small image loses the detail its classes live in
PROGRESSIVE_RAMP = (0.1, 0.6)  # the default ramp, in fractions of the epochs: the last 40% at its end size
RAMP_STEPS = 8  # the ramp's step: image_size over this, to a multiple of RAMP_ALIGN
EMA_HORIZON = 100  # train.ema_decay "auto": averages over an epoch of steps, at least this many
AUTO_KEYS = ("train.precision", "data.decode", "data.workers", "data.prefetch_factor", "train.ema_decay",
             "train.ema_bn_epochs")  # keys whose "auto" only this pass makes concrete
# keys this pass derives from others when unset (data.min_image_size too, with data.progressive: unset
# after the pass where progressive resizing is off)
DERIVED_KEYS = ("data.progressive", "data.ramp_epochs", "data.ramp_step", "data.val_resize",
                "checkpoint.best_metric", "optim.label_smoothing")
ADAPTIVE = ("freematch", "softmatch")  # the methods with running statistics: semi.stats_momentum derived
# for them alone (unset elsewhere, where nothing reads it: an old run dir's config.toml stays as it was)
LABEL_SMOOTHING = 0.1  # optim.label_smoothing unset: timm's and torchvision's recipes
STATS_HORIZON = (100, 1000)  # semi.stats_momentum unset: 1 - 1/horizon, a 1/1000 of the micro-steps within


@dataclass(frozen=True)
class Pretrained:
    """A timm model's cached pretrained weights, as far as the config is concerned."""

    name: str  # "timm/<architecture>.<tag>": the tag made explicit
    revision: str  # the hub snapshot's commit
    data: dict[str, Any] = field(default_factory=dict)  # their data config (pretrained_cfg)


@dataclass(frozen=True)
class Facts:
    """What decides a run's "auto" and unset keys besides the config itself."""

    device: str = "cpu"  # cuda | cpu: what the workers train on
    native_precision: str = "fp32"  # bf16 where that device computes it natively, else fp32
    world_size: int = 1
    steps_per_epoch: int = 1  # a rank's optimisation steps per epoch
    takes_any_size: bool = True  # the model family: may ddp vary its input size (progressive resizing)
    gpu_decode: bool = False  # the rank can decode JPEGs on the workers' device (nvJPEG, or the CPU stand-in)
    loader_workers: int = 0  # data.workers "auto": what the measured rule chose
    pretrained: Pretrained | None = None
    weights_file: str | None = None  # model.weights as an absolute path, where it names a file


def autos(cfg: RunConfig) -> set[str]:
    """The keys of `cfg` still left to ddp: "auto" values and unset derived keys."""
    adaptive = cfg.semi.method in ADAPTIVE and cfg.semi.stats_momentum is None
    return ({key for key in AUTO_KEYS if cfg.value(key) == "auto"}
            | {key for key in DERIVED_KEYS if cfg.value(key) is None}
            | ({"semi.stats_momentum"} if adaptive else set()))


def decode_pending(cfg: RunConfig) -> bool:
    """Whether the workers still have to measure data.decode (the resolve pass left it "auto")."""
    return cfg.data.decode == "auto"


def require_resolved(cfg: RunConfig, user: str) -> None:
    """What runs a config (`user`: the Trainer, the loaders) takes it resolved, never an "auto"."""
    if left := autos(cfg):
        raise ValueError(f"{user} needs a resolved config (config.resolve); still left to ddp: "
                         f"{', '.join(sorted(left))}")


def resolve(cfg: RunConfig, facts: Facts) -> RunConfig:
    """`cfg` with every "auto" made concrete and every unset derived key filled from `facts`."""
    changes: dict[str, Any] = {}
    if facts.weights_file is not None:
        changes["model.weights"] = facts.weights_file
    if facts.pretrained is not None:
        changes |= pretrained_settings(cfg, facts.pretrained)
    data = cfg.resolved(changes).data if changes else cfg.data
    val_resize = data.val_resize or round((data.val_image_size or data.image_size) / VAL_CROP_SHARE)
    changes["data.val_resize"] = val_resize
    changes |= progressive_defaults(cfg, facts.takes_any_size, val_resize)
    if cfg.train.precision == "auto":
        changes["train.precision"] = facts.native_precision
    if cfg.data.decode == "auto" and (not facts.gpu_decode or cfg.bicubic_replay()):
        changes["data.decode"] = "cpu"  # one path only: nothing to measure
    workers = facts.loader_workers if cfg.data.workers == "auto" else cfg.data.workers
    changes["data.workers"] = workers
    if cfg.data.prefetch_factor == "auto":
        changes["data.prefetch_factor"] = prefetch_for(workers)
    fitted = {key: value for key, (value, _) in method_recipe(cfg, facts).items()}
    changes |= fitted
    if cfg.optim.label_smoothing is None:
        changes.setdefault("optim.label_smoothing", LABEL_SMOOTHING)
    decay = fitted.get("train.ema_decay", ema_decay(cfg, facts.steps_per_epoch))
    changes["train.ema_decay"] = decay
    changes["train.ema_bn_epochs"] = ema_bn_epochs(cfg, decay, facts.steps_per_epoch)
    if cfg.checkpoint.best_metric is None:
        changes["checkpoint.best_metric"] = "ema_top1" if decay else "top1"
    return cfg.resolved(changes)


def method_recipe(cfg: RunConfig, facts: Facts) -> dict[str, tuple[Any, str]]:
    """The default recipe's keys this pass sets otherwise for the run's semi-supervised or pre-training
    method, where the config leaves them to ddp: key -> (value, why), the why for the dry-run plan.
    Measured on the demo digits and the photo crops (docs/semi-supervised.md): smoothing caps the
    confidence FixMatch's fixed threshold reads (with smoothing e the fitted top probability is
    1 - e + e/classes, 0.91 at 0.1 and 10 classes: under the 0.95 default), and under every method the
    weights' EMA served a model no better than the live one at 30 epochs on the digits, and worse under
    FixMatch and FreeMatch."""
    semi, out = cfg.semi, {}
    if cfg.pretrain.on() and cfg.train.ema_decay == "auto":
        out["train.ema_decay"] = (0.0, f"no EMA under pretrain.method = {cfg.pretrain.method}: its "
                                  "checkpoint is a start, and a later run starts from the live weights")
    if not semi.on():
        return out
    if semi.method == "fixmatch" and cfg.optim.label_smoothing is None:
        out["optim.label_smoothing"] = (0.0, "off under fixmatch: smoothing caps the confidence its fixed "
                                        f"semi.threshold ({semi.threshold:g}) reads")
    if cfg.train.ema_decay == "auto" and not semi.ema_teacher:
        out["train.ema_decay"] = (0.0, f"no EMA under {semi.method}: the live weights validated as well as "
                                  "or better than their average, and best.pt serves them")
    if semi.method in ADAPTIVE and semi.stats_momentum is None:
        momentum = stats_momentum(cfg, facts.steps_per_epoch)
        out["semi.stats_momentum"] = (momentum, f"1 - 1/{round(1 / (1 - momentum))}: the run's "
                                      f"{micro_steps(cfg, facts.steps_per_epoch)} micro-steps (the papers' "
                                      "0.999 is for a million)")
    return out


def micro_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    """A rank's micro-steps over the run: what the semi statistics' EMA counts."""
    return steps_per_epoch * cfg.train.grad_accum * cfg.train.epochs


def stats_momentum(cfg: RunConfig, steps_per_epoch: int) -> float:
    """semi.stats_momentum unset: 1 - 1/horizon, the horizon a thousandth of the run's micro-steps within
    STATS_HORIZON (0.999, the papers', from a million; 0.99 under 100,000, which measured better than both
    0.999 and 0.9 in a run of 144)."""
    low, high = STATS_HORIZON
    return 1 - 1 / min(high, max(low, micro_steps(cfg, steps_per_epoch) // 1000))


def decode_measured(cfg: RunConfig, choice: str) -> RunConfig:
    """`cfg` with the data.decode its workers measured faster ("cpu" | "gpu": `run.decode_choice`), or
    the one the checkpoint it resumes from trained with (`resume`)."""
    if choice not in ("cpu", "gpu"):
        raise ValueError(f"data.decode: a measured choice is cpu or gpu, not {choice!r}")
    return cfg.resolved({"data.decode": choice}) if decode_pending(cfg) else cfg


def resume(cfg: RunConfig, trained: RunConfig) -> RunConfig:
    """The resolved `cfg` of a run resumed from a checkpoint trained with `trained`, changed where it
    must go on as it trained, so that it resumes to the same weights: a data.decode left to measure
    takes the path the checkpoint trained with (no measurement: its pixels are the path's), and a
    run that trained without recomputing its EMA's BatchNorm statistics (`train.ema_bn_epochs = 0`,
    which `migrate` gives a checkpoint from before the key) goes on without, and progressive resizing
    keeps the step and the end it trained with (32 px and image_size, which `migrate` gives a checkpoint
    from before data.ramp_step and data.end_image_size) unless the config names others than the rule's."""
    if decode_pending(cfg) and not decode_pending(trained):
        cfg = decode_measured(cfg, trained.data.decode)
    for key, rule in ramp_rules(cfg, trained).items():
        saved = trained.value(key)
        if saved not in (None, cfg.value(key)) and cfg.value(key) == rule:  # derived, or named as the rule
            cfg = cfg.resolved({key: saved})
    if trained.train.ema_bn_epochs == 0 and cfg.train.ema_bn_epochs != 0:
        return cfg.resolved({"train.ema_bn_epochs": 0})
    return cfg


def ramp_rules(cfg: RunConfig, trained: RunConfig) -> dict[str, int]:
    """The ramp's keys a resume keeps from its checkpoint, each with what the rule derives for `cfg`: the
    step always, the end where the config's ramp starts and stops as the checkpoint's did (another first
    crop or image_size is another ramp, whose end the rule derives)."""
    data, then = cfg.data, trained.data
    rules = {"data.ramp_step": ramp_step(data.image_size)}
    same_ramp = (data.min_image_size, data.image_size) == (then.min_image_size, then.image_size)
    if same_ramp and data.min_image_size is not None and data.val_resize is not None:
        rules["data.end_image_size"] = fixres_size(data, data.min_image_size, data.val_resize)
    return rules


def for_inference(cfg: RunConfig, native_precision: str, loader_workers: int,
                  gpu_decode: bool = False) -> RunConfig:
    """A checkpoint's config made concrete on the machine that validates or predicts with it: its
    precision (one the command chose, or "auto": this device's native one), its loaders, and its decode
    path: "gpu" where the checkpoint trained with it and this machine's workers can decode on their device
    (`gpu_decode`), else "cpu" (a GPU-trained checkpoint validates on a CPU-only machine; "auto" is not
    measured for one pass over the val split: its CPU path needs no device)."""
    changes: dict[str, Any] = {"data.workers": loader_workers if cfg.data.workers == "auto"
                               else cfg.data.workers,
                               "data.decode": "gpu" if cfg.data.decode == "gpu" and gpu_decode else "cpu"}
    if cfg.train.precision == "auto":
        changes["train.precision"] = native_precision
    if cfg.data.prefetch_factor == "auto":
        changes["data.prefetch_factor"] = prefetch_for(changes["data.workers"])
    return cfg.resolved(changes)


def prefetch_for(workers: int) -> int:
    """data.prefetch_factor "auto": torch's 2 batches per loader process, or more for fewer than two
    processes, so that four batches are queued per rank in all (2 for none: unused then)."""
    return max(2, math.ceil(4 / workers)) if workers else 2


def ema_decay(cfg: RunConfig, steps_per_epoch: int) -> float:
    """train.ema_decay made concrete for a run of `steps_per_epoch` steps an epoch (0 = no EMA)."""
    if cfg.train.ema_decay == "auto":
        return 1 - 1 / max(EMA_HORIZON, steps_per_epoch)
    return cfg.train.ema_decay


def ema_bn_epochs(cfg: RunConfig, decay: float, steps_per_epoch: int) -> int:
    """train.ema_bn_epochs made concrete. "auto": the epochs that end within the EMA's horizon. Until
    the run is as old as the horizon, the EMA's statistics still carry those of its first, fast-moving
    weights (and, with progressive resizing, of crops smaller than validation's); past it, the EMA's own
    average over the horizon's batches is the better estimate than a sample."""
    if cfg.train.ema_bn_epochs != "auto":
        return cfg.train.ema_bn_epochs
    if not decay:
        return 0
    return min(round(1 / (1 - decay)) // max(steps_per_epoch, 1), cfg.train.epochs)


def progressive_defaults(cfg: RunConfig, takes_any_size: bool, val_resize: int) -> dict[str, Any]:
    """The default recipe's progressive resizing made concrete (progressive, min_image_size, ramp_epochs,
    ramp_step, end_image_size) where the config leaves it to ddp: a first crop given, the ramp follows
    the run's epochs; none given, `default_min_image_size` decides whether it is on. It ends at
    `fixres_size` unless the config names its end."""
    data = cfg.data
    off = {"data.progressive": bool(data.progressive), "data.ramp_epochs": data.ramp_epochs or [0, 0],
           "data.ramp_step": data.ramp_step or ramp_step(data.image_size)}
    if data.progressive is False:
        return off
    ramp = data.ramp_epochs or [round(cfg.train.epochs * share, 2) for share in PROGRESSIVE_RAMP]
    start = data.min_image_size or default_min_image_size(
        data, takes_any_size and not cfg.semi.on() and not cfg.pretrain.on())
    if start is None or (ramp[-1] == 0 and data.min_image_size is None):  # off: a ramp ending at 0, or
        return off  # the default leaves it off
    end = data.end_image_size or fixres_size(data, start, val_resize)
    return off | {"data.progressive": True, "data.min_image_size": min(start, end),
                  "data.end_image_size": end, "data.ramp_epochs": ramp}


def fixres_size(data: DataConfig, start: int, val_resize: int) -> int:
    """data.end_image_size unset: the train crop at which objects look as large as validation shows them
    (FixRes, Touvron et al. 2019). A random crop of area scale s (uniform over [min_crop_scale, 1])
    magnifies the image by image_size / (sqrt(s) x its side), validation's resize by val_resize / its
    side: equal, on average, at E[sqrt(s)] x val_resize (0.78 x 128 = 96 px at 112, with the 0.25 scale).
    To a multiple of RAMP_ALIGN, within [start, image_size]. Measured against ending at image_size and
    against no ramp at 64 and 112 px, 8 and 30 epochs (docs/recipes.md)."""
    low = data.min_crop_scale
    mean_side = 1.0 if low >= 1 else 2 * (1 - low**1.5) / (3 * (1 - low))
    side = round(mean_side * val_resize / RAMP_ALIGN) * RAMP_ALIGN
    return min(data.image_size, max(start, side))


def ramp_step(image_size: int) -> int:
    """data.ramp_step unset: image_size / RAMP_STEPS to a multiple of RAMP_ALIGN (at least that), so that
    a step is the same share of any side: 8 px at 64, 16 at 112, 32 at 224 (FFCV's step at ImageNet's
    sizes)."""
    return max(RAMP_ALIGN, round(image_size / RAMP_STEPS / RAMP_ALIGN) * RAMP_ALIGN)


def default_min_image_size(data: DataConfig, may_resize: bool) -> int | None:
    """The first crop of progressive resizing when min_image_size is unset: PROGRESSIVE_SCALE x image_size
    to a multiple of RAMP_ALIGN (a half up), and at least PROGRESSIVE_FLOOR. Unless data.progressive =
    true is given, None where the default leaves it off: image_size under PROGRESSIVE_FROM (a first crop
    at the floor would be most of the image: little to gain), and where the model may not take other
    sizes or FixMatch runs (`may_resize` false: its unlabelled views keep one size)."""
    size = data.image_size
    scaled = math.floor(size * PROGRESSIVE_SCALE / RAMP_ALIGN + 0.5) * RAMP_ALIGN  # a half rounds up
    start = max(PROGRESSIVE_FLOOR, scaled)
    asked = data.progressive is True or data.end_image_size is not None
    off_by_default = size < PROGRESSIVE_FROM or not may_resize
    return None if start >= size or (off_by_default and not asked) else start


def pretrained_settings(cfg: RunConfig, weights: Pretrained) -> dict[str, Any]:
    """A timm model's pretrained weights: their tag and revision recorded, and the `data.*` keys their
    data config sets, those the run config leaves unset. The input size becomes the val crop only when
    neither data.image_size nor data.val_image_size is given; the val resize is the val crop over
    crop_pct (timm's eval transform)."""
    found, data = weights.data, cfg.data
    given = {f"data.{key}" for key in data.model_fields_set}
    out: dict[str, Any] = {}
    for key in ("mean", "std"):
        if f"data.{key}" not in given and isinstance(found.get(key), list | tuple) and len(found[key]) == 3:
            out[f"data.{key}"] = [float(v) for v in found[key]]
    if "data.val_interpolation" not in given and found.get("interpolation") in ("bilinear", "bicubic"):
        out["data.val_interpolation"] = found["interpolation"]
    size = data.val_image_size or data.image_size
    input_size = found.get("input_size")
    if not given & {"data.image_size", "data.val_image_size"} and isinstance(input_size, list | tuple):
        size = out["data.val_image_size"] = int(input_size[-1])
    if "data.val_resize" not in given and isinstance(found.get("crop_pct"), int | float):
        out["data.val_resize"] = math.floor(size / found["crop_pct"])
    source = {"revision": weights.revision, "from_weights": sorted(out)}
    return {**out, "model.name": weights.name, "model.source": source}
