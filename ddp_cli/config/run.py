"""The run config: every section under one root, the rules that span sections, and its construction
from a TOML table (`config_from_dict`), every mistake a `ConfigError` naming the key."""

from __future__ import annotations

from typing import Any

import tomli_w
from pydantic import Field, ValidationError, model_validator

from ddp_cli.config.data import AugmentConfig, DataConfig
from ddp_cli.config.errors import describe_validation_error
from ddp_cli.config.model import ModelConfig, OptimConfig, PretrainConfig, ScheduleConfig, SemiConfig
from ddp_cli.config.section import Section
from ddp_cli.config.train import CheckpointConfig, DistributedConfig, LoggingConfig, TrainConfig
from ddp_cli.errors import ConfigError


class RunConfig(Section):
    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$", description="Run name (run dir prefix).")
    seed: int = Field(0, description="Seed for weights, shuffling and augmentation.")
    deterministic: bool = Field(False, description="Deterministic kernels (slower, reproducible).")
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    semi: SemiConfig = Field(default_factory=SemiConfig)
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)

    @model_validator(mode="after")
    def _static_graph_alone(self) -> RunConfig:
        if self.distributed.static_graph and self.train.grad_accum > 1:
            raise ValueError("distributed.static_graph: DDP fails with it under no_sync, i.e. with "
                             "train.grad_accum > 1 (pytorch/pytorch#143580); drop one of the two")
        return self

    @model_validator(mode="after")
    def _ema_bn_of_an_ema(self) -> RunConfig:
        if self.train.ema_bn_epochs not in (0, "auto") and not self.train.ema_decay:
            raise ValueError("train.ema_bn_epochs: recomputes the EMA's BatchNorm statistics, and the run "
                             "has no EMA; set train.ema_decay (e.g. \"auto\") or train.ema_bn_epochs = 0")
        return self

    @model_validator(mode="after")
    def _best_of_an_ema(self) -> RunConfig:
        if self.checkpoint.best_metric == "ema_top1" and not self.train.ema_decay:
            raise ValueError("checkpoint.best_metric: \"ema_top1\" needs an EMA; set train.ema_decay "
                             "(e.g. 0.9998) or use \"top1\"")
        return self

    @model_validator(mode="after")
    def _gpu_decode_rotates_bilinear(self) -> RunConfig:
        replayed = self.bicubic_replay()
        if self.data.decode == "gpu" and replayed:
            raise ValueError(f'data.decode: "gpu" replays {replayed} with '
                             "torchvision's tensor kernels, which rotate, shear and translate bilinear "
                             'only; set augment.interpolation = "bilinear", or data.decode = "cpu"')
        return self

    def bicubic_replay(self) -> str | None:
        """The key whose geometric ops would resample bicubic (PIL's kernels only) on the device path: the
        policy, or FixMatch's strong view (RandAugment at augment.interpolation); None where none would."""
        if self.augment.bicubic_policy():
            return f'augment.policy "{self.augment.policy}"'
        if self.augment.interpolation == "bicubic" and self.semi.on() and self.semi.strong != "none":
            return f'semi.strong "{self.semi.strong}"'
        return None

    @model_validator(mode="after")
    def _fixmatch_composes(self) -> RunConfig:
        """What FixMatch and its successors cannot be combined with, refused before anything runs."""
        if not self.semi.on():
            return self
        if self.augment.mixing():
            raise ValueError("augment.mixup_alpha: MixUp/CutMix mix the labelled batch that FixMatch's "
                             "loss reads unmixed; set augment.mixup_alpha = augment.cutmix_alpha = 0, or "
                             'semi.method = "none"')
        if self.data.progressive:
            raise ValueError("data.progressive: progressive resizing changes the labelled crop each epoch, "
                             "not the unlabelled views batched with it; set data.progressive = false, or "
                             'semi.method = "none"')
        for key in ("min_image_size", "end_image_size"):
            if getattr(self.data, key) is not None:
                raise ValueError(f"data.{key}: progressive resizing changes the labelled crop each "
                                 "epoch, not the unlabelled views batched with it; unset it, or set "
                                 'semi.method = "none"')
        if self.semi.ema_teacher and not self.train.ema_decay:
            raise ValueError("semi.ema_teacher: needs an EMA; set train.ema_decay (e.g. 0.999) or "
                             "semi.ema_teacher = false")
        return self

    @model_validator(mode="after")
    def _pretraining_alone(self) -> RunConfig:
        """SimCLR reads two views of every train image and no label: what would read labels, mix or resize
        the batch is refused."""
        if not self.pretrain.on():
            return self
        method = f'pretrain.method: "{self.pretrain.method}"'
        if self.semi.on() or self.semi.labels_per_class:
            raise ValueError(f"{method} learns from every train image and reads no label; run it first, then "
                             "the semi-supervised run from its checkpoint (model.weights); set semi.method = "
                             '"none" and unset semi.labels_per_class here')
        if self.optim.head_lr_mult != 1:
            raise ValueError(f"{method} trains no classifier (it stays as initialised); set "
                             "optim.head_lr_mult = 1")
        if self.augment.mixing():
            raise ValueError(f"{method} compares each image's own two views; set augment.mixup_alpha = "
                             "augment.cutmix_alpha = 0")
        if self.data.progressive or self.data.min_image_size or self.data.end_image_size:
            raise ValueError(f"{method} trains at data.image_size throughout; set data.progressive = false "
                             "and unset data.min_image_size and data.end_image_size")
        return self

    def to_toml(self) -> str:
        return tomli_w.dumps(self.model_dump(mode="json", exclude_none=True))

    def resolved(self, changes: dict[str, Any], source: str = "resolved config") -> RunConfig:
        """A validated copy with dotted keys changed (`{"data.batch_size": 64}`), the config itself
        being frozen. The keys the copy's source left unset stay unset (`model_fields_set`)."""
        raw = self.model_dump(mode="json", exclude_unset=True)
        for key, value in changes.items():
            *parents, leaf = key.split(".")
            node = raw
            for part in parents:
                if not isinstance(node.get(part), dict):  # a section left at its defaults
                    node[part] = {}
                node = node[part]
            node[leaf] = value
        return config_from_dict(raw, source)

    def value(self, key: str) -> Any:
        """A key's value by its dotted name (`data.image_size`)."""
        section, leaf = key.split(".")
        return getattr(getattr(self, section), leaf)

    def global_batch(self, world_size: int) -> int:
        """Images per optimisation step: every worker's batch, times the micro-steps accumulated."""
        return world_size * self.data.batch_size * self.train.grad_accum

    def lr(self, world_size: int) -> float:
        """The learning rate at this world size: `optim.lr`, else `optim.lr_per_256` scaled linearly
        by the global batch."""
        return self.optim.effective_lr(self.global_batch(world_size))


def config_from_dict(raw: dict[str, Any], source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{source}: {describe_validation_error(e, RunConfig)}") from e
