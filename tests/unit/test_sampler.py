"""ShardSampler: k ranks with batch b together see what one process with batch k*b sees."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from ddp_cli.data.pipeline.loaders import EpochItems
from ddp_cli.data.pipeline.sampler import ShardSampler, permutation, repeated, shard_order


def samplers(n: int, world: int, shuffle: bool = True, batch: int = 1, repeats: int = 1,
             seed: int = 0) -> list[ShardSampler]:
    return [ShardSampler(n, rank, world, shuffle=shuffle, seed=seed, batch_size=batch, repeats=repeats,
                         with_epoch=repeats > 1) for rank in range(world)]


def shards(n: int, world: int, shuffle: bool, epoch: int = 0, seed: int = 0, batch: int = 1,
           repeats: int = 1, skip: int = 0, layout: int = 0) -> list[list]:
    """Every rank's items for the epoch: indices, or (index, copy) pairs with repeats."""
    out = []
    for sampler in samplers(n, world, shuffle, batch, repeats, seed):
        sampler.set_epoch(epoch, skip, layout)
        items = list(sampler)
        out.append([(index, copy) for index, _, copy in items] if repeats > 1 else items)
        if not skip:
            assert len(out[-1]) == len(sampler)
    return out


def epoch_order(n: int, epoch: int, chunk: int, repeats: int) -> list[tuple[int, int]]:
    """The whole epoch's (index, copy) order, laid out for global batches of `chunk`."""
    (sampler,) = samplers(n, 1, batch=chunk, repeats=repeats)
    sampler.set_epoch(epoch)
    return [(index, copy) for index, copy in sampler.order().tolist()]


