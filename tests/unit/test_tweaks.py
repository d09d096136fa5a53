"""The fast recipe's network tweaks (`ddp_cli.models.tweaks`): BlurPool filters before every strided
convolution past the stem, keeping every parameter; zero-initialised residual branches make each block
the identity at the start."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock

from ddp_cli.config import ModelConfig
from ddp_cli.models import build_model
from ddp_cli.models.tweaks import MIN_BLUR_CHANNELS, BlurConv2d, add_blurpool, blurs, zero_init_residual


def plain_and_tweaked(name: str, blurpool: bool = True, zero_init_residual: bool = True
                      ) -> tuple[nn.Module, nn.Module]:
    """The model as built by default (both off) and with the tweaks asked for, from the same seed."""
    torch.manual_seed(0)
    plain = build_model(ModelConfig(name=name), 10, 64)
    torch.manual_seed(0)
    tweaked = build_model(ModelConfig(name=name, blurpool=blurpool, zero_init_residual=zero_init_residual),
                          10, 64)
    return plain, tweaked


@pytest.mark.parametrize(("name", "strided"), [
    ("resnet18", ["layer2.0.conv1", "layer2.0.downsample.0", "layer3.0.conv1", "layer3.0.downsample.0",
                  "layer4.0.conv1", "layer4.0.downsample.0"]),
    ("resnet50", ["layer2.0.conv2", "layer2.0.downsample.0", "layer3.0.conv2", "layer3.0.downsample.0",
                  "layer4.0.conv2", "layer4.0.downsample.0"]),
    ("resnet_tiny", ["stages.1.conv1", "stages.1.downsample.0", "stages.2.conv1", "stages.2.downsample.0"]),
])
def test_blurpool_takes_the_strided_convolutions_past_the_stem_and_keeps_every_parameter(name, strided):
    plain, tweaked = plain_and_tweaked(name)
    assert sorted(n for n, m in tweaked.named_modules() if isinstance(m, BlurConv2d)) == sorted(strided)
    assert not isinstance(dict(tweaked.named_modules()).get("conv1"), BlurConv2d)  # torchvision's stem
    assert list(plain.state_dict()) == list(tweaked.state_dict())  # names, and no filter in a checkpoint
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in tweaked.parameters())
    tweaked.load_state_dict(plain.state_dict())
    x = torch.rand(2, 3, 64, 64)
    assert not torch.allclose(plain.eval()(x), tweaked.eval()(x))  # the same weights compute otherwise


def test_the_blur_removes_what_a_stride_would_alias():
    """A one-pixel checkerboard, strided by 2: a plain 1x1 convolution samples only its +1 squares and
    sees a bright flat image (aliasing); filtered first, it sees the checkerboard's mean, 0."""
    conv = nn.Conv2d(16, 16, 1, stride=2, bias=False)
    nn.init.dirac_(conv.weight)
    board = (torch.arange(16).view(1, 16) + torch.arange(16).view(16, 1)) % 2 * -2.0 + 1
    x = board.expand(1, 16, 16, 16)
    assert torch.equal(conv(x), torch.ones(1, 16, 8, 8))
    inner = BlurConv2d.replacing(conv)(x)[..., 1:-1, 1:-1]  # the border sees the zero padding
    assert inner.abs().max() < 1e-6


