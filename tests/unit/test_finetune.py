"""Fine-tuning: torchvision weight names read from the hub cache, builder kwargs, freezing, and the
optimiser's parameter groups (head LR, layer-wise decay, weight decay exclusions) under the schedule."""

from __future__ import annotations

import io
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from ddp_cli.config import ModelConfig, OptimConfig, RunConfig, ScheduleConfig, config_from_dict
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.models import (
    TinyResNet,
    build_model,
    builder_kwargs,
    check_model,
    freeze,
    hub_weights,
    is_weight_name,
    load_weights,
    tensors_on_meta,
)
from ddp_cli.preflight import Workers, node_facts
from ddp_cli.train.export import builder
from ddp_cli.train.large_batch import Lamb, Lars
from ddp_cli.train.optim import build_optimizer, param_groups
from ddp_cli.train.schedules import build_scheduler, lr_factor

RESNET50_V2 = torchvision.models.ResNet50_Weights.IMAGENET1K_V2


def config(name: str, size: int = 224, optim: dict | None = None, **model) -> RunConfig:
    return config_from_dict({"model": {"name": name, **model}, "data": {"image_size": size},
                             "optim": optim or {}, "train": {"epochs": 2}})


def hub_file(torch_home: Path, weights) -> Path:
    """Where torchvision's own download would put `weights` (torch.hub's layout, by hand)."""
    return torch_home / "hub" / "checkpoints" / weights.url.rsplit("/", 1)[1]


