"""The run config: typed TOML sections, every key described, unknown keys refused.

`load_config(path, overrides)` is the only way in; every mistake becomes a
`ConfigError` naming the file and the key (`section.key: message`).
"""

from __future__ import annotations

import json
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import tomli_w
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from ddp_cli.errors import ConfigError, did_you_mean
from ddp_cli.models.families import takes_any_size
from ddp_cli.models.timm_model import (
    PRETRAINED,
    cached_weights,
    data_config,
    data_settings,
    is_timm_model,
    with_tag,
)
from ddp_cli.models.timm_model import parse as parse_timm
from ddp_cli.models.user_model import is_user_model, locate, parse
from ddp_cli.userfiles import parse_toml, read_text


class Section(BaseModel):
    """A config section: unknown keys refused, and frozen. Preflight resolves a run's config once
    (`RunConfig.resolved`); nothing edits it afterwards."""

    model_config = ConfigDict(extra="forbid", frozen=True)


VAL_CROP_SHARE = 0.875  # val: the centre crop's share of the resized side (224 of 256), as torchvision's
PROGRESSIVE_FROM = 32  # the smallest image_size progressive resizing is on for by default (docs/recipes.md)
PROGRESSIVE_SCALE = 0.5  # the default first crop, of image_size (Composer's initial_scale; recipes.md)
PROGRESSIVE_FLOOR = 24  # ... and at least this: 16 cost the 32 px digits epochs, 24 saved some (recipes.md)
PROGRESSIVE_REACH = 0.75  # on by default only where its steps reach this share of image_size (48 px: 32, off)
RAMP_STEP = 32  # progressive resizing's crops are multiples of this (FFCV's rule)
PROGRESSIVE_RAMP = (0.4, 1.0)  # the default ramp, in fractions of the epochs: Composer's delay, to the end
EMA_HORIZON = 100  # train.ema_decay "auto": averages over an epoch of steps, at least this many (recipes.md)
EMA_BN_IMAGES = 256  # train.ema_bn_epochs: the train images the EMA's BatchNorm statistics are made from
# keys ddp derives from others when a config leaves them unset (the val crop, the epochs, the model, the EMA)
DERIVED = ("data.val_resize", "data.progressive", "data.min_image_size", "data.ramp_epochs",
           "checkpoint.best_metric")


