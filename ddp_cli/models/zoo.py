"""Models by name: every torchvision classification model, `resnet_tiny` for small images, a
factory of the user's own (`package.module:factory`, `file.py:factory`: `ddp_cli.models.user_model`), and
timm's (`timm/<architecture>[.<tag>]`: `ddp_cli.models.timm_model`).

`build_model` makes the real, freshly initialised network in a worker (with
`model.kwargs` for its builder); `load_weights` and `freeze` are the
fine-tuning surgery done to it before DDP wraps it. `check_model` runs in the
launcher and in `--dry-run`: it builds the same network on the meta device
(no memory, no arithmetic), pushes a fake batch of every input size the run
will use through it (one logit per class must come out) and matches `model.weights`, `model.freeze` and
`optim.layer_decay` against it, so a model that cannot take the configured
images, or weights or names that do not fit, fail before any worker starts.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from ddp_cli.config import ModelConfig, RunConfig
from ddp_cli.config.model_names import is_timm_model
from ddp_cli.errors import ConfigError, DataError, did_you_mean
from ddp_cli.io import is_checkpoint, load_plain
from ddp_cli.models.families import TINY, fixed_size
from ddp_cli.models.timm_model import PRETRAINED, build_pretrained, cached_weights, import_timm
from ddp_cli.models.timm_model import build as timm_builder
from ddp_cli.models.tweaks import add_blurpool, zero_init_residual
from ddp_cli.models.user_model import call, factory, is_user_model

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrap names this way
# "DEFAULT", "IMAGENET1K_V2" or "ResNet50_Weights.IMAGENET1K_V2": a torchvision weight name, not a file
WEIGHT_NAME = re.compile(r"(?:\w+_Weights\.)?[A-Z][A-Z0-9_]*")
# torchvision's DenseNet files predate its module names (torchvision renames them on load, as here)
OLD_DENSENET = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.([12]\.(?:weight|bias|running_mean|running_var))$")
AUX_HEADS = ("AuxLogits.", "aux1.", "aux2.")  # inception_v3's and googlenet's; ddp builds them without
MOBILENET_V3_KWARGS = ["width_mult", "reduced_tail", "dilated"]  # read by its builders, not its class
# torchvision's ViT blocks and timm's (ViT, DeiT, BEiT, EVA: blocks.N at the top)
VIT_BLOCK = re.compile(r"(?:encoder\.layers\.encoder_layer_|blocks\.)(\d+)\.")
VIT_EMBEDDINGS = ("conv_proj.", "class_token", "encoder.pos_embedding",  # torchvision's
                  "patch_embed.", "cls_token", "reg_token", "pos_embed")  # timm's


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, with its parameter names, without importing torchvision.

    torchvision costs 1.2 s to import, in the launcher and in every worker;
    the demo's model does not need it (torchvision models import it when built).
    """

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class TinyResNet(nn.Module):
    """A CIFAR-style ResNet (3x3 stem, no max-pool, three stages) for 32-64 px images."""

    def __init__(self, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        stages, channels = [], width
        for out, stride in ((width, 1), (2 * width, 2), (4 * width, 2)):
            down = None
            if stride != 1 or out != channels:
                down = nn.Sequential(nn.Conv2d(channels, out, 1, stride, bias=False), nn.BatchNorm2d(out))
            stages.append(BasicBlock(channels, out, stride, down))
            channels = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def known_models() -> list[str]:
    import torchvision  # here, not at the top: see BasicBlock

    return sorted([TINY, *torchvision.models.list_models(module=torchvision.models)])


def import_builders(name: str) -> None:
    """Import now what building model `name` needs (torchvision: ~2 s), to pay for it while
    something else runs (the launcher's index build)."""
    if is_timm_model(name):
        import_timm(name)
    elif name != TINY and not is_user_model(name):
        import torchvision  # noqa: F401



def own_kwargs(name: str, image_size: int) -> dict:
    """What ddp passes torchvision's builder besides num_classes to build `name` for `image_size` inputs."""
    if name in ("inception_v3", "googlenet"):
        return {"aux_logits": False, "init_weights": True}  # one output; no init warning
    if name.startswith("vit_"):
        return {"image_size": image_size}
    if name.startswith("maxvit_"):
        return {"input_size": (image_size, image_size)}
    return {}


def builder_kwargs(cfg: ModelConfig, image_size: int) -> dict:
    """Every keyword argument of the builder besides num_classes: ddp's own and `model.kwargs`
    (what an exported model's card tells a program to pass)."""
    return {**own_kwargs(cfg.name, image_size), **cfg.kwargs}


def model_builder(name: str) -> Callable[..., nn.Module]:
    """The callable that makes model `name` from `num_classes=` and keyword arguments."""
    if name == TINY:
        return TinyResNet
    if name not in known_models():
        raise ConfigError(f"model.name: unknown model {name!r}{did_you_mean(name, known_models())}")
    import torchvision

    builder = torchvision.models.get_model_builder(name)
    return lambda **kwargs: builder(weights=None, **kwargs)


def builder_keywords(name: str) -> list[str]:
    """The keyword arguments `name`'s builder takes besides num_classes: its class's (torchvision's
    builders pass theirs on to it; the class is their return annotation), and mobilenet_v3's own."""
    if name == TINY:
        cls, extra = TinyResNet, []
    else:
        import torchvision

        cls = inspect.signature(torchvision.models.get_model_builder(name)).return_annotation
        extra = MOBILENET_V3_KWARGS if name.startswith("mobilenet_v3") else []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind in named and p.name not in ("self", "num_classes")] + extra


