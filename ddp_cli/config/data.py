"""The data and augment sections: what the run reads, and how its images are cropped and augmented."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from ddp_cli.config.section import Section

RAMP_ALIGN = 8  # progressive resizing's crops and steps are multiples of this (fast kernels' sizes)

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
        'PNG) are decoded in the loaders as on cpu. auto: where both paths can run (the workers train '
        "on CUDA, torchvision was built with it, and augment.interpolation is bilinear or no policy is "
        "set: v2's tensor kernels do not rotate bicubic), the workers time both on the run's first train "
        "batches and keep the faster (config.toml records it, the log gives the figures, a resume keeps "
        'it); else "cpu". A run that must repeat bit for bit on another machine names a path. '
        "Validation and FixMatch's unlabelled views take the same path as training "
        '(docs: "Performance", "Decoding on the GPU").',
    )
    on_bad_image: Literal["error", "skip"] = Field(
        "error", description='"error": stop every rank (exit 3) naming the file; '
        '"skip": replace it by another sample and count it.',
    )
    min_crop_scale: float = Field(
        0.25, gt=0, le=1, description="Smallest area fraction of RandomResizedCrop. 0.25: over two "
        "seeds, the target sooner than with Inception's 0.08 on both our data sets, and a final top-1 as "
        "high or higher (docs/recipes.md); 0.08 for torchvision's recipe.")
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
    progressive: bool | None = Field(
        None, description="Progressive resizing (FFCV, Composer): the first epochs train on a smaller "
        "crop, raised in steps of ramp_step px to end_image_size, the last epochs there. Unset = on "
        "for torchvision's CNNs and resnet_tiny at image_size >= 32 and without FixMatch: min_image_size, "
        "ramp_epochs, ramp_step and end_image_size then default to 0.5 x image_size (at least 24 px), a "
        "ramp from 10% to 60% of the run, steps of an eighth of image_size and FixRes' end (docs: recipes, "
        "\"The default recipe\"); "
        "false = every epoch at image_size; true = on for any model and size.",
    )
    min_image_size: int | None = Field(
        None, ge=8, description="Progressive resizing: the train crop of the first epochs, raised to "
        "end_image_size over ramp_epochs in steps of ramp_step px. Unset = 0.5 x image_size to a multiple "
        "of 8 px, at least 24, where data.progressive is on by default, else no progressive resizing.",
    )
    ramp_epochs: list[float] | None = Field(
        None, description="Progressive resizing: [start, end] epochs of the ramp from "
        "min_image_size to end_image_size (unset: 10% and 60% of train.epochs, whether min_image_size is "
        "given or derived; every epoch from the end on trains at end_image_size).",
    )
    end_image_size: int | None = Field(
        None, ge=8, description="Progressive resizing: the train crop from the ramp's end on (the ramp "
        "rises from min_image_size to it). Unset = the side at which the average random crop shows "
        "objects as large as validation's resize does (FixRes, Touvron et al. 2019): the mean of "
        "sqrt(crop scale) over [min_crop_scale, 1] x val_resize, to a multiple of 8 px, within "
        "[min_image_size, image_size] (56 px at 64, 96 at 112, 200 at 224); ignored where progressive "
        "resizing is off (every epoch at image_size); a given one turns it on, as min_image_size does.",
    )
    ramp_step: int | None = Field(
        None, ge=RAMP_ALIGN, description="Progressive resizing: the crop grows in steps of this many px "
        "(a multiple of 8). Unset = an eighth of image_size to a multiple of 8, at least 8; a resume "
        "keeps the step its checkpoint trained with unless the config names another.",
    )

    @field_validator("ramp_epochs")
    @classmethod
    def _ramp_in_order(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and (len(value) != 2 or not 0 <= value[0] <= value[1] < math.inf):
            raise ValueError("expected [start, end] with 0 <= start <= end")  # and finite
        return value

    @field_validator("ramp_step")
    @classmethod
    def _ramp_step_aligned(cls, value: int | None) -> int | None:
        if value is not None and value % RAMP_ALIGN:
            raise ValueError(f"expected a multiple of {RAMP_ALIGN} px (fast kernels' sizes), e.g. "
                             f"{max(RAMP_ALIGN, round(value / RAMP_ALIGN) * RAMP_ALIGN)}")
        return value

    @model_validator(mode="after")
    def _progressive_off_alone(self) -> DataConfig:
        for key in ("min_image_size", "end_image_size"):
            if self.progressive is False and getattr(self, key) is not None:
                raise ValueError(f"{key} is set while progressive = false (progressive resizing off): "
                                 f"unset data.{key}, or set data.progressive = true")
        return self

    @model_validator(mode="after")
    def _min_below_final(self) -> DataConfig:
        if self.min_image_size is not None and self.min_image_size > self.image_size:
            raise ValueError(f"min_image_size {self.min_image_size} is above image_size "
                             f"{self.image_size}; progressive resizing only grows the crop")
        end = self.end_image_size
        if end is not None and not (self.min_image_size or 0) <= end <= self.image_size:
            raise ValueError(f"end_image_size {end} is outside [min_image_size, image_size] = "
                             f"[{self.min_image_size or 8}, {self.image_size}]; progressive resizing "
                             "only grows the crop, up to image_size")
        return self

    def train_size(self, epoch: int) -> int:
        """The train crop side in 0-based `epoch`: min_image_size until the ramp starts,
        end_image_size from its end, in between the interpolation rounded to ramp_step (as FFCV);
        image_size every epoch without progressive resizing."""
        low = self.min_image_size
        if low is None or self.ramp_epochs is None:
            return self.image_size
        top = self.end_image_size or self.image_size
        start, end = self.ramp_epochs
        if epoch >= end:
            return top
        if epoch <= start:
            return low
        if self.ramp_step is None:
            raise ValueError("data.ramp_step is unset: train sizes need a resolved config (config.resolve)")
        between = low + (top - low) * (epoch - start) / (end - start)
        return min(top, max(low, round(between / self.ramp_step) * self.ramp_step))

    def sizes(self, epochs: int) -> set[int]:
        """Every input side the model meets: each epoch's train crop and the val crop (after the ramp's
        end every epoch's crop is image_size: those epochs are not walked one by one)."""
        end = self.ramp_epochs[1] if self.ramp_epochs else 0
        ramp = range(min(epochs, math.ceil(end) + 1))
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