class DataConfig(Section):
    dataset: str = Field("demo", description="Name of a data set in the registry (data.toml).")
    classes: int | list[str] | None = Field(
        None,
        description="Class subset: the first N classes, or a list of synsets/class names "
        "(relabelled 0..k-1). Unset = every class.",
    )
    image_size: int = Field(224, ge=8, description="Side of the square training crop, pixels.")
    val_resize: int | None = Field(
        None, ge=8, description="Validation: resize the shorter side to this, then center-crop. Unset = "
        "the val crop / 0.875, the usual centre crop (256 for 224, 128 for 112), or with a timm model's "
        "pretrained weights the val crop / their crop_pct."
    )
    batch_size: int = Field(32, ge=1, description="Images per worker per micro-step.")
    workers: NonNegativeInt | Literal["auto"] = Field(
        "auto", description="DataLoader processes per worker (0 = in-process). auto: from the cores per "
        "worker and a measured decode time: on GPU every core but the trainer's; on CPU as many as "
        "decoding's share of the cores, and none unless loading apart would gain 10% (docs: "
        '"Performance", "Loader processes"); written out as a number in the run dir\'s config.toml.',
    )
    prefetch_factor: PositiveInt | Literal["auto"] = Field(
        2, description="Batches each loader process keeps ready. auto: at least 2, and 4 batches "
        "queued per worker in all.",
    )
    decode: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description='Where training JPEGs are decoded and augmented. "cpu": in the loader processes '
        '(at the JPEG\'s reduced DCT scale where the crop is shrunk). "gpu": the loader processes read the '
        "files and draw every random parameter as on cpu, and each worker decodes its batch on its own "
        "device (nvJPEG, batched) and crops, resizes, flips and augments it there; other images (CMYK, "
        'PNG) are decoded in the loaders as on cpu. auto: "gpu" when the workers train on CUDA and '
        "torchvision was built with it (and augment.interpolation is bilinear or no policy is set: v2's "
        'tensor kernels do not rotate bicubic), else "cpu". Validation decodes on the CPU either way '
        '(docs: "Performance", "Decoding on the GPU").',
    )
    on_bad_image: Literal["error", "skip"] = Field(
        "error", description='"error": stop every rank (exit 3) naming the file; '
        '"skip": replace it by another sample and count it.',
    )
    min_crop_scale: float = Field(
        0.25, gt=0, le=1, description="Smallest area fraction of RandomResizedCrop. 0.25: over two "
        "seeds, the target sooner than with Inception's 0.08 on both our data sets, and a final top-1 as "
        "high or higher (docs/recipes.md, \"What each element is worth\"); 0.08 for torchvision's recipe.")
    hflip: bool = Field(True, description="Random horizontal flips in training.")
    cache_dir: str | None = Field(
        None, description="Remote (S3) roots: keep each image read under this local folder (~ and $VARS "
        "expand), so later epochs and runs read the disk, not the bucket. Unset = no cache; ignored for "
        "local roots.")
    shuffle_shards: PositiveInt = Field(
        8, description='layout = "shards": training order = the shards in a fresh order each epoch, '
        "read this many at a time with their images shuffled together (the shuffle window; docs: "
        '"Data sets", "Packed shards"); layout = "parquet": the same, of row groups.',
    )
    io_concurrency: PositiveInt = Field(
        16, description="Remote (S3) roots: requests in flight at once per loader process (a batch's "
        "objects are fetched together, not one round trip at a time).",
    )
    io_retries: NonNegativeInt = Field(
        5, description="Remote (S3) roots: retries of a request that fails transiently (HTTP 5xx, "
        "throttling, connection reset, timeout), waiting io_retry_wait_s, doubling, capped at 10 s. "
        "One that still fails ends the run (exit 3) naming the object.",
    )
    io_retry_wait_s: float = Field(
        0.2, gt=0, description="Remote (S3) roots: the first wait before a retry, in seconds.",
    )
    val_image_size: int | None = Field(
        None, ge=8, description="Validation crop side (unset = image_size, or with a timm model's "
        "pretrained weights and no image_size set, their input size). Testing above the train size gains "
        "accuracy (FixRes, Touvron et al. 2019).",
    )
    val_interpolation: Literal["bilinear", "bicubic"] | None = Field(
        None, description="Resize filter of the val resize (unset = augment.interpolation, or a timm "
        "model's pretrained weights' own).",
    )
    mean: tuple[float, float, float] | None = Field(
        None, description="Normalisation mean per channel (RGB, 0-1), of train and val inputs (unset = "
        "ImageNet's, or a timm model's pretrained weights' own).",
    )
    std: tuple[float, float, float] | None = Field(
        None, description="Normalisation std per channel (RGB, 0-1) (unset = ImageNet's, or a timm "
        "model's pretrained weights' own).",
    )
    progressive: bool = Field(
        True, description="Progressive resizing (FFCV, Composer): the first epochs train on a smaller "
        "crop, raised toward image_size by the end (in 32 px steps: a short run's last crop may stay "
        "under it, which validation then tests above, FixRes). On by default for torchvision's CNNs and "
        "resnet_tiny at image_size >= 32 (not 43-48, where its steps never pass 32) and without FixMatch: "
        "min_image_size and ramp_epochs then default to 0.5 x image_size (at least 24 px) and the ramp "
        "from 40% of the run to its end (docs: recipes, \"The default recipe\"); false = every epoch at "
        "image_size.",
    )
    min_image_size: int | None = Field(
        None, ge=8, description="Progressive resizing: the train crop of the first epochs, raised to "
        "image_size over ramp_epochs in steps of 32 px (FFCV's rule). Unset = 0.5 x image_size to the "
        "nearest 16 px, at least 24, where data.progressive is on by default, else no progressive "
        "resizing.",
    )
    ramp_epochs: list[float] = Field(
        [0, 0], description="Progressive resizing: [start, end] epochs of the ramp from "
        "min_image_size to image_size (unset: 40% and 100% of train.epochs, whether min_image_size is "
        "given or derived).",
    )

    @field_validator("ramp_epochs")
    @classmethod
    def _ramp_in_order(cls, value: list[float]) -> list[float]:
        if len(value) != 2 or not 0 <= value[0] <= value[1] < math.inf:
            raise ValueError("expected [start, end] with 0 <= start <= end")  # and finite
        return value

    @model_validator(mode="before")
    @classmethod
    def _val_resize_from_crop(cls, raw: Any) -> Any:
        """Unset val_resize: the val crop over VAL_CROP_SHARE, so a 112 px crop is taken from 128 px."""
        if isinstance(raw, dict) and raw.get("val_resize") is None:
            crop = raw.get("val_image_size") or raw.get("image_size", 224)
            if isinstance(crop, int) and not isinstance(crop, bool):
                return {**raw, "val_resize": round(crop / VAL_CROP_SHARE)}
        return raw

    @model_validator(mode="after")
    def _progressive_off_alone(self) -> DataConfig:
        if not self.progressive and self.min_image_size is not None:
            raise ValueError("min_image_size is set while progressive = false (progressive resizing off): "
                             "unset data.min_image_size, or set data.progressive = true")
        return self

    @model_validator(mode="after")
    def _min_below_final(self) -> DataConfig:
        if self.min_image_size is not None and self.min_image_size > self.image_size:
            raise ValueError(f"min_image_size {self.min_image_size} is above image_size "
                             f"{self.image_size}; progressive resizing only grows the crop")
        return self

    def train_size(self, epoch: int) -> int:
        """The train crop side in 0-based `epoch`: min_image_size until the ramp starts,
        image_size from its end, in between the interpolation rounded to 32 px (as FFCV)."""
        low, (start, end) = self.min_image_size, self.ramp_epochs
        if low is None or epoch >= end:
            return self.image_size
        if epoch <= start:
            return low
        between = low + (self.image_size - low) * (epoch - start) / (end - start)
        return min(self.image_size, max(low, round(between / RAMP_STEP) * RAMP_STEP))

    def sizes(self, epochs: int) -> set[int]:
        """Every input side the model meets: each epoch's train crop and the val crop (after the ramp's
        end every epoch's crop is image_size: those epochs are not walked one by one)."""
        ramp = range(min(epochs, math.ceil(self.ramp_epochs[1]) + 1))
        return {self.train_size(e) for e in ramp} | {self.val_image_size or self.image_size}


