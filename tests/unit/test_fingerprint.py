"""The replica check's fingerprint: exact, position-sensitive, the same with any thread count."""

from __future__ import annotations

import torch
from torch import nn

from ddp_cli.run.training import weights_fingerprint


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 5))


def test_same_weights_same_fingerprint_whatever_the_threads():
    a, b = model(), model()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = weights_fingerprint(a)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(one, weights_fingerprint(b))
    finally:
        torch.set_num_threads(threads)


def test_one_ulp_or_two_swapped_weights_change_it():
    reference = weights_fingerprint(model())
    nudged, swapped, half = model(), model(), model().half()
    with torch.no_grad():
        weight = nudged[2].weight
        weight[1, 2] = torch.nextafter(weight[1, 2], torch.tensor(10.0))
        swapped[0].weight[[0, 1]] = swapped[0].weight[[1, 0]]
    assert not torch.equal(weights_fingerprint(nudged), reference)
    assert not torch.equal(weights_fingerprint(swapped), reference)
    assert weights_fingerprint(half).shape == reference.shape  # 16-bit weights are read as int16