def test_blurpool_computes_in_the_inputs_dtype_and_memory_format():
    conv = BlurConv2d.replacing(nn.Conv2d(16, 8, 3, stride=2, padding=1))
    x = torch.rand(2, 16, 8, 8).to(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv(x).dtype == torch.bfloat16


@pytest.mark.parametrize("kernel", [1, 3])
@pytest.mark.parametrize("side", [16, 15])
def test_blurpool_keeps_the_convolutions_output_shape(kernel, side):
    """The blur pads to keep its input's size: the strided convolution after it gives what it gave alone."""
    conv = nn.Conv2d(16, 8, kernel, stride=2, padding=kernel // 2)
    x = torch.rand(2, 16, side, side)
    assert BlurConv2d.replacing(conv)(x).shape == conv(x).shape


def test_blurpool_of_a_bf16_convolution_computes_in_bf16_without_autocast():
    """The filter is made in the convolution's dtype: a network cast to bf16 before BlurPool runs."""
    conv = BlurConv2d.replacing(nn.Conv2d(16, 8, 3, stride=2, padding=1).to(torch.bfloat16))
    assert conv(torch.rand(2, 16, 8, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_blurpool_starts_at_sixteen_input_channels():
    """Strided convolutions from MIN_BLUR_CHANNELS inputs up are blurred; fewer (an RGB stem) are not, nor
    stride 1 or grouped ones."""
    assert blurs(nn.Conv2d(MIN_BLUR_CHANNELS, 8, 3, stride=2))
    assert not blurs(nn.Conv2d(MIN_BLUR_CHANNELS - 1, 8, 3, stride=2))
    assert not blurs(nn.Conv2d(MIN_BLUR_CHANNELS, 8, 3, stride=1))
    assert not blurs(nn.Conv2d(MIN_BLUR_CHANNELS, MIN_BLUR_CHANNELS, 3, stride=2, groups=MIN_BLUR_CHANNELS))


class Bottleneck(nn.Module):
    """A block that only shares torchvision's class name: no `bn3` to zero."""


class OwnBlock(nn.Module):
    """timm's protocol: a block that zeroes its own last norm when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = False

    def zero_init_last(self) -> None:
        self.asked = True


def test_zero_init_asks_blocks_that_know_how_and_passes_over_lookalikes():
    """A block with its own `zero_init_last` (timm's, whatever its class) is asked; one named like
    torchvision's without the norm is passed over, and the blocks after it are still zeroed."""
    own, basic = OwnBlock(), BasicBlock(8, 8)
    assert zero_init_residual(nn.Sequential(Bottleneck(), own, basic)) == 2
    assert own.asked and not basic.bn2.weight.any()


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "resnet_tiny"])
def test_zero_init_makes_every_block_without_a_projection_its_identity(name):
    _, model = plain_and_tweaked(name, blurpool=False)
    blocks = [m for m in model.modules() if type(m).__name__ in ("BasicBlock", "Bottleneck")]
    identities = [m for m in blocks if m.downsample is None]
    assert identities and zero_init_residual(model) == len(blocks)
    for block in identities:
        channels = block.conv1.in_channels
        x = torch.rand(2, channels, 8, 8)  # what a block receives: after a ReLU, non-negative
        assert torch.equal(block.train()(x), x)


def test_off_by_default_builds_the_plain_network():
    plain, _ = plain_and_tweaked("resnet18")
    assert all(p.all() for n, p in plain.named_parameters() if n.endswith("bn2.weight"))
    assert add_blurpool(plain) == 6  # nothing was blurred before


def test_timm_blocks_zero_their_last_norm_and_blur_like_torchvisions():
    pytest.importorskip("timm")
    _, model = plain_and_tweaked("timm/resnet18")
    assert any(isinstance(m, BlurConv2d) for m in model.modules())
    assert all(not m.bn2.weight.any() for m in model.modules() if hasattr(m, "zero_init_last"))



def test_the_dry_run_plan_says_which_elements_of_the_recipe_are_on():
    from ddp_cli.cli.plan import recipe
    from ddp_cli.config import config_from_dict
    from ddp_cli.config.resolve import Facts, resolve

    def plan_of(raw: dict) -> dict:  # the plan shows the config preflight resolved: 22 steps an epoch
        return recipe(resolve(config_from_dict(raw), Facts(steps_per_epoch=22)))

    assert plan_of({}) == {
        "blurpool": False, "zero_init_residual": False, "label_smoothing": 0.1,
        "progressive_resizing": True, "test_above_train_size": True, "ema": True, "ema_bn_epochs": 4}
    assert not plan_of({"data": {"progressive": False}})["test_above_train_size"]  # FixRes' end: 200 < 224
    assert plan_of({"train": {"ema_bn_epochs": 2}})["ema_bn_epochs"] == 2
    assert not plan_of({"data": {"progressive": False}})["progressive_resizing"]
    assert not plan_of({"train": {"ema_decay": 0}})["ema"]
    on = config_from_dict({
        "model": {"blurpool": True, "zero_init_residual": True}, "optim": {"label_smoothing": 0.1},
        "data": {"image_size": 112, "min_image_size": 80, "ramp_epochs": [4, 6], "val_image_size": 144},
        "train": {"ema_decay": 0.99}})
    assert all(recipe(on).values())