class AugmentConfig(Section):
    policy: Literal["none", "trivialaugment", "randaugment", "autoaugment"] = Field(
        "none", description="Policy augmentation after the crop (torchvision.transforms.v2, uint8): "
        "TrivialAugmentWide, RandAugment (magnitude, num_ops) or AutoAugment's ImageNet policy.",
    )
    magnitude: int = Field(9, ge=0, le=30, description="randaugment: magnitude of every op (0-30).")
    num_ops: int = Field(2, ge=1, description="randaugment: ops applied to each image.")
    color_jitter: float = Field(
        0.0, ge=0, description="Brightness, contrast and saturation jitter strength (0 = off)."
    )
    random_erase: float = Field(
        0.0, ge=0, le=1, description="Random erasing probability per image (0 = off)."
    )
    random_erase_value: Annotated[float, Field(ge=0, le=255)] | Literal["random", "mean"] = Field(
        0.0, description='Random erasing fill: a pixel value in [0, 255] for every channel; "mean", the '
        "ImageNet mean colour (torchvision's recipes: 0 after normalisation); or \"random\", per-pixel "
        "noise, normal in normalised units (timm's re_mode = \"pixel\").",
    )
    mixup_alpha: float = Field(0.0, ge=0, description="MixUp Beta(alpha, alpha) (0 = off).")
    cutmix_alpha: float = Field(0.0, ge=0, description="CutMix Beta(alpha, alpha) (0 = off).")
    mix_prob: float = Field(1.0, ge=0, le=1, description="Probability that a batch is mixed at all.")
    switch_prob: float = Field(
        0.5, ge=0, le=1, description="With both MixUp and CutMix on: probability of CutMix for a batch."
    )
    repeated_aug: int = Field(
        1, ge=1, description="Repeated augmentation: each image shown k times per epoch (differently "
        "augmented, on different ranks), the epoch keeping its length in images (RASampler).",
    )
    interpolation: Literal["bilinear", "bicubic"] = Field(
        "bilinear", description="Resize filter of the train crop and the val resize (antialiased)."
    )

    def mixing(self) -> bool:
        return self.mix_prob > 0 and (self.mixup_alpha > 0 or self.cutmix_alpha > 0)

    def bicubic_policy(self) -> bool:
        """A policy whose geometric ops resample bicubic (PIL's kernels only)."""
        return self.policy != "none" and self.interpolation == "bicubic"


class SemiConfig(Section):
    method: Literal["none", "fixmatch"] = Field(
        "none", description='Semi-supervised training: "fixmatch" (Sohn et al. 2020) also learns from the '
        "unlabelled images (the registry's unlabeled split, else the train split's images past "
        'labels_per_class); "none" = off (docs: "Learning from unlabelled images").',
    )
    labels_per_class: PositiveInt | None = Field(
        None, description="Keep this many labelled images per class of the train split, chosen by the seed "
        "(the same on every rank and after a resume); with fixmatch the rest become unlabelled (their "
        "labels only measure pseudo_label_top1), with \"none\" they are left out: the supervised baseline. "
        "Unset = every label.",
    )
    threshold: float = Field(0.95, ge=0, le=1, description="fixmatch: a pseudo-label counts where the weak "
                             "view's top probability reaches this.")
    mu: PositiveInt = Field(7, description="fixmatch: unlabelled images per labelled one in a batch (each "
                            "seen twice, weak and strong, in the same forward pass).")
    lambda_u: float = Field(1.0, ge=0, description="fixmatch: weight of the unlabelled loss.")
    temperature: float = Field(1.0, gt=0, description="fixmatch: the weak view's logits are divided by this "
                               "before the softmax that makes pseudo-labels.")
    ema_teacher: bool = Field(False, description="fixmatch: pseudo-labels from the weights' EMA (needs "
                              "train.ema_decay > 0) instead of the model being trained.")
    weak: Literal["flip+crop", "crop"] = Field(
        "flip+crop", description="fixmatch: the weak view: RandomResizedCrop of scale (crop_scale, 1) and "
        "a horizontal flip where data.hflip (\"crop\": never flipped).",
    )
    crop_scale: float = Field(0.5, gt=0, le=1, description="fixmatch: smallest area fraction of the weak "
                              "and strong views' crop.")
    strong: Literal["randaugment+cutout", "randaugment", "none"] = Field(
        "randaugment+cutout", description="fixmatch: the strong view: the weak view's crop and flip, then "
        "RandAugment (strong_ops ops, each image at a magnitude drawn from 1-30) and Cutout.",
    )
    strong_ops: PositiveInt = Field(2, description="fixmatch: RandAugment ops per strong view.")
    cutout: float = Field(0.5, gt=0, le=1, description="fixmatch: Cutout's largest square, as a fraction of "
                          "the side (a grey square of side drawn up to this).")

    def on(self) -> bool:
        return self.method == "fixmatch"


class ModelSource(Section):
    root: str | None = Field(None, description="The folder put first on sys.path to import the model: "
                             "the file's own, or the one its module was found in.")
    sha256: str | None = Field(None, description="The model file's sha256 when the config was read: "
                               "validate, predict, export and a resume warn when the file has changed "
                               "since.")
    revision: str | None = Field(None, description="A timm model's pretrained weights: the Hugging Face "
                                 "hub revision (commit) of the cached snapshot the run started from.")
    from_weights: list[str] = Field(default_factory=list, description="A timm model's pretrained "
                                    "weights: the data.* keys set from their data config (pretrained_cfg).")


