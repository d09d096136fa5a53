"""The GPU decode's batched render (batched_resize.py) against the per-image resize it replaces."""

from __future__ import annotations

import pytest
import torch

from ddp_cli.data.pipeline import batched_resize
from ddp_cli.data.pipeline.batched_resize import chunks, resize_crops
from ddp_cli.data.pipeline.transforms import crop_resize, pixel_box


def draws(count: int, seed: int = 0) -> list[tuple[torch.Tensor, tuple, bool]]:
    """Images of many sizes, each with a box (fractional, as planned: shrunk, enlarged, at the edges, a
    pixel wide) and a flip."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in range(count):
        h, w = torch.randint(8, 200, (2,), generator=g).tolist()
        image = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
        bh, bw = (torch.rand(2, generator=g) * torch.tensor([h, w])).clamp(min=0.6).tolist()
        top, left = (torch.rand(2, generator=g) * torch.tensor([h - bh, w - bw])).tolist()
        box = [(top, left, bh, bw), (0.0, 0.0, float(h), float(w)), (h - 0.7, w - 1.2, 0.6, 0.9)][n % 3]
        out.append((image, box, n % 2 == 0))
    return out


def per_image(drawn, size: int, mode: str) -> torch.Tensor:
    resized = [crop_resize(image, box, size, mode, in_float=True) for image, box, _ in drawn]
    return torch.stack([r.flip(1) if flip else r for r, (_, _, flip) in zip(resized, drawn, strict=True)])


def batched(drawn, size: int, mode: str) -> torch.Tensor:
    return resize_crops([image.permute(2, 0, 1) for image, _, _ in drawn],
                        [pixel_box(box, *image.shape[:2]) for image, box, _ in drawn],
                        [flip for _, _, flip in drawn], size, mode)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size", [24, 96])  # mostly shrinking; mostly enlarging
def test_the_batched_render_is_the_per_image_resize_up_to_float_rounding(mode, size):
    drawn = draws(30)
    ours, theirs = batched(drawn, size, mode), per_image(drawn, size, mode)
    assert ours.shape == theirs.shape == (30, size, size, 3) and ours.dtype == torch.uint8
    diff = (ours.int() - theirs.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3  # a .5 rounded the other way, rarely


def test_a_batch_of_crops_over_the_budget_is_resized_a_chunk_at_a_time_to_the_same_pixels(monkeypatch):
    drawn = draws(12, seed=1)
    whole = batched(drawn, 32, "bilinear")
    monkeypatch.setattr(batched_resize, "BUDGET", 3 * 120 * 120)
    assert len(chunks([pixel_box(box, *image.shape[:2])[2:] for image, box, _ in drawn])) > 2
    assert torch.equal(batched(drawn, 32, "bilinear"), whole)


def test_one_image_is_a_batch_too():
    drawn = draws(1, seed=2)
    assert torch.equal(batched(drawn, 16, "bilinear"), per_image(drawn, 16, "bilinear"))


def test_chunks_are_filled_largest_crop_first_each_up_to_the_budget(monkeypatch):
    """Greedy by area, largest first: a chunk takes the next crop while the chunk padded to its largest
    height and width stays within the budget (here exactly at it: 2 x 3 x 50 x 100), else a new one
    starts."""
    monkeypatch.setattr(batched_resize, "BUDGET", 2 * 3 * 50 * 100)
    groups = chunks([(100, 30), (100, 30), (4, 9), (50, 30), (30, 100)])
    assert sorted(map(sorted, groups)) == [[0, 1], [2], [3, 4]]


def test_chunks_hold_each_crop_once_within_the_budget_and_a_huge_one_alone(monkeypatch):
    monkeypatch.setattr(batched_resize, "BUDGET", 3 * 100 * 100)
    sizes = [(50, 40), (100, 100), (30, 30), (300, 200), (60, 70), (10, 90)]
    groups = chunks(sizes)
    assert sorted(i for group in groups for i in group) == list(range(len(sizes)))
    assert [3] in groups and [1] in groups  # over the budget alone; at it, with no room for more
    for group in (g for g in groups if len(g) > 1):
        h, w = max(sizes[i][0] for i in group), max(sizes[i][1] for i in group)
        assert len(group) * 3 * h * w <= batched_resize.BUDGET