def steps_of(parts: list[list], batch: int) -> list[list]:
    """Each step's global batch: the ranks' batches of that step, in rank order."""
    return [[item for part in parts for item in part[s * batch:(s + 1) * batch]]
            for s in range(len(parts[0]) // batch)]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [103, 120])
def test_train_shards_are_disjoint_equal_and_without_replacement(n, world, batch):
    parts = shards(n, world, shuffle=True, epoch=2, seed=5, batch=batch)
    whole_steps = n // (world * batch)  # the partial last global batch is dropped
    assert {len(p) for p in parts} == {whole_steps * batch}
    flat = [i for p in parts for i in p]
    assert len(set(flat)) == len(flat)  # no index twice, within or across ranks
    assert set(flat) <= set(range(n))
    assert len(flat) == whole_steps * world * batch


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
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_each_step_is_the_single_process_batch_in_blocks(world, batch):
    """Rank r's batch of step s is the block [r*b, (r+1)*b) of the single process's batch of step s, so
    the ranks' batches in rank order ARE that batch, position for position (adjacent pairs included)."""
    n, epoch, seed = 131, 3, 11
    (single,) = shards(n, 1, shuffle=True, epoch=epoch, seed=seed, batch=world * batch)
    parts = shards(n, world, shuffle=True, epoch=epoch, seed=seed, batch=batch)
    steps = steps_of(parts, batch)
    assert len(steps) == n // (world * batch) > 0
    assert steps == steps_of([single], world * batch)


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
    n, batch, consumed = 101, 3, 36  # 36: whole global batches at 1, 2 and 4 ranks of 3 images
    parts = shards(n, before, True, epoch=3, seed=7, batch=batch)
    seen = {i for part in parts for i in part[: consumed // before]}
    assert len(seen) == consumed
    flat = [i for part in shards(n, after, True, epoch=3, seed=7, batch=batch, skip=consumed) for i in part]
    assert not seen & set(flat)  # nothing seen before comes again
    assert len(flat) == len(set(flat)) == (n - consumed) // (after * batch) * after * batch  # nothing lost
    (whole,) = shards(n, 1, True, epoch=3, seed=7)  # the epoch's order, position by position
    resumed = [i for step in steps_of(shards(n, after, True, epoch=3, seed=7, batch=batch, skip=consumed),
                                      batch) for i in step]
    assert resumed == whole[consumed:consumed + len(resumed)]  # the very next positions, none skipped


# Repeated augmentation: (n, world, batch, repeats); chunk 12 = 4 copies x 3, chunk 15 = 2 x 7 + 1.
REPEATED = [(103, 4, 3, 3), (103, 4, 3, 4), (100, 3, 5, 2), (97, 2, 8, 2)]


@pytest.mark.parametrize(("n", "world", "batch", "repeats"), REPEATED)
def test_repeated_augmentation_shows_each_image_m_times_on_m_ranks(n, world, batch, repeats):
    parts = shards(n, world, True, epoch=1, seed=3, batch=batch, repeats=repeats)
    chunk = world * batch
    assert sum(map(len, parts)) == n // chunk * chunk  # the epoch keeps its n positions
    ranks: dict[int, list[int]] = {}
    copies: dict[int, list[int]] = {}
    for rank, part in enumerate(parts):
        for index, copy in part:
            ranks.setdefault(index, []).append(rank)
            copies.setdefault(index, []).append(copy)
    for index, where in ranks.items():
        assert len(set(where)) == len(where), f"image {index}'s copies share a rank"
        assert sorted(copies[index]) == list(range(len(where)))  # each copy once, differently seeded
    times = Counter(len(where) for where in ranks.values())
    group = chunk // repeats
    assert set(times) <= set(range(1, repeats + 1))
    assert sum(v for k, v in times.items() if k < repeats) <= group  # only the last group is cut short


def test_repeated_augmentation_draws_about_n_over_m_images_per_epoch():
    (single,) = shards(1200, 1, True, batch=48, repeats=3)
    images = {index for index, _ in single}
    assert len(images) == 400 and Counter(Counter(i for i, _ in single).values()) == {3: 400}
    assert images != {index for index, _ in shards(1200, 1, True, epoch=1, batch=48, repeats=3)[0]}


@pytest.mark.parametrize("world", [2, 3])
def test_repeated_augmentation_ranks_are_the_single_process(world):
    """The layout depends on the global batch alone: one process with batch k*b gets the same steps."""
    n, batch, repeats = 150, 4, 2
    (single,) = shards(n, 1, True, epoch=2, batch=world * batch, repeats=repeats)
    parts = shards(n, world, True, epoch=2, batch=batch, repeats=repeats)
    assert steps_of(parts, batch) == steps_of([single], world * batch)


@pytest.mark.parametrize(("before", "after"), [(4, 4), (4, 2), (2, 3)])
def test_repeated_augmentation_resumes_mid_epoch_exactly(before, after):
    """At the same world size the rest is the uninterrupted run's; at another, laid out as the epoch
    began (`layout`), the rest is every (image, copy) not yet seen, none twice."""
    n, batch, repeats, consumed = 100, 3, 2, 24  # 24: whole global batches at 2 and 4 ranks of 3
    full = shards(n, before, True, epoch=5, batch=batch, repeats=repeats)
    done = consumed // before
    seen = Counter(item for part in full for item in part[:done])
    layout = before * batch
    rest = shards(n, after, True, epoch=5, batch=batch, repeats=repeats, skip=consumed, layout=layout)
    if after == before:
        assert rest == [part[done:] for part in full]
    left = Counter(item for part in rest for item in part)
    assert not seen & left and max((seen + left).values()) == 1  # no (image, copy) twice
    assert seen + left == Counter(epoch_order(n, 5, layout, repeats)[: consumed + left.total()])  # none lost


class RandomPixels(Dataset):
    """What a sample's augmentation draws, as its item."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(4)


def test_copies_of_an_image_are_augmented_differently_and_reproducibly():
    items = EpochItems(RandomPixels(), seed=1)  # type: ignore[arg-type]
    first, again, second = items[(3, 2, 0)], items[(3, 2, 0)], items[(3, 2, 1)]
    assert torch.equal(first, again)
    assert not torch.equal(first, second)
    assert not torch.equal(second, items[(3, 2, 2)])


# Packed shards: 7 shards of uneven sizes (41 rows), read 3 at a time.
STARTS = np.array([0, 5, 11, 12, 20, 29, 33, 41])


def shard_samplers(world: int, batch: int, seed: int = 0) -> list[ShardSampler]:
    return [ShardSampler(41, rank, world, shuffle=True, seed=seed, batch_size=batch, shards=STARTS, window=3)
            for rank in range(world)]


def test_shard_order_reads_a_window_of_whole_shards_at_a_time_in_a_fresh_order_each_epoch():
    orders, groups = {}, {}
    for epoch in (0, 1):
        order = shard_order(STARTS, seed=0, epoch=epoch, window=3).tolist()
        assert sorted(order) == list(range(41))  # a permutation of every row
        shard_of = np.searchsorted(STARTS, order, side="right") - 1
        sizes = np.diff(STARTS)
        windows, seen, length = [], set(), 0
        for shard in shard_of:  # cut the order where the shards seen are whole: each cut is a window
            seen.add(int(shard))
            length += 1
            assert len(seen) <= 3, "a window mixes rows of more than 3 shards"
            if length == sum(sizes[j] for j in seen):
                windows.append(sorted(seen))
                seen, length = set(), 0
        assert not seen and [len(w) for w in windows] == [3, 3, 1]
        assert sorted(s for w in windows for s in w) == list(range(7))
        orders[epoch], groups[epoch] = order, windows
    assert orders[0] != orders[1] and groups[0] != groups[1]  # the shards too come in a fresh order
    assert shard_order(STARTS, seed=0, epoch=0, window=3).tolist() == orders[0]  # (seed, epoch) alone


def test_ranks_on_shards_see_the_batches_one_process_with_the_global_batch_sees():
    """The order depends on (seed, epoch) only: dealt in blocks, step s's k batches are the single
    process's batch s, position by position, and a resumed epoch goes on where it stopped."""
    (single,) = shard_samplers(1, 12)
    single.set_epoch(2)
    whole = list(single)
    ranks = shard_samplers(3, 4)
    for sampler in ranks:
        sampler.set_epoch(2)
    dealt = [list(s) for s in ranks]
    steps = len(dealt[0]) // 4
    assert steps == 41 // 12 and all(len(d) == steps * 4 for d in dealt)
    for step in range(steps):
        together = [i for d in dealt for i in d[step * 4:(step + 1) * 4]]
        assert together == whole[step * 12:(step + 1) * 12]
    for sampler in ranks:
        sampler.set_epoch(2, skip=12)  # one global batch done before a stop
    resumed = [list(s) for s in ranks]
    assert [d[4:] for d in dealt] == resumed


def test_a_split_without_shards_is_an_empty_order_of_indices():
    order = shard_order(np.array([0]), seed=0, epoch=0, window=3)
    assert order.dtype == torch.int64 and order.shape == (0,)


def test_shard_order_depends_on_the_seed_as_well_as_the_epoch():
    starts = np.arange(0, 101, 10)
    orders = {tuple(shard_order(starts, seed, epoch, window=2).tolist())
              for seed in (0, 1, 2) for epoch in (0, 1)}
    assert len(orders) == 6


def test_a_sampler_given_only_its_rank_deals_seed_0s_permutation_one_image_at_a_time():
    """The defaults (seed 0, batch 1, no repeats, plain indices, epoch 0 and nothing skipped before any
    set_epoch) are what the bench's samplers rely on."""
    fresh = [ShardSampler(10, rank, 2, shuffle=True) for rank in range(2)]
    expected = permutation(10, 0, 0).tolist()
    assert [list(s) for s in fresh] == [expected[0::2], expected[1::2]]
    assert [len(s) for s in fresh] == [5, 5]


def test_a_packed_split_is_dealt_in_shard_order_a_shard_at_a_time_by_default():
    one = ShardSampler(41, 0, 1, shuffle=True, seed=3, shards=STARTS)
    one.set_epoch(2)
    assert list(one) == shard_order(STARTS, 3, 2, window=1).tolist()
    three = ShardSampler(41, 0, 1, shuffle=True, seed=3, shards=STARTS, window=3)
    three.set_epoch(2)
    assert list(three) == shard_order(STARTS, 3, 2, window=3).tolist()


def test_set_epoch_without_a_layout_lays_copies_out_for_this_samplers_global_batch():
    def items(**layout):
        s = ShardSampler(24, 0, 2, shuffle=True, batch_size=4, repeats=2, with_epoch=True)
        s.set_epoch(1, **layout)
        return list(s)

    assert items() == items(layout=8)
    assert items() != items(layout=2)


def test_a_global_batch_smaller_than_the_repeats_lays_each_images_copies_side_by_side():
    """q = floor(k*b/m) images per group, at least one: with k*b = 3 < 2m, q = 1."""
    rows = repeated(torch.arange(10, 16), repeats=3, chunk=3).tolist()
    assert rows == [[10, 0], [10, 1], [10, 2], [11, 0], [11, 1], [11, 2]]