class ModelConfig(Section):
    name: str = Field(
        "resnet18", description="A torchvision classification model, 'resnet_tiny', or a model of your own: "
        "\"package.module:factory\" (importable from the run config's folder, the working directory or "
        "PYTHONPATH) or \"path/to/file.py:factory\" (relative to the run config's folder), any callable "
        "returning an nn.Module, called with num_classes= when it takes it and with model.kwargs; or "
        "timm's: \"timm/<architecture>[.<pretrained tag>]\" (the timm extra).",
    )
    source: ModelSource | None = Field(
        None, description="Set by ddp when it reads the config, for a model of your own or timm's "
        "pretrained weights (not to be set by hand): where it was imported from and the file's sha256, or "
        "the weights' hub revision and the data keys they set, recorded in the run dir's config.toml "
        "and every checkpoint so that validate, predict and export rebuild it.",
    )
    channels_last: bool = Field(True, description="NHWC memory format: faster convolutions on CPU and GPU "
                                "(BENCHMARKS.md, \"Step\"); false = NCHW.")
    blurpool: bool = Field(
        False, description="Anti-aliased downsampling (BlurPool, as FFCV's ResNets): every strided "
        "convolution past the stem low-pass filters its input first. torchvision's and timm's models and "
        "resnet_tiny, not a model of your own; the same parameters, so weights load either way, but keep it "
        "as the weights were trained.",
    )
    zero_init_residual: bool = Field(
        False, description="Start each residual block as the identity: the last BatchNorm of its branch "
        "at zero scale (torchvision's and timm's ResNet-style blocks, resnet_tiny). Only the initial "
        "weights change.",
    )
    sync_batchnorm: bool = Field(False, description="Synchronise BatchNorm statistics across ranks.")
    weights: str | None = Field(
        None, description="Initial weights: a local file (a state dict or a ddp checkpoint), or a "
        "torchvision weight name (\"DEFAULT\", \"IMAGENET1K_V2\", ...) read from the torch hub cache "
        "($TORCH_HOME); for a timm model \"pretrained\": its tag's weights from the local Hugging Face "
        "cache ($HF_HUB_CACHE, $HF_HOME), a fresh head where the class count differs. Loaded with "
        "weights_only=True, nothing is downloaded.",
    )
    new_head: bool = Field(
        False, description="With weights: start a fresh classifier when the file's class count "
        "differs (fine-tuning); otherwise that is an error.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the model's builder (dropout, "
        "stochastic_depth_prob, ...) or your factory, checked against its signature at --dry-run (a "
        "factory taking **kwargs takes any); num_classes is always ddp's.",
    )
    freeze: list[str] = Field(
        default_factory=list, description="Modules (dotted names, e.g. \"layer1\", \"features.0\") "
        "whose parameters are not trained.",
    )
    freeze_epochs: int = Field(0, ge=0, description="Unfreeze model.freeze after this many epochs "
                               "(0 = frozen for the whole run).")

    @field_validator("name")
    @classmethod
    def _reference(cls, name: str) -> str:
        if is_user_model(name) or is_timm_model(name):
            try:
                parse(name) if is_user_model(name) else parse_timm(name)
            except ConfigError as e:
                raise ValueError(str(e).removeprefix("model.name: ")) from None
        return name