def check_kwargs(cfg: ModelConfig, image_size: int) -> None:
    """`model.kwargs` names only keywords of the builder (a typo would otherwise be ignored by the
    builders that take **kwargs), and none that ddp sets itself."""
    own = own_kwargs(cfg.name, image_size)
    known = builder_keywords(cfg.name) if cfg.kwargs else []
    for key in cfg.kwargs:
        if key in own:
            raise ConfigError(f"model.kwargs: {key} is set by ddp for {cfg.name} (from data.image_size, "
                              "or to build it with one output); remove it")
        if key not in known:
            raise ConfigError(f"model.kwargs: {cfg.name} takes no keyword {key!r}; its builder takes "
                              f"{', '.join(known) or 'none'}")


def build_model(cfg: ModelConfig, num_classes: int, image_size: int = 224) -> nn.Module:
    """A freshly initialised model (the caller seeds the RNG identically on every rank), with the fast
    recipe's tweaks where asked (`tweaks`: not to a model of the user's own, whose design is theirs)."""
    if is_user_model(cfg.name):
        return user_model(cfg, num_classes)
    model = zoo_model(cfg, num_classes, image_size)
    if cfg.zero_init_residual:
        zero_init_residual(model)
    if cfg.blurpool:
        add_blurpool(model)
    return model


def zoo_model(cfg: ModelConfig, num_classes: int, image_size: int) -> nn.Module:
    """torchvision's, `resnet_tiny` or timm's model, as its builder makes it."""
    if is_timm_model(cfg.name):  # create_model takes **kwargs: a wrong one is the class's TypeError
        return call(cfg.name, timm_builder(cfg.name), num_classes, cfg.kwargs)
    builder = model_builder(cfg.name)
    check_kwargs(cfg, image_size)
    try:
        return builder(num_classes=num_classes, **builder_kwargs(cfg, image_size))
    except (ValueError, AssertionError, TypeError) as e:  # e.g. maxvit: size not a multiple of its windows
        if cfg.kwargs:
            raise ConfigError(f"model.kwargs: {cfg.name} cannot be built with {cfg.kwargs} for "
                              f"data.image_size = {image_size} ({first_line(e)})") from e
        if isinstance(e, TypeError):
            raise
        raise ConfigError(f"model.name: {cfg.name} cannot be built for data.image_size = {image_size} "
                          f"({first_line(e)})") from e