def plant(path: Path, model: nn.Module, rename=lambda key: key) -> None:
    """A stand-in for a downloaded file: `model`'s keys (`rename`d; None drops one) and shapes, every
    tensor zeros stored as one element (expanded), so even a meta-device model's state costs nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {rename(k): torch.zeros((), dtype=v.dtype).expand(v.shape) for k, v in model.state_dict().items()}
    torch.save({k: v for k, v in state.items() if k is not None}, path)


def on_meta(builder_fn, **kwargs) -> nn.Module:
    with tensors_on_meta():
        return builder_fn(**kwargs)


@pytest.fixture
def torch_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    return tmp_path


# --- model.weights: torchvision weight names ---------------------------------------------------


@pytest.mark.parametrize(("text", "name"), [
    ("DEFAULT", True), ("IMAGENET1K_V2", True), ("ResNet50_Weights.IMAGENET1K_V2", True),
    ("ViT_B_16_Weights.IMAGENET1K_SWAG_E2E_V1", True), ("w.pt", False), ("./DEFAULT", False),
    ("/runs/demo/checkpoints/last.pt", False), ("imagenet1k_v2", False)])
def test_weight_names_are_told_from_files(text, name):
    assert is_weight_name(text) is name


@pytest.mark.parametrize("text", ["DEFAULT", "IMAGENET1K_V2", "ResNet50_Weights.IMAGENET1K_V2"])
def test_a_weight_name_is_the_file_torchvision_would_download(torch_home, text):
    path, url = hub_weights(ModelConfig(name="resnet50", weights=text))
    assert (path, url) == (hub_file(torch_home, RESNET50_V2), RESNET50_V2.url)
    assert path.name == "resnet50-11ad3fa6.pth"
    older, _ = hub_weights(ModelConfig(name="resnet50", weights="IMAGENET1K_V1"))
    assert older == hub_file(torch_home, torchvision.models.ResNet50_Weights.IMAGENET1K_V1) != path


def test_a_weight_name_not_in_the_cache_is_exit_3_naming_the_file_and_its_url(torch_home):
    with pytest.raises(DataError) as info:
        check_model(config("resnet50", weights="IMAGENET1K_V2", new_head=True), 10)
    message = str(info.value)
    assert info.value.exit_code == 3 and "\n" not in message
    assert str(hub_file(torch_home, RESNET50_V2)) in message and RESNET50_V2.url in message
    assert message.startswith("model.weights: IMAGENET1K_V2") and "nothing is downloaded" in message


@pytest.mark.parametrize(("name", "weights", "message"), [
    ("resnet50", "ResNet18_Weights.IMAGENET1K_V1", "not resnet50's weights \\(ResNet50_Weights\\)"),
    ("resnet50", "IMAGENET1K_V3", "no weights 'IMAGENET1K_V3' \\(did you mean 'IMAGENET1K_V"),
    ("resnet_tiny", "DEFAULT", "resnet_tiny has none; give a file")])
def test_weight_names_a_model_does_not_have(torch_home, name, weights, message):
    with pytest.raises(ConfigError, match=message):
        check_model(config(name, 32, weights=weights), 10)


def test_a_planted_file_loads_with_a_new_head_and_stays_a_name(torch_home):
    weights = torchvision.models.SqueezeNet1_1_Weights.IMAGENET1K_V1  # its classifier is a Conv2d
    plant(hub_file(torch_home, weights), on_meta(torchvision.models.squeezenet1_1))
    with pytest.raises(ConfigError, match="1000-class head, the data set has 10 classes"):
        check_model(config("squeezenet1_1", weights="DEFAULT"), 10)
    cfg = config("squeezenet1_1", weights="DEFAULT", new_head=True)
    check_model(cfg, 10)
    # not made a path: the workers resolve it in their own cache
    assert node_facts(cfg, Workers(1, 1, "gloo", "cpu", "fp32")).weights_file is None
    torch.manual_seed(0)
    model = build_model(cfg.model, 10)
    load_weights(model, cfg.model, 10)
    state = model.state_dict()
    assert all(not state[k].any() for k in state if k.startswith("features."))
    assert state["classifier.1.weight"].shape[0] == 10 and state["classifier.1.weight"].any()


def test_torchvision_files_in_older_layouts_fit(torch_home):
    """DenseNet's files use its old module names, GoogLeNet's carry the auxiliary heads ddp leaves out:
    torchvision fixes both when it loads them, and so does ddp."""
    dense = torchvision.models.DenseNet121_Weights.IMAGENET1K_V1
    def old_names(key: str) -> str | None:  # and no num_batches_tracked: the files predate it
        return None if key.endswith("num_batches_tracked") else re.sub(
            r"(denselayer\d+\.(?:norm|relu|conv))([12])\.", r"\1.\2.", key)

    plant(hub_file(torch_home, dense), on_meta(torchvision.models.densenet121), old_names)
    assert "features.denseblock1.denselayer1.norm.1.weight" in torch.load(hub_file(torch_home, dense))
    check_model(config("densenet121", weights="DEFAULT"), 1000)
    google = torchvision.models.GoogLeNet_Weights.IMAGENET1K_V1
    plant(hub_file(torch_home, google), on_meta(torchvision.models.googlenet, aux_logits=True,
                                                init_weights=False))
    check_model(config("googlenet", weights="DEFAULT"), 1000)


# --- model.kwargs --------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "kwargs", "message"), [
    ("resnet50", {"dropuot": 0.1}, "resnet50 takes no keyword 'dropuot'; its builder takes "
                                   "block, layers, zero_init_residual, groups"),
    ("resnet_tiny", {"depth": 3}, "resnet_tiny takes no keyword 'depth'; its builder takes width$"),
    ("convnext_tiny", {"stochastic_depth_porb": 0.2}, "'stochastic_depth_porb'.*stochastic_depth_prob"),
    ("vit_b_16", {"image_size": 224}, "image_size is set by ddp for vit_b_16"),
    ("resnet50", {"block": 1}, "resnet50 cannot be built with \\{'block': 1\\}.*multiple values"),
])
def test_kwargs_the_builder_does_not_take_are_config_errors(name, kwargs, message):
    with pytest.raises(ConfigError, match=f"model.kwargs: .*{message}"):
        check_model(config(name, 32 if name == "resnet_tiny" else 224, kwargs=kwargs), 10)


def test_kwargs_reach_the_builder_and_the_export_card():
    cfg = config("convnext_tiny", kwargs={"stochastic_depth_prob": 0.3}).model
    drops = [m.p for m in on_meta(build_model, cfg=cfg, num_classes=5).modules()
             if type(m).__name__ == "StochasticDepth"]
    assert max(drops) == pytest.approx(0.3)  # torchvision's default for convnext_tiny: 0.1
    head = on_meta(build_model, cfg=config("efficientnet_v2_s", kwargs={"dropout": 0.5}).model, num_classes=5)
    assert head.classifier[0].p == 0.5  # a keyword its builder reads itself
    on_meta(build_model, cfg=config("mobilenet_v3_small", kwargs={"width_mult": 0.5}).model, num_classes=5)
    tiny = config("resnet_tiny", 32, kwargs={"width": 8})
    check_model(tiny, 3)
    assert build_model(tiny.model, 3).stem[0].out_channels == 8
    make, kwargs = builder(SimpleNamespace(cfg=tiny))
    assert (make, kwargs) == ("ddp_cli.models.TinyResNet", {"width": 8})
    assert TinyResNet(num_classes=3, **kwargs).stem[0].out_channels == 8  # what a card's reader does
    assert builder_kwargs(config("vit_b_16", kwargs={"dropout": 0.1}).model, 224) == {
        "image_size": 224, "dropout": 0.1}


# --- model.freeze ----------------------------------------------------------------------------------


def tiny_model(seed: int = 0) -> nn.Module:
    """A 3-class resnet_tiny 8 channels wide, trained on 8 px batches: milliseconds a step."""
    torch.manual_seed(seed)
    return build_model(ModelConfig(name="resnet_tiny", kwargs={"width": 8}), 3)


def test_freeze_stops_the_gradients_of_named_modules_and_parameters():
    model = tiny_model()
    freeze(model, ModelConfig(name="resnet_tiny", freeze=["stem", "stages.0.conv1"]))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"stem.0.weight", "stem.1.weight", "stem.1.bias", "stages.0.conv1.weight"}
    vit = VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=8, mlp_dim=16)
    freeze(vit, ModelConfig(name="vit", freeze=["class_token", "conv_proj"]))
    assert {n for n, p in vit.named_parameters() if not p.requires_grad} == {
        "class_token", "conv_proj.weight", "conv_proj.bias"}


@pytest.mark.parametrize(("freeze_names", "message"), [
    (["stemm"], "model.freeze: resnet_tiny has no module 'stemm' \\(did you mean 'stem'"),
    (["stem", "stages", "head"], "holds every parameter of resnet_tiny: nothing would train")])
def test_freezing_what_is_not_there_or_everything_is_a_config_error(freeze_names, message):
    with pytest.raises(ConfigError, match=message):
        check_model(config("resnet_tiny", 32, freeze=freeze_names), 3)


def train_steps(model: nn.Module, optim: OptimConfig, model_cfg: ModelConfig, steps: int,
                steps_per_epoch: int = 3) -> tuple[list[list[float]], list[bool]]:
    """`steps` optimisation steps on random batches as the trainer takes them (optimiser, then
    schedule): the LR of every group at each step, and whether the stem has moved after it."""
    optimizer = build_optimizer(optim, model, 0.1, model_cfg)
    scheduler = build_scheduler(optimizer, ScheduleConfig(name="cosine", warmup_steps=2), steps_per_epoch,
                                4 * steps_per_epoch)
    start, lrs, moved = stem(model), [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        lrs.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        moved.append(any(not torch.equal(start[k], v) for k, v in stem(model).items()))
    return lrs, moved


def stem(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if k.startswith("stem.")}


def test_frozen_for_the_whole_run_no_gradient_and_no_change():
    model, cfg = tiny_model(), ModelConfig(name="resnet_tiny", freeze=["stem"])
    freeze(model, cfg)
    head = model.head[2].weight.detach().clone()
    _, moved = train_steps(model, OptimConfig(weight_decay=0.01), cfg, 3)
    assert moved == [False] * 3 and all(p.grad is None for p in model.stem.parameters())
    assert not torch.equal(head, model.head[2].weight)


@pytest.mark.parametrize("name", ["sgd", "adamw", "lars", "lamb", "rmsprop"])
def test_frozen_for_two_epochs_then_trained_from_the_epoch_boundary(name):
    """Weight decay and momentum would move a parameter with a zero gradient; a zero LR moves nothing."""
    model, cfg = tiny_model(), ModelConfig(name="resnet_tiny", freeze=["stem"], freeze_epochs=2)
    freeze(model, cfg)
    assert all(p.requires_grad for p in model.parameters())  # DDP's gradients stay the same all run
    lrs, moved = train_steps(model, OptimConfig(name=name, weight_decay=0.01), cfg, 7)  # 3 steps an epoch
    assert moved == [False] * 6 + [True]
    assert all(step[-1] == 0.0 and step[0] > 0 for step in lrs[:6])  # the frozen groups come last
    assert lrs[6][-1] == lrs[6][0] > 0  # epoch 3: the body's LR from its first step


# --- parameter groups ------------------------------------------------------------------------------


def groups_by_param(model: nn.Module, groups: list[dict]) -> dict[str, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: group for group in groups for p in group["params"]}


def test_the_head_trains_at_head_lr_mult_times_the_schedule():
    model = tiny_model()
    optimizer = build_optimizer(OptimConfig(head_lr_mult=10), model, 0.1)
    by_name = groups_by_param(model, optimizer.param_groups)
    assert {n for n, g in by_name.items() if g["lr_scale"] == 10} == {"head.2.weight", "head.2.bias"}
    assert optimizer.param_groups[0]["lr_scale"] == 1 and optimizer.param_groups[0]["trust_ratio"]
    cfg = ScheduleConfig(name="cosine", warmup_steps=3)
    scheduler, factor = build_scheduler(optimizer, cfg, 5, 20), lr_factor(cfg, 5, 20)
    for step in range(20):
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(0.1 * group["lr_scale"] * factor(step), abs=1e-12)
        optimizer.step()
        scheduler.step()


def small_vit() -> nn.Module:
    return VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=8,
                             mlp_dim=16, num_classes=5)


def test_layer_decay_scales_each_vit_layer_below_the_head():
    model = small_vit()
    scales = {n: g["lr_scale"] for n, g in groups_by_param(
        model, param_groups(model, OptimConfig(layer_decay=0.5, head_lr_mult=3))).items()}
    expected = {"class_token": 0.125, "conv_proj.weight": 0.125, "conv_proj.bias": 0.125,
                "encoder.pos_embedding": 0.125, "encoder.layers.encoder_layer_0.ln_1.weight": 0.25,
                "encoder.layers.encoder_layer_0.mlp.3.weight": 0.25,
                "encoder.layers.encoder_layer_1.self_attention.in_proj_weight": 0.5,
                "encoder.ln.weight": 1.0, "heads.head.weight": 3.0, "heads.head.bias": 3.0}
    assert {n: scales[n] for n in expected} == expected
    assert len(scales) == len(list(model.parameters()))


def test_layer_decay_needs_a_vit():
    with pytest.raises(ConfigError, match="optim.layer_decay: layer-wise LR decay needs a ViT.*resnet18"):
        check_model(config("resnet18", optim={"layer_decay": 0.65}), 10)
    check_model(config("vit_b_16", optim={"layer_decay": 0.65}), 10)


def test_no_decay_names_and_trust_ratios_survive_the_grouping():
    model = small_vit()
    groups = param_groups(model, OptimConfig(weight_decay=0.05, no_decay=["pos_embedding", "class_token"],
                                             head_lr_mult=2))
    by_name = groups_by_param(model, groups)
    for name, param in model.named_parameters():
        group = by_name[name]
        excluded = param.ndim == 1 or name in ("encoder.pos_embedding", "class_token")
        assert group["weight_decay"] == (0.0 if excluded else 0.05), name
        assert group["trust_ratio"] is (param.ndim > 1), name  # LARS/LAMB: matrices only
    opt = build_optimizer(OptimConfig(name="lars", head_lr_mult=2), model, 0.1)
    assert isinstance(opt, Lars) and {(g["trust_ratio"], g["lr"]) for g in opt.param_groups} == {
        (True, 0.1), (False, 0.1), (True, 0.2), (False, 0.2)}
    assert isinstance(build_optimizer(OptimConfig(name="lamb"), model, 0.1), Lamb)


def test_rmsprop_takes_alpha_eps_momentum_and_decay_per_group():
    model = tiny_model()
    opt = build_optimizer(OptimConfig(name="rmsprop", alpha=0.8, eps=0.0316, momentum=0.7,
                                      weight_decay=1e-5), model, 0.2)
    assert isinstance(opt, torch.optim.RMSprop)
    assert {(g["alpha"], g["eps"], g["momentum"]) for g in opt.param_groups} == {(0.8, 0.0316, 0.7)}
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-5, 0.0]


def test_groups_and_schedule_resume_exactly_from_a_weights_only_checkpoint():
    """Group keys (lr_scale, frozen_epochs) and the per-group factors survive the checkpoint round trip."""
    cfg = ModelConfig(name="resnet_tiny", freeze=["stem"], freeze_epochs=1)
    optim = OptimConfig(head_lr_mult=5)
    schedule = ScheduleConfig(name="cosine", warmup_steps=2)

    def parts(model):
        optimizer = build_optimizer(optim, model, 0.1, cfg)
        return optimizer, build_scheduler(optimizer, schedule, 2, 8)

    def step(model, optimizer, scheduler, i):
        g = torch.Generator().manual_seed(i)
        nn.functional.cross_entropy(model(torch.randn(4, 3, 8, 8, generator=g)),
                                    torch.randint(0, 3, (4,), generator=g)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    whole = tiny_model()
    opt, sched = parts(whole)
    for i in range(6):
        step(whole, opt, sched, i)
    first = tiny_model()
    opt, sched = parts(first)
    for i in range(3):
        step(first, opt, sched, i)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = tiny_model(seed=1)
    resumed.load_state_dict(saved["model"])
    opt, sched = parts(resumed)
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    for i in range(3, 6):
        step(resumed, opt, sched, i)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(),
                                                 strict=True))