class OptimConfig(Section):
    name: Literal["sgd", "adamw", "lars", "lamb", "rmsprop"] = Field(
        "sgd", description="Optimiser; lars and lamb adapt each layer's step for very large batches; "
        "rmsprop as EfficientNet's recipes (alpha, eps).",
    )
    lr: float | None = Field(None, gt=0, description="Absolute learning rate (overrides lr_per_256).")
    lr_per_256: float = Field(
        0.1, gt=0, description="Learning rate per 256 images of global batch "
        "(world size x batch x grad_accum); used when lr is unset.",
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD and LARS momentum.")
    nesterov: bool = Field(False, description="Nesterov momentum for SGD.")
    weight_decay: float = Field(1e-4, ge=0, description="L2 weight decay.")
    decay_norm_and_bias: bool = Field(
        False, description="Also decay BatchNorm/LayerNorm weights and biases."
    )
    label_smoothing: float = Field(
        0.1, ge=0, lt=1, description="Cross-entropy label smoothing of the training loss (validation's loss "
        "is plain). 0.1 by default, as timm's and torchvision's recipes: +0.3 points on the demo, +3 on the "
        "photos in 8 epochs at no cost (docs/recipes.md); 0 for the plain loss.",
    )
    betas: list[float] = Field([0.9, 0.999], description="AdamW and LAMB moment decay rates [beta1, beta2].")
    trust_coefficient: float = Field(
        0.001, gt=0, description="LARS: eta, the trust ratio's scale (You et al. 2017)."
    )
    alpha: float = Field(0.9, gt=0, lt=1, description="rmsprop: smoothing constant of the squared "
                         "gradient average.")
    eps: float = Field(1e-8, gt=0, description="adamw, rmsprop: the denominator's epsilon (EfficientNet's "
                       "RMSprop: 1e-3; torchvision's recipe: 0.0316).")
    head_lr_mult: float = Field(
        1.0, gt=0, description="The classifier head's learning rate as a multiple of the others' "
        "(fine-tuning a new head faster than the pretrained body).",
    )
    layer_decay: float = Field(
        1.0, gt=0, le=1, description="Layer-wise LR decay (ViT-style fine-tuning): each layer's LR is "
        "layer_decay^(layers above it) times the head's (1.0 = off).",
    )
    no_decay: list[str] = Field(
        default_factory=list, description="Parameter-name substrings excluded from weight decay besides "
        "norms and biases, e.g. [\"pos_embedding\", \"class_token\"] (ViT).",
    )
    grad_clip: float = Field(
        0.0, ge=0, description="Clip the global gradient norm to this (0 = off); fp16 gradients are "
        "unscaled first.",
    )

    @field_validator("betas")
    @classmethod
    def _two_rates(cls, value: list[float]) -> list[float]:
        if len(value) != 2 or not all(0 <= b < 1 for b in value):
            raise ValueError("expected [beta1, beta2], each in [0, 1)")
        return value

    def effective_lr(self, global_batch: int) -> float:
        return self.lr if self.lr is not None else self.lr_per_256 * global_batch / 256


class ScheduleConfig(Section):
    name: Literal["constant", "step", "multistep", "exponential", "cosine", "poly", "onecycle"] = Field(
        "cosine", description="LR schedule, stepped every optimisation step."
    )
    warmup_epochs: float = Field(0, ge=0, description="Linear warmup from 0, in epochs.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup in steps (overrides warmup_epochs).")
    step_epochs: float = Field(30, gt=0, description="step: multiply by gamma every this many epochs.")
    milestones: list[float] = Field(
        [30, 60, 80], description="multistep: epochs at which the LR is multiplied by gamma."
    )
    gamma: float = Field(0.1, gt=0, description="step/multistep: the factor; exponential: the factor "
                         "per epoch, applied smoothly every step (EfficientNet's 0.97 every 2.4 epochs: "
                         "0.9874).")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine/poly floor, as a fraction of lr.")
    power: float = Field(2.0, gt=0, description="poly: the exponent.")
    pct_start: float = Field(0.25, gt=0, lt=1, description="onecycle: fraction of steps rising.")


MAX_EPOCHS = 1_000_000  # a typo'd 10**12 would hang the dry run's plan, which walks the epochs


class TrainConfig(Section):
    epochs: int = Field(90, ge=1, le=MAX_EPOCHS, description="Passes over the training split (at most a "
                        "million: the plan and the schedule walk them).")
    precision: Literal["fp32", "bf16", "fp16", "auto"] = Field(
        "auto", description="Autocast precision; fp16 uses a GradScaler and needs CUDA; auto = bf16 "
        "where the device computes it natively (CUDA 8.0+, CPUs with AVX-512 BF16 or AMX), else fp32."
    )
    grad_accum: int = Field(1, ge=1, description="Micro-steps per optimisation step.")
    max_steps_per_epoch: int = Field(0, ge=0, description="Cap on steps per epoch (0 = whole epoch).")
    compile: bool = Field(False, description="torch.compile the training forward/backward (slow start).")
    ema_decay: Annotated[float, Field(ge=0, lt=1)] | Literal["auto"] = Field(
        "auto", description="EMA of the weights, updated every ema_every_steps steps, validated each "
        "epoch as final_ema (0 = off; e.g. 0.9998). auto = 1 - 1/max(100, steps per epoch): an average "
        "over about an epoch, written out in the run dir's config.toml.",
    )
    ema_every_steps: int = Field(
        1, ge=1, description="Update the EMA every N steps, with decay ema_decay ** N (the same "
        "averaging horizon in steps, 1/N of the cost; torchvision's recipes use 32).",
    )
    ema_bn_epochs: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="Before validating each of the first N epochs, recompute the EMA's BatchNorm "
        f"statistics from a fixed {EMA_BN_IMAGES} train images at the val crop (PreciseBN; 0 = never). "
        "auto = the epochs that end within the EMA's horizon (1 / (1 - decay) steps; 0 without an EMA), "
        "written out in the run dir's config.toml.",
    )

    def ema_decay_at(self, steps_per_epoch: int) -> float:
        """ema_decay made concrete for a run of `steps_per_epoch` steps an epoch (0 = no EMA)."""
        if self.ema_decay == "auto":
            return 1 - 1 / max(EMA_HORIZON, steps_per_epoch)
        return self.ema_decay


class CheckpointConfig(Section):
    dir: str | None = Field(
        None, description="The run dir when --run-dir is not given: a folder, or s3://BUCKET/PREFIX/NAME "
        "(a run in object storage, resumed from the bucket); unset = runs/NAME-YYYYmmdd-HHMMSS.",
    )
    every_steps: int = Field(0, ge=0, description="Also checkpoint every N steps (0 = epoch ends only).")
    keep_last: int = Field(3, ge=1, description="Step checkpoints kept besides last.pt and best.pt.")
    background: bool = Field(
        True, description="Write checkpoints on a background thread from a copy in CPU memory, so "
        "steps do not wait for the disk; one write at a time, and a stop or the run's end waits for it.",
    )
    best_metric: Literal["top1", "ema_top1"] = Field(
        "top1", description="What best.pt tracks: the val top-1 of the trained weights, or of their EMA "
        "(ema_top1 needs train.ema_decay > 0). Unset = ema_top1 where the run has an EMA, else top1; "
        "validate, predict and export use the same weights unless --weights says otherwise.",
    )
    on_world_size_change: Literal["rescale", "refuse"] = Field(
        "rescale", description="Resuming at another world size: \"rescale\" keeps the per-worker batch, "
        "scales the peak LR by the lr_per_256 rule and continues the schedule at the same epoch; "
        "\"refuse\" stops with exit 2.",
    )


