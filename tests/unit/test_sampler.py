"""ShardSampler: k ranks with batch b together see what one process with batch k*b sees."""

from __future__ import annotations

import pytest

from ddp_cli.data.loaders import ShardSampler


def shards(n: int, world: int, shuffle: bool, epoch: int = 0, seed: int = 0) -> list[list[int]]:
    out = []
    for rank in range(world):
        sampler = ShardSampler(n, rank, world, shuffle=shuffle, seed=seed)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
        assert len(out[-1]) == len(sampler)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [103, 120])
def test_train_shards_are_disjoint_equal_and_without_replacement(n, world):
    parts = shards(n, world, shuffle=True, epoch=2, seed=5)
    lengths = {len(p) for p in parts}
    assert lengths == {n // world}
    flat = [i for p in parts for i in p]
    assert len(set(flat)) == len(flat)  # no index twice, within or across ranks
    assert set(flat) <= set(range(n))
    assert len(flat) == n - n % world


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_train_shards_change_between_epochs(world):
    first, second = shards(97, world, True, epoch=0), shards(97, world, True, epoch=1)
    for a, b in zip(first, second, strict=True):
        assert a != b
    assert shards(97, world, True, epoch=1) == second  # but are reproducible
    assert shards(97, world, True, epoch=0, seed=1) != first  # and depend on the seed


def test_train_order_is_shuffled():
    (order,) = shards(200, 1, shuffle=True)
    assert sorted(order) == list(range(200))
    assert order != list(range(200))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 5])
def test_step_batches_union_is_the_single_process_batch(world, batch):
    n, epoch, seed = 131, 3, 11
    (single,) = shards(n, 1, shuffle=True, epoch=epoch, seed=seed)  # one process, batch k*b
    parts = shards(n, world, shuffle=True, epoch=epoch, seed=seed)
    steps = n // world // batch  # drop_last
    assert steps > 0
    for s in range(steps):
        union = [i for p in parts for i in p[s * batch:(s + 1) * batch]]
        assert sorted(union) == sorted(single[s * world * batch:(s + 1) * world * batch]), s


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [359, 7, 1])
def test_val_shards_cover_every_index_exactly_once(n, world):
    parts = shards(n, world, shuffle=False)
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(n))
    assert sum(len(ShardSampler(n, r, world, shuffle=False)) for r in range(world)) == n
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_val_shards_ignore_epoch():
    assert shards(359, 3, shuffle=False, epoch=0) == shards(359, 3, shuffle=False, epoch=4)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 3), (4, 2), (2, 2)])
def test_a_mid_epoch_skip_continues_the_permutation_at_another_world_size(before, after):
    """`skip` counts positions consumed by all ranks, so new ranks get exactly the unseen rest."""
    n, consumed = 101, 36
    seen = {i for part in shards(n, before, True, epoch=3, seed=7) for i in part[: consumed // before]}
    assert len(seen) == consumed
    rest = []
    for rank in range(after):
        sampler = ShardSampler(n, rank, after, shuffle=True, seed=7)
        sampler.set_epoch(3, skip=consumed)
        rest.append(list(sampler))
    flat = [i for part in rest for i in part]
    assert not seen & set(flat)  # nothing seen before comes again
    assert len(flat) == len(set(flat)) == n - n % after - consumed  # and nothing unseen is lost
