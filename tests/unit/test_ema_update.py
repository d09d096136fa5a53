"""The EMA update: foreach kernels over tensor lists built once, every `every` steps with decay d**every."""

from __future__ import annotations

import torch
from torch import nn

from ddp_cli.train.ema import EmaModel


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def train_a_little(model: nn.Module) -> None:
    """One SGD step in train mode: weights, running statistics and num_batches_tracked all move."""
    model.train()
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * p.grad)
            p.grad = None


def reference(average: dict[str, torch.Tensor], live: nn.Module, d: float) -> dict[str, torch.Tensor]:
    """The per-tensor rule: lerp the floating tensors, copy the integer ones."""
    return {k: torch.lerp(average[k], v, 1 - d) if v.is_floating_point() else v.clone()
            for k, v in live.state_dict().items()}


def assert_state(ema: EmaModel, expected: dict[str, torch.Tensor]) -> None:
    state = ema.module.state_dict()
    assert state.keys() == expected.keys()
    for key, value in state.items():
        torch.testing.assert_close(value, expected[key], msg=key)


def test_a_new_ema_is_a_frozen_copy_in_eval_mode_that_updates_every_step_by_default():
    """The average is never trained (no gradients: no graph in a forward outside no_grad, nothing for an
    optimiser) and validates with running statistics; unless told `every`, each step updates it."""
    model = small_model()
    ema = EmaModel(model, decay=0.9)
    assert ema.module is not model and not ema.module.training
    assert not any(p.requires_grad for p in ema.module.parameters())
    train_a_little(model)
    ema.step(model, 1)
    assert ema.updates == 1


def test_the_foreach_update_equals_the_per_tensor_rule_and_copies_integer_buffers():
    model = small_model()
    ema = EmaModel(model, decay=0.9)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for t in range(5):
        train_a_little(model)
        expected = reference(expected, model, min(0.9, (1 + t) / (10 + t)))
        ema.update(model)
    assert_state(ema, expected)
    assert ema.module.state_dict()["1.num_batches_tracked"].item() == 5


def test_every_fourth_step_updates_with_the_decay_to_the_fourth():
    model = small_model()
    ema = EmaModel(model, decay=0.5, every=4)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(1, 13):
        train_a_little(model)
        before = {k: v.clone() for k, v in ema.module.state_dict().items()}
        ema.step(model, step)
        if step % 4:
            assert_state(ema, before)  # no update off the interval
        else:
            t = step // 4 - 1  # the ramp counts updates
            expected = reference(expected, model, min(0.5 ** 4, (1 + t) / (10 + t)))
            assert_state(ema, expected)
    assert ema.updates == 3
    assert EmaModel(model, decay=0.5, every=4).current_decay() == min(0.5 ** 4, 1 / 10)


def test_the_state_round_trips_and_updates_go_on_in_the_loaded_module():
    model = small_model()
    ema = EmaModel(model, decay=0.9)
    for _ in range(3):
        train_a_little(model)
        ema.update(model)
    other = EmaModel(small_model(seed=1), decay=0.9)
    other.update(model)  # its lists are built, then the load must fill the same tensors
    other.load_state_dict(ema.state_dict())
    assert other.updates == 3
    assert_state(other, ema.module.state_dict())
    train_a_little(model)
    ema.update(model)
    other.update(model)
    assert_state(other, ema.module.state_dict())


def test_restart_averages_afresh_from_the_model_in_the_module_itself():
    model = small_model()
    ema = EmaModel(small_model(seed=1), decay=0.9)
    ema.update(model)
    ema.restart(model)
    assert ema.updates == 0
    assert_state(ema, model.state_dict())
    train_a_little(model)
    expected = reference({k: v.clone() for k, v in ema.module.state_dict().items()}, model, 0.1)
    ema.update(model)
    assert_state(ema, expected)  # the cached lists are the module's own tensors, not stale copies
    assert all(a is b or a.data_ptr() == b.data_ptr()
               for a, b in zip(ema.floats, [v for v in ema.module.state_dict().values()
                                           if v.is_floating_point()], strict=True))


def test_a_checkpoints_ema_round_trips_through_torch_save(tmp_path):
    model = small_model()
    ema = EmaModel(model, decay=0.9, every=2)
    for step in range(1, 5):
        train_a_little(model)
        ema.step(model, step)
    torch.save({"ema": ema.state_dict()}, tmp_path / "c.pt")
    other = EmaModel(small_model(seed=2), decay=0.9, every=2)
    other.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True)["ema"])
    assert other.updates == ema.updates == 2
    assert_state(other, ema.module.state_dict())
