"""The model, optimiser, schedule, semi-supervised and pre-training sections: what is trained, and how."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator

from ddp_cli.config.model_names import is_timm_model, is_user_model, parse_reference, parse_timm
from ddp_cli.config.section import Section
from ddp_cli.errors import ConfigError


class SemiConfig(Section):
    method: Literal["none", "fixmatch", "freematch", "softmatch"] = Field(
        "none", description='Semi-supervised training: also learn from the unlabelled images (the '
        "registry's unlabeled split, else the train split's images past labels_per_class), each one's "
        'strong view toward its weak view\'s pseudo-label: "fixmatch" (Sohn et al. 2020) where the '
        'confidence reaches semi.threshold; "freematch" (Wang et al. 2023) where it reaches a threshold '
        'that follows the model\'s confidence, per class, plus a class-fairness term; "softmatch" (Chen '
        "et al. 2023) every image, weighted by its confidence, after distribution alignment; \"none\" = "
        'off (docs: "Learning from unlabelled images").',
    )
    labels_per_class: PositiveInt | None = Field(
        None, description="Keep this many labelled images per class of the train split, chosen by the seed "
        "(the same on every rank and after a resume); with fixmatch the rest become unlabelled (their "
        "labels only measure pseudo_label_top1), with \"none\" they are left out: the supervised baseline. "
        "Unset = every label.",
    )
    threshold: float = Field(0.95, ge=0, le=1, description="fixmatch: a pseudo-label counts where the weak "
                             "view's top probability reaches this.")
    stats_momentum: float | None = Field(
        None, ge=0, lt=1, description="freematch, softmatch: momentum of the running statistics of the "
        "weak views' confidence (an EMA over every rank's micro-batches: FreeMatch's threshold and class "
        "means, SoftMatch's mean, variance and mean prediction). Unset = 1 - 1/horizon, the horizon a "
        "thousandth of the run's micro-steps within 100-1000: the papers' 0.999 from a million steps, "
        "0.99 under 100,000 (a short run's statistics would hardly leave their start at 0.999).",
    )
    fairness_weight: float = Field(0.01, ge=0, description="freematch: weight of the self-adaptive "
                                   "class-fairness loss (the paper's lambda_f, USB's ent_loss_ratio: "
                                   "0.01); 0 = off.")
    n_sigma: float = Field(2.0, gt=0, description="softmatch: the Gaussian's width in standard deviations "
                           "of the confidence below its mean (the paper's n: 2).")
    dist_align: bool = Field(True, description="softmatch: uniform distribution alignment of the weak "
                             "views' probabilities (times uniform over the EMA of the model's mean "
                             "prediction, renormalised), as the paper.")
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
        return self.method != "none"


class PretrainConfig(Section):
    method: Literal["none", "simclr"] = Field(
        "none", description="Learn the model's features from the images alone, their labels unread (the "
        "train split, then the registry's unlabeled split where it names one): \"simclr\" (Chen et al. 2020) "
        "pulls the two views of each image together against every other view of the step's global batch "
        "(NT-Xent), through a projection MLP on the classifier's input; the classifier stays as initialised "
        "and validation is the features' nearest-class-mean top-1. Its checkpoint is where a run on few "
        "labels starts (model.weights); \"none\" = off (docs: \"Learning from unlabelled images\").",
    )
    projection_dim: PositiveInt = Field(64, description="simclr: the projection's output width (its hidden "
                                        "layer twice the features').")
    temperature: float = Field(0.2, gt=0, description="simclr: NT-Xent's temperature (cosine similarities "
                               "are divided by it).")
    crop_scale: float = Field(0.2, gt=0, le=1, description="simclr: smallest area fraction of each view's "
                              "RandomResizedCrop.")
    color_strength: float = Field(0.5, ge=0, description="simclr: the views' colour distortion s: with "
                                  "probability 0.8 ColorJitter(0.8s, 0.8s, 0.8s, 0.2s), then grey with "
                                  "probability 0.2 (0 = crop and flip only).")

    def on(self) -> bool:
        return self.method != "none"


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
                                "(oneDNN's and cuDNN's kernels are written for it: BENCHMARKS.md, \"Training "
                                "step\"); false = NCHW.")
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
                parse_reference(name) if is_user_model(name) else parse_timm(name)
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
    label_smoothing: float | None = Field(
        None, ge=0, lt=1, description="Cross-entropy label smoothing of the training loss (validation's loss "
        "is plain): it keeps the logits from growing without bound on data the model already fits (its "
        "measured worth: docs/recipes.md); 0 for the plain loss. Unset = 0.1, as timm's and torchvision's "
        "recipes, except under semi.method = \"fixmatch\": 0 there (smoothing caps the confidence its fixed "
        "threshold reads: docs/semi-supervised.md).",
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