def user_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """The user's factory called (`user_model.call`): what it returns must be a model."""
    model = call(cfg.name, factory(cfg.name, cfg.source.root if cfg.source else None), num_classes,
                 cfg.kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name: {cfg.name} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


@contextmanager
def tensors_on_meta() -> Iterator[None]:
    """Parameters and buffers move to the meta device as modules register them.

    Accelerate's `init_empty_weights` trick: unlike `with torch.device("meta")`
    it leaves the tensors a constructor computes with on the CPU (RegNet derives
    its widths from tensors), and it needs no memory for vit_h_14's 632M weights.
    """
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        meta = None if param is None else nn.Parameter(param.to("meta"), param.requires_grad)
        register_parameter(module, name, meta)

    def buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        register_buffer(module, name, None if tensor is None else tensor.to("meta"), persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = parameter, buffer
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer


def check_model(cfg: RunConfig, num_classes: int) -> nn.Module:
    """The model on the meta device, after proving it takes every input size the run uses.

    Raises ConfigError naming the key to change. The returned module has real
    shapes (so parameters can be counted) but no data.
    """
    with tensors_on_meta():
        model = build_model(cfg.model, num_classes, cfg.data.image_size).eval()
    sizes = sorted(cfg.data.sizes(cfg.train.epochs))
    if fixed_size(cfg.model.name) and sizes != [cfg.data.image_size]:
        raise ConfigError(f"model.name: {cfg.model.name} takes only data.image_size = "
                          f"{cfg.data.image_size} inputs, but the run also uses {sizes}; unset "
                          "data.min_image_size and data.val_image_size")
    for size in sizes if cfg.model.name != TINY else ():  # convs and an adaptive pool: any size
        try:
            with torch.no_grad():
                logits = model(torch.empty(2, 3, size, size, device="meta"))
        except (RuntimeError, ValueError, AssertionError, TypeError) as e:
            fix = ("raise data.image_size (and data.min_image_size), torchvision trains most models at "
                   "224, inception_v3 at 299")
            if size == cfg.data.min_image_size:  # progressive resizing's first crop, maybe by default
                fix = ("it is data.min_image_size, progressive resizing's first crop: raise it, or set "
                       "data.progressive = false")
            raise ConfigError(f"model.name: {cfg.model.name} cannot take {size}x{size} images "
                              f"({first_line(e)}); {fix}") from e
        check_logits(logits, cfg.model.name, num_classes)
    if is_timm_pretrained(cfg.model):
        cached_weights(cfg.model.name)  # there, or exit 3; timm fits them (a fresh head where needed)
    elif cfg.model.weights:
        select_weights(model.state_dict(), initial_weights(cfg.model), cfg.model, num_classes)
    check_finetune(model, cfg)
    return model


def check_logits(logits: object, name: str, num_classes: int) -> None:
    """A batch of 2 images must give 2 x num_classes logits (a factory that ignores num_classes, say)."""
    shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else None
    if shape != (2, num_classes):
        got = f"shape {shape}" if shape else f"a {type(logits).__name__}"
        raise ConfigError(f"model.name: {name} gives {got} for 2 images, not (2, {num_classes}): one logit "
                          "per class of the data set; build the classifier with num_classes outputs (a "
                          "factory taking num_classes= gets the class count) and return the logits alone")


def check_finetune(model: nn.Module, cfg: RunConfig) -> None:
    """What fine-tuning asks of the model: modules to freeze that exist (frozen on `model`, as the
    workers will), something left to train, and a ViT for layer-wise LR decay."""
    freeze(model, cfg.model)
    if not any(param.requires_grad for param in model.parameters()):
        raise ConfigError(f"model.freeze: {', '.join(cfg.model.freeze)} holds every parameter of "
                          f"{cfg.model.name}: nothing would train")
    if cfg.optim.layer_decay != 1:
        vit_depth(model, cfg.model.name)
    if cfg.optim.head_lr_mult != 1:
        classifier_head(model, cfg.model.name)


def is_weight_name(weights: str) -> bool:
    """A torchvision weight name or timm's "pretrained" rather than a file (a file so named is given as
    "./DEFAULT")."""
    return weights == PRETRAINED or WEIGHT_NAME.fullmatch(weights) is not None


def is_timm_pretrained(cfg: ModelConfig) -> bool:
    return is_timm_model(cfg.name) and cfg.weights == PRETRAINED


def hub_weights(cfg: ModelConfig) -> tuple[Path, str]:
    """The file torchvision would download for the weights `cfg.weights` names (in torch's hub cache,
    $TORCH_HOME/hub/checkpoints) and its URL; nothing is downloaded."""
    if cfg.weights == PRETRAINED:
        raise ConfigError(f"model.weights: \"{PRETRAINED}\" is for timm models (\"timm/<architecture>\"); "
                          f"for {cfg.name} give a file or a torchvision weight name (\"DEFAULT\")")
    if cfg.name == TINY or is_user_model(cfg.name) or is_timm_model(cfg.name):
        other = f' or "{PRETRAINED}"' if is_timm_model(cfg.name) else ""
        raise ConfigError(f"model.weights: {cfg.weights} is a torchvision weight name and {cfg.name} has "
                          f"none; give a file{other}")
    import torchvision

    enum = torchvision.models.get_model_weights(cfg.name)
    prefix, _, member = cfg.weights.rpartition(".")
    if prefix and prefix != enum.__name__:
        raise ConfigError(f"model.weights: {cfg.weights} are not {cfg.name}'s weights ({enum.__name__})")
    if member not in enum.__members__:
        raise ConfigError(f"model.weights: {cfg.name} has no weights {member!r}"
                          f"{did_you_mean(member, list(enum.__members__))}")
    url = enum[member].url
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(url).path).name, url


def weights_file(cfg: ModelConfig) -> str:
    """`model.weights` as a local file: the path given, or a torchvision weight name's file in the hub
    cache, which must be there (exit 3 naming the file and where to fetch it)."""
    if not is_weight_name(cfg.weights):
        return cfg.weights
    path, url = hub_weights(cfg)
    if not path.is_file():
        raise DataError(f"model.weights: {cfg.weights} for {cfg.name} is not in the torch hub cache: no "
                        f"{path} (nothing is downloaded here); fetch {url} to that path on a machine with "
                        "internet, or point $TORCH_HOME at a cache that has it")
    return str(path)


def initial_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors `model.weights` names, in the names of the model ddp builds."""
    tensors = read_weights(weights_file(cfg))
    return {OLD_DENSENET.sub(r"\1\2", k): v for k, v in tensors.items() if not k.startswith(AUX_HEADS)}


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a state dict or a ddp checkpoint, with DDP/compile prefixes removed."""
    if not Path(path).is_file():
        raise ConfigError(f"model.weights: {path}: no such file (weights are never downloaded)")
    state = load_plain(Path(path))
    if is_checkpoint(state):
        state = state["model"]
    elif isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    tensors = {}
    for key, value in state.items() if isinstance(state, dict) else ():
        if isinstance(value, torch.Tensor):
            while key.startswith(WRAPPER_PREFIXES):
                key = key.split(".", 1)[1]
            tensors[key] = value
    if not tensors:
        raise DataError(f"model.weights: {path} holds no tensors; give a state dict or a ddp checkpoint")
    return tensors


def select_weights(expected: Mapping[str, torch.Tensor], found: dict[str, torch.Tensor],
                   cfg: ModelConfig, num_classes: int) -> dict[str, torch.Tensor]:
    """The tensors of `found` to load into a model whose state is `expected`.

    Every tensor must be present with its shape, except a classifier for another
    class count, which `new_head` leaves freshly initialised. Old files without
    BatchNorm's `num_batches_tracked` are fine.
    """
    where = f"model.weights: {cfg.weights} does not fit {cfg.name}"
    missing = [k for k in expected if k not in found and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in found if k not in expected]
    if missing or unexpected:
        raise ConfigError(f"{where}: {_names('missing', missing)}{_names('unexpected', unexpected)}"
                          "is it from another model?")
    wrong = [k for k in found if found[k].shape != expected[k].shape]
    head = [k for k in wrong if _other_class_count(expected[k], found[k], num_classes)]
    if len(head) < len(wrong):
        k = next(k for k in wrong if k not in head)
        raise ConfigError(f"{where}: {k} is {tuple(found[k].shape)} in the file, "
                          f"{tuple(expected[k].shape)} in the model")
    if head and not cfg.new_head:
        raise ConfigError(f"model.weights: {cfg.weights} has a {found[head[0]].shape[0]}-class head, "
                          f"the data set has {num_classes} classes; set model.new_head = true to "
                          "train a fresh head")
    return {k: v for k, v in found.items() if k not in head}


def load_weights(model: nn.Module, cfg: ModelConfig, num_classes: int) -> None:
    """Copy `model.weights` into a freshly built model (in place, on every rank); a timm model's
    "pretrained" as timm loads them from the local cache."""
    if is_timm_pretrained(cfg):
        model.load_state_dict(timm_pretrained(cfg, num_classes).state_dict())
        return
    model.load_state_dict(select_weights(model.state_dict(), initial_weights(cfg), cfg, num_classes),
                          strict=False)


def timm_pretrained(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """A timm model built with its cached pretrained weights, every tensor loaded but a classifier for
    another class count: timm loads those non-strictly, so a file missing part of the body would otherwise
    leave it silently random (DataError naming what is missing)."""
    with load_results() as results:
        model = call(cfg.name, build_pretrained(cfg.name), num_classes, cfg.kwargs)
    head, weights = model.pretrained_cfg.get("classifier") or (), model.pretrained_cfg.get("num_classes")
    fresh = {f"{c}.{p}" for c in ((head,) if isinstance(head, str) else head) for p in ("weight", "bias")
             if num_classes != weights}  # the keys timm leaves out on purpose
    missing = [k for r in results for k in r.missing_keys if k not in fresh]
    unexpected = [k for r in results for k in r.unexpected_keys]
    if missing or unexpected:
        raise DataError(f"model.weights: the cached pretrained weights of {cfg.name} do not fit it: "
                        f"{_names('missing', missing)}{_names('unexpected', unexpected)}fetch them again "
                        "(`hf download`) or unset model.weights")
    return model


@contextmanager
def load_results() -> Iterator[list]:
    """Every `load_state_dict` result while inside: what a non-strict load (timm's) left out."""
    results, original = [], nn.Module.load_state_dict

    def recording(module: nn.Module, state_dict: Mapping, strict: bool = True, assign: bool = False):
        result = original(module, state_dict, strict=strict, assign=assign)
        results.append(result)
        return result

    nn.Module.load_state_dict = recording
    try:
        yield results
    finally:
        nn.Module.load_state_dict = original


def frozen_parameters(model: nn.Module, cfg: ModelConfig) -> list[str]:
    """The parameters `model.freeze` names (modules, or parameters such as ViT's class_token), by name;
    a name the model lacks is a ConfigError with the close matches."""
    modules = [name for name, _ in model.named_modules() if name]
    params = [name for name, _ in model.named_parameters()]
    for name in cfg.freeze:
        if name not in modules and name not in params:
            raise ConfigError(f"model.freeze: {cfg.name} has no module {name!r}"
                              f"{did_you_mean(name, modules + params)}")
    return [p for p in params if any(p == name or p.startswith(name + ".") for name in cfg.freeze)]


def freeze(model: nn.Module, cfg: ModelConfig) -> None:
    """Freeze `model.freeze` for the whole run (`freeze_epochs = 0`) before DDP wraps the model: without
    requires_grad no gradient is computed or all-reduced for them and the optimiser never holds them.
    Frozen for the first N epochs only, they keep their gradients and the optimiser holds them at a zero
    LR until epoch N (`optim.param_groups`): DDP's set of gradients cannot change mid-run."""
    frozen = set(frozen_parameters(model, cfg))  # the names are checked either way
    if cfg.freeze_epochs:
        return
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def classifier_head(model: nn.Module, name: str = "the model") -> str:
    """The module that makes the logits: the one the model's `get_classifier()` returns (timm's
    convention; how a model of one's own names its head), else the last Linear (SqueezeNet: Conv2d) the
    model registers, i.e. fc (ResNet, RegNet), classifier.N (VGG, EfficientNet, ConvNeXt, MobileNet),
    heads.head (ViT), head (Swin; TinyResNet's head.2); tested on all of torchvision's classifiers."""
    named = getattr(model, "get_classifier", None)
    head = named() if callable(named) else None
    found = [n for n, m in model.named_modules() if (m is head if head is not None else
                                                      isinstance(m, nn.Linear | nn.Conv2d))]
    if not found:
        raise ConfigError(f"optim.head_lr_mult: {name} has no recognisable classifier head (no nn.Linear or "
                          "Conv2d, or get_classifier() returns none of its modules); give the model a "
                          "get_classifier() method returning its head module, or set optim.head_lr_mult = 1")
    return found[-1]


def vit_depth(model: nn.Module, name: str) -> int:
    """L, the encoder blocks of a ViT (torchvision's or timm's); layer-wise LR decay is defined for
    nothing else."""
    blocks = {int(m.group(1)) for p, _ in model.named_parameters() if (m := VIT_BLOCK.match(p))}
    if not blocks:
        raise ConfigError(f"optim.layer_decay: layer-wise LR decay needs a ViT (torchvision vit_*: "
                          f"encoder.layers.encoder_layer_N; timm's: blocks.N); {name} has no such layers; "
                          "set optim.layer_decay = 1 (a model of your own: name its blocks so)")
    return max(blocks) + 1


def vit_layer(param: str, depth: int) -> int:
    """A ViT parameter's layer for layer-wise LR decay (BEiT's numbering): 0 for the patch and position
    embeddings and the class token, i + 1 for encoder block i, depth + 1 for the final norm and the head."""
    if param.startswith(VIT_EMBEDDINGS):
        return 0
    block = VIT_BLOCK.match(param)
    return int(block.group(1)) + 1 if block else depth + 1


def _other_class_count(model_tensor: torch.Tensor, file_tensor: torch.Tensor, num_classes: int) -> bool:
    return (model_tensor.shape[0] == num_classes and file_tensor.shape[0] != num_classes
            and model_tensor.shape[1:] == file_tensor.shape[1:])


def _names(kind: str, keys: list[str]) -> str:
    if not keys:
        return ""
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return f"{kind} {', '.join(keys[:3])}{more}; "


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
