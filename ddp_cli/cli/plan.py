"""`ddp train --dry-run`: what a run would do, as preflight computed it (no checks of its own)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddp_cli.config import AugmentConfig, RunConfig, SemiConfig
from ddp_cli.config.resolve import decode_pending
from ddp_cli.data.pipeline.augment import op_names
from ddp_cli.data.pipeline.transforms import normalising
from ddp_cli.data.pipeline.views import contrastive_view_names, view_names
from ddp_cli.data.sources.unlabeled import UNLABELED
from ddp_cli.distributed.reduce import powersgd_warmup
from ddp_cli.models.weights import is_timm_pretrained
from ddp_cli.models.zoo import count_parameters
from ddp_cli.preflight import Preflight
from ddp_cli.run.training import chosen_checkpoint
from ddp_cli.train.checkpoint import RunState, load_checkpoint
from ddp_cli.train.optim import param_groups
from ddp_cli.train.resumed import Resumed, resumed
from ddp_cli.train.schedules import lr_at, lr_factor, warmup_steps
from ddp_cli.train.trainer import resume_position


def lr_preview(cfg: RunConfig, lr: float, steps: int, start: int = 0) -> dict[str, float]:
    """The LR at the first step (a resume's next one, `start`), the end of warmup, a few epoch starts
    and the last step."""
    epochs = cfg.train.epochs
    total, warmup = steps * epochs, warmup_steps(cfg.schedule, steps)
    factor = lr_factor(cfg.schedule, steps, total)
    points = {start: f"step {start} (next, resumed)" if start else "step 0 (first)",
              total - 1: f"step {total - 1} (last)"}
    for e in sorted({1, epochs // 4, epochs // 2, 3 * epochs // 4} - {0}):
        points.setdefault(e * steps, f"epoch {e + 1} (step {e * steps})")
    if 0 < warmup < total:
        points[warmup] = f"step {warmup} (warmup done)"
    return {label: lr * factor(step) for step, label in sorted(points.items()) if start <= step < total}


def resume_plan(run: Preflight, run_dir: Path | None) -> Resumed | None:
    """The checkpoint `train` would resume from in `run_dir` (with --resume auto, none without one: a new
    run dir), read as the workers read it, and what the resume changes: the next step's LR as the
    workers' scheduler sets it (`Trainer.resume`), at this world size."""
    path = chosen_checkpoint(run.resume, run_dir) if run_dir or run.resume != "auto" else None
    if path is None:
        return None
    saved = load_checkpoint(path)
    cfg, steps, state = run.cfg, run.steps_per_epoch, RunState()
    state.load_state_dict(saved)
    peak, position = saved["scheduler"]["base_lrs"][0], state.step
    if (len(saved["rng"]), state.global_batch) != (run.workers.world_size, run.global_batch):
        peak *= run.lr / cfg.optim.effective_lr(state.global_batch)
        _, position = resume_position(state.epoch, state.samples_in_epoch, run.global_batch, steps)
    lr = lr_at(cfg.schedule, steps, steps * cfg.train.epochs, peak, position, groups(run)[0]["frozen_epochs"])
    return resumed(path, saved, cfg, lr, position)


def image_sizes(cfg: RunConfig) -> dict[str, int]:
    """The train crop where it changes, and the val crop."""
    sizes, last = {}, None
    for epoch in range(cfg.train.epochs):
        size = cfg.data.train_size(epoch)
        if size != last:
            sizes[f"train from epoch {epoch + 1}"], last = size, size
    return {**sizes, "val": cfg.data.val_image_size or cfg.data.image_size}


def augmentation(cfg: RunConfig) -> list[str]:
    """The train pipeline in the order it runs: the sampler, each image in the loaders, each batch on
    the device."""
    data, aug = cfg.data, cfg.augment
    k = aug.repeated_aug
    sampler = [f"RepeatedAugmentation(k={k}): each image {k} times per epoch, on different ranks "
               "(the sampler)"] if k > 1 else []
    crop = (f"RandomResizedCrop({data.image_size}, scale=({data.min_crop_scale:g}, 1), {aug.interpolation}, "
            "antialias)")
    flip = ["RandomHorizontalFlip"] if data.hflip else []
    decode = ['decode_jpeg on the device (data.decode = "gpu"): the loaders read and draw, the ops below '
              "run on the device"] if data.decode == "gpu" else []
    if decode_pending(cfg):
        decode = ['data.decode = "auto": the workers time both decode paths on the first batches and keep '
                  "the faster (config.toml records it)"]
    if cfg.pretrain.on():  # two views of each image, the same ops drawn twice
        return [*sampler, *decode, *(f"{op} (each of two views)" for op in
                                     contrastive_view_names(data, aug, cfg.pretrain)), normalize(cfg)]
    return [*sampler, *decode, crop, *flip, *op_names(aug), normalize(cfg), *mixing(aug)]


def normalize(cfg: RunConfig) -> str:
    data = cfg.data
    if data.mean is None and data.std is None:
        return "Normalize(ImageNet mean, std) (on the device)"
    mean, std = (", ".join(f"{v:g}" for v in values) for values in normalising(data))
    return f"Normalize(mean=({mean}), std=({std})) (on the device)"


def mixing(aug: AugmentConfig) -> list[str]:
    if not aug.mixing():
        return []
    kinds = [f"{kind}(alpha={alpha:g})" for kind, alpha in (("MixUp", aug.mixup_alpha),
                                                            ("CutMix", aug.cutmix_alpha)) if alpha]
    switch = f", switch_prob {aug.switch_prob:g}" if len(kinds) == 2 else ""
    return [f"{' / '.join(kinds)}, mix_prob {aug.mix_prob:g}{switch} (on the device, per batch)"]


def recipe(cfg: RunConfig) -> dict[str, Any]:
    """Which elements of the fast recipe this run has on (docs/recipes.md), each by its key's value."""
    data, last_crop = cfg.data, cfg.data.train_size(cfg.train.epochs - 1)
    return {
        "blurpool": cfg.model.blurpool,
        "zero_init_residual": cfg.model.zero_init_residual,
        "label_smoothing": cfg.optim.label_smoothing,
        "progressive_resizing": data.train_size(0) < data.image_size,
        "test_above_train_size": (data.val_image_size or data.image_size) > last_crop,
        "ema": cfg.train.ema_decay != 0,
        "ema_bn_epochs": cfg.train.ema_bn_epochs,
    }


def semi_plan(run: Preflight) -> dict[str, Any]:
    """[semi] as the run will use it: the split's images kept labelled, the unlabelled stream, the method's
    rule for pseudo-labels, its settings and its two views, and the signals its metrics rows log."""
    semi, (labelled, unlabelled) = run.cfg.semi, run.semi_images
    plan: dict[str, Any] = {"method": semi.method, "labels_per_class": semi.labels_per_class,
                            "labelled_images": labelled}
    if not semi.on():
        return plan
    source = ("the registry's unlabeled split" if UNLABELED in run.index.splits
              else "the rest of the train split")
    return {**plan, "unlabelled_images": unlabelled, "unlabelled_from": source,
            "unlabelled_per_step": run.global_batch * semi.mu, **rule_plan(semi), "mu": semi.mu,
            "lambda_u": semi.lambda_u, "temperature": semi.temperature,
            "pseudo_labels_from": "the EMA weights" if semi.ema_teacher else "the model being trained",
            **view_names(run.cfg.data, run.cfg.augment, semi),
            "forward": "one pass over labelled + weak + strong (BatchNorm sees all)",
            "recipe_for_the_method": run.fitted or "none changed (the config sets those keys)"}


def pretrain_plan(run: Preflight) -> dict[str, Any]:
    """[pretrain] as the run will use it: what it trains, against what, and what it validates."""
    pretrain = run.cfg.pretrain
    source = ("the train split, then the registry's unlabeled split" if UNLABELED in run.index.splits
              else "the train split")
    return {"method": pretrain.method, "labels_read": "none (every image, as two views)",
            "images": run.semi_images[0], "images_from": source,
            "loss": f"NT-Xent at temperature {pretrain.temperature:g} over the global batch's views",
            "negatives_per_view": 2 * run.global_batch - 2,
            "projection": f"the classifier's input -> 2x its width -> ReLU -> {pretrain.projection_dim}",
            "classifier": "frozen as initialised (a later run on labels trains it: model.weights)",
            "validation": "top-1 of the val features' nearest class mean, each image left out of its own",
            "signals": ["pair_top1"],
            "recipe_for_the_method": run.fitted or "none changed (the config sets those keys)"}


def rule_plan(semi: SemiConfig) -> dict[str, Any]:
    """How the method turns a weak view into a pseudo-label and its weight, with its own keys, and the
    signals it logs in its `semi` rows (beside mask_rate and pseudo_label_top1)."""
    if semi.method == "fixmatch":
        return {"pseudo_labels": f"kept where the top probability >= threshold {semi.threshold}",
                "threshold": semi.threshold, "signals": ["mask_rate", "pseudo_label_top1"]}
    if semi.method == "freematch":
        return {"pseudo_labels": "kept where the top probability >= tau x MaxNorm(p~)[class]: tau the EMA "
                "of the mean top probability, p~ of the mean class probabilities (both from 1/classes), "
                "plus the class-fairness loss", "stats_momentum": semi.stats_momentum,
                "fairness_weight": semi.fairness_weight,
                "signals": ["mask_rate", "pseudo_label_top1", "freematch_tau", "class_thresholds"]}
    return {"pseudo_labels": "every one, weighted by a truncated Gaussian of its top probability (mu, "
            "sigma: EMAs of the batch's mean and variance)"
            + (" after uniform distribution alignment" if semi.dist_align else ""),
            "stats_momentum": semi.stats_momentum, "n_sigma": semi.n_sigma, "dist_align": semi.dist_align,
            "signals": ["mask_rate (the mean weight)", "pseudo_label_top1 (weighted)", "softmatch_mu",
                        "softmatch_sigma"]}


def val_preprocessing(cfg: RunConfig) -> list[str]:
    data = cfg.data
    return [f"Resize({data.val_resize}, {data.val_interpolation or cfg.augment.interpolation}, antialias)",
            f"CenterCrop({data.val_image_size or data.image_size})", normalize(cfg)]


def weights_data_config(cfg: RunConfig) -> list[str]:
    """For a timm model's pretrained weights: each key of validation's preprocessing, its value and
    whether the weights' data config or the run config set it."""
    if not is_timm_pretrained(cfg.model):
        return []
    data, taken = cfg.data, cfg.model.source.from_weights if cfg.model.source else []
    mean, std = normalising(data)
    values = {"data.mean": list(mean), "data.std": list(std),
              "data.val_interpolation": data.val_interpolation or cfg.augment.interpolation,
              "data.val_image_size": data.val_image_size or data.image_size,
              "data.val_resize": data.val_resize}
    return [f"{key} = {value} (from the {'weights' if key in taken else 'config'})"
            for key, value in values.items()]


def groups(run: Preflight) -> list[dict[str, Any]]:
    """The optimiser's parameter groups as the workers will make them (frozen modules left out): their
    size, peak LR, weight decay and the epochs they stay frozen."""
    return [{"parameters": sum(p.numel() for p in group["params"]), "lr": run.lr * group["lr_scale"],
             "weight_decay": group["weight_decay"], "frozen_epochs": group["frozen_epochs"]}
            for group in param_groups(run.model, run.cfg.optim, run.cfg.model)]


def describe(run: Preflight, resumes: Resumed | None = None) -> dict[str, Any]:
    """The plan of a run that passed preflight, going on from `resumes` where it is one."""
    cfg, workers, steps = run.cfg, run.workers, run.steps_per_epoch
    start = resumes.schedule_step if resumes and not resumes.finished else 0
    reduce: dict[str, Any] = {"reduce": cfg.distributed.reduce}
    if cfg.distributed.reduce == "powersgd":
        reduce["powersgd_warmup_steps"] = powersgd_warmup(cfg.distributed, steps * cfg.train.epochs)
    return {
        "name": cfg.name,
        "dataset": run.entry.name,
        "classes": len(run.index.classes),
        "splits": {split: len(frame) for split, frame in run.index.splits.items()},
        "model": cfg.model.name,
        "parameters": count_parameters(run.model),
        "weights": cfg.model.weights,
        "world_size": workers.world_size,
        "nproc_per_node": workers.nproc,
        "backend": workers.backend,
        "global_batch": run.global_batch,
        "steps_per_epoch": steps,
        "epochs": cfg.train.epochs,
        "total_steps": steps * cfg.train.epochs,
        "optimizer": cfg.optim.name,
        "lr": run.lr,
        "lr_rule": ("absolute (optim.lr)" if cfg.optim.lr is not None else
                    f"lr_per_256 {cfg.optim.lr_per_256:g} x {run.global_batch} / 256"),
        "schedule": cfg.schedule.name,
        "warmup_steps": warmup_steps(cfg.schedule, steps),
        "lr_schedule": lr_preview(cfg, run.lr, steps, start),
        "param_groups": groups(run),
        "image_size": image_sizes(cfg),
        "augmentation": augmentation(cfg),
        "val_preprocessing": val_preprocessing(cfg),
        **({"weights_data_config": found} if (found := weights_data_config(cfg)) else {}),
        "data_workers": run.loaders.as_dict(),  # loader processes and prefetch per worker, and why
        "precision": cfg.train.precision,
        "channels_last": cfg.model.channels_last,
        "compile": cfg.train.compile,
        "ema_decay": cfg.train.ema_decay,
        "recipe": recipe(cfg),
        **({"semi": semi_plan(run)} if cfg.semi.on() or cfg.semi.labels_per_class else {}),
        **({"pretrain": pretrain_plan(run)} if cfg.pretrain.on() else {}),
        "resume": run.resume,
        "resumes": resumes.as_dict() if resumes else None,
        **({"resume_line": resumes.line()} if resumes else {}),
        **reduce,
    }