class DistributedConfig(Section):
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="auto = nccl on a node with GPUs (one per worker; fewer GPUs than workers is "
        "refused), gloo on a node without."
    )
    nproc_per_node: PositiveInt | Literal["auto"] = Field(
        "auto", description="Workers on this node; auto = one per visible GPU, else cpu_workers."
    )
    cpu_workers: int = Field(1, ge=1, description="Workers per node when auto finds no GPU.")
    reduce: Literal["mean", "sum", "bf16", "fp16", "powersgd"] = Field(
        "mean", description="Gradient reduction (DDP comm hook); only mean equals single-process."
    )
    bucket_cap_mb: float = Field(25, gt=0, description="DDP gradient bucket size, MiB.")
    gradient_as_bucket_view: bool = Field(
        True, description="Gradients alias DDP's buckets (saves a copy and memory)."
    )
    static_graph: bool = Field(
        False, description="Tell DDP the graph is the same every step (enables its optimisations)."
    )
    powersgd_rank: int = Field(1, ge=1, description="powersgd: rank of the gradient approximation.")
    powersgd_warmup_steps: int | None = Field(
        None, ge=2, description="powersgd: exact all-reduce steps before compressing (unset = 10% of "
        "the run, at most 1000).",
    )
    timeout_s: int = Field(600, ge=1, description="Collective timeout; a dead rank ends all by then.")
    rdzv_timeout_s: int = Field(
        120, ge=1, description="How long nodes wait for each other (and for the endpoint) to rendezvous."
    )
    rdzv_last_call_s: int = Field(
        30, ge=0, description="With --nnodes MIN:MAX: once MIN nodes are in, how long the rendezvous "
        "waits for more (after a node is lost, the survivors wait this long before going on without it).",
    )
    max_restarts: int = Field(0, ge=0, description="Elastic restarts of the worker group on failure.")
    stop_check_steps: int = Field(
        10, ge=1, description="How often (in steps) the ranks agree on a stop signal (a small CPU "
        "all-reduce); also at every checkpoint due and epoch end. A SIGTERM/SIGINT stops the run at "
        "most this many steps later.",
    )
    stop_grace_s: int = Field(
        120, ge=1, description="On SIGTERM/SIGINT, how long workers get to finish the step and "
        "checkpoint before they are killed.",
    )


class WandbConfig(Section):
    project: str = Field(description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user).")
    name: str | None = Field(None, description="Run name (default: the run dir's name).")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description='"offline" writes the run under the run dir with no network; '
        "`wandb sync` uploads it later.",
    )
    tags: list[str] = Field([], description="W&B tags.")


class MlflowConfig(Section):
    tracking_uri: str = Field(
        "mlruns", description="Where runs are tracked: a folder (a local store, relative to the working "
        "directory) or a tracking server's URL (http://host:5000).")
    experiment: str = Field("ddp", min_length=1, description="Experiment name (created if missing).")
    run_name: str | None = Field(None, description="Run name (default: the run dir's name).")
    log_model: bool = Field(True, description="At the end, the exported model (state_dict and its card) and "
                            "the run's report picture as artefacts.")
    registered_model: str | None = Field(
        None, min_length=1, description="Also register the exported model under this name in the model "
        "registry (needs log_model).")


class LoggingConfig(Section):
    every_steps: int = Field(50, ge=1, description="Log a training line (and metrics record) every N steps.")
    tensorboard: bool = Field(False, description="Also write TensorBoard event files to <run>/tensorboard.")
    wandb: WandbConfig | None = Field(None, description="[logging.wandb]: also log to Weights & Biases.")
    mlflow: MlflowConfig | None = Field(None, description="[logging.mlflow]: also log to MLflow (rank 0; a "
                                        "tracking server that fails is retried, never stops training).")

    @model_validator(mode="after")
    def _registry_needs_the_model(self) -> LoggingConfig:
        if self.mlflow and self.mlflow.registered_model and not self.mlflow.log_model:
            raise ValueError("logging.mlflow.registered_model: registers the logged model; set "
                             "logging.mlflow.log_model = true or remove registered_model")
        return self


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

    @model_validator(mode="before")
    @classmethod
    def _progressive_by_default(cls, raw: Any) -> Any:
        """The default recipe's progressive resizing made concrete (min_image_size, ramp_epochs) where the
        config leaves it to ddp, so that the run dir's config.toml says what the run does."""
        if not isinstance(raw, dict):
            return raw
        data = given_keys(raw.get("data", {}))
        if data is None or data.get("progressive") is False:
            return raw
        epochs = (given_keys(raw.get("train", {})) or {}).get("epochs", TrainConfig().epochs)
        ramp = data.get("ramp_epochs")
        if "ramp_epochs" not in data and isinstance(epochs, int):
            ramp = [round(epochs * share, 2) for share in PROGRESSIVE_RAMP]
        if data.get("min_image_size") is not None:  # a first crop given, the ramp left to ddp: the default's
            return {**raw, "data": {**data, "ramp_epochs": ramp}} if ramp is not None else raw
        start = default_min_image_size(data, given_keys(raw.get("model", {})) or {},
                                       given_keys(raw.get("semi", {})) or {})
        if start is None or not isinstance(ramp, list) or not ramp or ramp[-1] == 0:  # a ramp ending at 0
            return {**raw, "data": {**data, "progressive": bool(data.get("progressive", False))}}
        return {**raw, "data": {**data, "progressive": True, "min_image_size": start, "ramp_epochs": ramp}}

    @model_validator(mode="before")
    @classmethod
    def _best_of_the_ema_by_default(cls, raw: Any) -> Any:
        """checkpoint.best_metric, unset, made concrete: the EMA's top-1 where the run has an EMA."""
        if not isinstance(raw, dict):
            return raw
        checkpoint, train = given_keys(raw.get("checkpoint", {})), given_keys(raw.get("train", {}))
        if checkpoint is None or train is None or "best_metric" in checkpoint:
            return raw
        ema = train.get("ema_decay", TrainConfig().ema_decay)
        best = "ema_top1" if ema == "auto" or (isinstance(ema, int | float) and ema > 0) else "top1"
        return {**raw, "checkpoint": {**checkpoint, "best_metric": best}}

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
        if self.data.decode == "gpu" and self.augment.bicubic_policy():
            raise ValueError(f'data.decode: "gpu" replays augment.policy "{self.augment.policy}" with '
                             "torchvision's tensor kernels, which rotate, shear and translate bilinear "
                             'only; set augment.interpolation = "bilinear", or data.decode = "cpu"')
        return self

    @model_validator(mode="after")
    def _fixmatch_composes(self) -> RunConfig:
        """What FixMatch cannot be combined with, refused before anything runs."""
        if not self.semi.on():
            return self
        if self.augment.mixing():
            raise ValueError("augment.mixup_alpha: MixUp/CutMix mix the labelled batch that FixMatch's "
                             "loss reads unmixed; set augment.mixup_alpha = augment.cutmix_alpha = 0, or "
                             'semi.method = "none"')
        if self.data.min_image_size is not None:
            raise ValueError("data.min_image_size: progressive resizing changes the labelled crop each "
                             "epoch, not the unlabelled views batched with it; unset it, or set "
                             'semi.method = "none"')
        if self.semi.ema_teacher and not self.train.ema_decay:
            raise ValueError("semi.ema_teacher: needs an EMA; set train.ema_decay (e.g. 0.999) or "
                             "semi.ema_teacher = false")
        return self

    def to_toml(self) -> str:
        return tomli_w.dumps(self.model_dump(mode="json", exclude_none=True))

    def resolved(self, changes: dict[str, Any], source: str = "resolved config") -> RunConfig:
        """A validated copy with dotted keys changed (`{"data.workers": 3}`): how preflight and the
        commands make "auto" concrete or apply a flag, the config itself being frozen. Keys that hold
        what ddp derived from others (`DERIVED`) are derived again from the changed ones."""
        raw = self.model_dump(mode="json")
        for key in self.derived_keys():
            section, leaf = key.split(".")
            del raw[section][leaf]
        for key, value in changes.items():
            *parents, leaf = key.split(".")
            node = raw
            for part in parents:
                if not isinstance(node.get(part), dict):  # an unset optional section ([logging.wandb])
                    node[part] = {}
                node = node[part]
            node[leaf] = value
        return config_from_dict(raw, source)

    def derived_keys(self) -> list[str]:
        """The `DERIVED` keys whose value is the one ddp gives them when unset (given or not: the two
        cannot be told apart, nor need to be)."""
        raw = self.model_dump(mode="json")
        for key in DERIVED:
            section, leaf = key.split(".")
            raw[section].pop(leaf, None)
        bare = config_from_dict(raw)
        return [key for key in DERIVED if bare.value(key) == self.value(key)]

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

    def ema_bn_epochs_at(self, steps_per_epoch: int) -> int:
        """train.ema_bn_epochs made concrete for `steps_per_epoch`. "auto": the epochs that end within the
        EMA's horizon. Until the run is as old as the horizon, the EMA's statistics still carry those of its
        first, fast-moving weights (and, with progressive resizing, of smaller crops than validation's);
        past it, an average over the horizon's batches beat a sample (docs/recipes.md)."""
        train = self.train
        if train.ema_bn_epochs != "auto":
            return train.ema_bn_epochs
        decay = train.ema_decay_at(steps_per_epoch)
        if not decay:
            return 0
        return min(round(1 / (1 - decay)) // max(steps_per_epoch, 1), train.epochs)


def given_keys(section: Any) -> dict[str, Any] | None:
    """A config section's keys as given: a TOML table's, or a section object's explicitly set fields;
    None for anything else (left for validation to refuse)."""
    if isinstance(section, BaseModel):
        return {key: getattr(section, key) for key in section.model_fields_set}
    return section if isinstance(section, dict) else None


def default_min_image_size(data: dict[str, Any], model: dict[str, Any], semi: dict[str, Any]) -> int | None:
    """The first crop of progressive resizing when min_image_size is unset: PROGRESSIVE_SCALE x image_size
    to the nearest 16 px (a half up), and at least PROGRESSIVE_FLOOR. Unless data.progressive = true is
    given, None where the default leaves it off: image_size under PROGRESSIVE_FROM (unmeasured there), or
    where the ramp's last step before image_size is under PROGRESSIVE_REACH of it (48 px would train at 32
    throughout, 1.1 and 1.6 points under 48), a model that may not take other sizes, FixMatch (its
    unlabelled views keep one size)."""
    size, name = data.get("image_size", DataConfig().image_size), model.get("name", ModelConfig().name)
    if not isinstance(size, int) or not isinstance(name, str):
        return None  # for validation to refuse
    half = math.floor(size * PROGRESSIVE_SCALE / 16 + 0.5) * 16  # a half rounds up: 112 -> 64, 80 -> 48
    start = max(PROGRESSIVE_FLOOR, half)
    last = min(size, max(start, round((size - 1) / RAMP_STEP) * RAMP_STEP))  # train_size just before the end
    off_by_default = (size < PROGRESSIVE_FROM or last < PROGRESSIVE_REACH * size or not takes_any_size(name)
                      or semi.get("method", "none") != "none")
    return None if start >= size or (off_by_default and data.get("progressive") is not True) else start


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML run config, apply `--set key=value` overrides, validate."""
    path = Path(path)
    raw = parse_toml(read_text(path, ConfigError), str(path), ConfigError)
    for item in overrides:
        apply_override(raw, item)
    cfg = config_from_dict(raw, source=str(path))
    try:
        return with_model_source(cfg, path.parent, set(dotted_keys(raw)))
    except ConfigError as e:  # the model's file: named with the config that names it
        raise ConfigError(f"{path}: {e}") from e


def with_model_source(cfg: RunConfig, folder: Path, given: set[str] = frozenset()) -> RunConfig:
    """A model of the user's own located from the config's `folder` (`user_model.locate`): every process
    that builds it later, wherever it starts, imports it from there. A timm model's pretrained weights
    found in the local cache (exit 3 if they are not), their tag made explicit and their data config
    applied to the `data.*` keys the run config does not set (`given`: the keys it sets)."""
    if is_user_model(cfg.model.name):
        name, source = locate(cfg.model.name, folder)
        return cfg.resolved({"model.name": name, "model.source": source})
    if not (is_timm_model(cfg.model.name) and cfg.model.weights == PRETRAINED):
        return cfg
    weights = cached_weights(cfg.model.name)
    settings = data_settings(data_config(weights), given, cfg.data.val_image_size or cfg.data.image_size)
    source = {"revision": weights.revision, "from_weights": sorted(settings)}
    return cfg.resolved({**settings, "model.name": with_tag(cfg.model.name), "model.source": source})


def unknown_key(dotted: str) -> str | None:
    """Why `dotted` (`optim.lr_per_256`) names no key of the run config, with a did-you-mean; None
    for a key. A section (`optim`) is not a key."""
    model: type[BaseModel] | None = RunConfig
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        known = list(model.model_fields) if model else []
        if part not in known:
            where = ".".join(parts[:depth]) or "the run config"
            return f"{dotted}: unknown key: {where} has no {part!r}{did_you_mean(part, known)}"
        model = _section_type(model.model_fields[part].annotation)
    if model is not None:
        keys = ", ".join(list(model.model_fields)[:6])
        return f"{dotted}: a section, not a key; name one of its keys ({keys})"
    return None


def dotted_keys(raw: dict[str, Any], prefix: str = "") -> list[str]:
    """Every leaf key of a TOML table, dotted (`data.val_resize`)."""
    keys = []
    for key, value in raw.items():
        keys += dotted_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key]
    return keys


def config_from_dict(raw: dict[str, Any], source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{source}: {describe_validation_error(e, RunConfig)}") from e


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`a.b=v`: v in TOML value syntax, or a bare string when it is not TOML."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set optim.lr=0.2")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    *parents, leaf = key.strip().split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is a value, not a section")
    node[leaf] = parsed


def describe_validation_error(err: ValidationError, model: type[BaseModel]) -> str:
    """First error as `section.key: message`, with a did-you-mean for unknown keys."""
    first = err.errors()[0]
    loc = _field_path(model, [str(p) for p in first["loc"]])
    key = ".".join(loc)
    if first["type"] == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        hint = did_you_mean(loc[-1], list(owner.model_fields)) if owner else ""
        message = f"{key}: unknown key{hint}"
    else:
        text = first["msg"].removeprefix("Value error, ")  # our validators' own words, as written
        message = f"{key}: {text}" if key else text
    more = len(err.errors()) - 1
    return message + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def _field_path(model: type[BaseModel], loc: list[str]) -> list[str]:
    """The part of a pydantic error location that names keys (drops union tags)."""
    path: list[str] = []
    for part in loc:
        if _model_at(model, path) is None:
            break
        path.append(part)
    return path


def _model_at(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    for part in path:
        field = model.model_fields.get(part)
        model = _section_type(field.annotation) if field else None
        if model is None:
            return None
    return model


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The section model behind `Section` or `Section | None`, else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


# The docs site's reference page (tested by the docs build), not config validation: not mutation-tested.
# pragma: no mutate start
def reference_markdown() -> str:
    """The config reference of the docs site (docs/hooks.py builds it into a page): per section, a
    table of its keys with their type, default and description, from the models themselves."""
    sections: dict[str, list[str]] = {}

    def rows(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            section = _section_type(field.annotation)
            if section is not None:
                rows(section, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            shown = ("required" if field.is_required() else "unset" if default is None
                     else json.dumps(default) if isinstance(default, list | dict)  # inline, as TOML allows
                     else tomli_w.dumps({"v": default})[4:].strip())
            meaning = (field.description or "").replace("|", "\\|")
            sections.setdefault(prefix.rstrip("."), []).append(
                f"| `{prefix}{name}` | {_type_name(field.annotation)} | `{shown}` | {meaning} |")

    rows(RunConfig, "")
    out = []
    for section, lines in sections.items():
        out += [f"## `[{section}]`" if section else "## Top level", "",
                "| key | type | default | meaning |", "| --- | --- | --- | --- |", *lines, ""]
    return "\n".join(out).strip()


def _type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: `int`, `list of str`, `"sgd" \\| "adamw"`, `int \\| "auto"`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " \\| ".join(f'`"{value}"`' if isinstance(value, str) else f"`{value}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(arg) for arg in args if arg is not type(None))
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "table"
    return getattr(annotation, "__name__", str(annotation))
# pragma: no mutate end
