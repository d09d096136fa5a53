"""Every node of an elastic group names it alike (`run.rendezvous`), whatever its restart count: after a
lost node one survivor restarts on its worker's failure (count 1) and another as a membership change
(count 0); keyed by that count, the new group's workers waited for each other in two key spaces."""

from __future__ import annotations

import os
import threading

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

from ddp_cli.distributed.setup import WORKER_GROUP, group_prefix
from ddp_cli.run.rendezvous import BACKEND, NamedGroups, group_name, register


class Round:
    """torch's handler as each node sees one rendezvous round: its rank, in the round's store."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store, rank

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(self.store, self.rank, 2, RendezvousStoreInfo("127.0.0.1", 0))

    def num_nodes_waiting(self) -> int:
        return 0


def names(store: dist.Store) -> list[str]:
    """The group name each of two nodes of one round reads (node 1 asking before node 0 wrote it)."""
    got: dict[int, str] = {}
    late = threading.Thread(target=lambda: got.update({1: group_name(Round(store, 1).next_rendezvous())}))
    late.start()
    got[0] = group_name(Round(store, 0).next_rendezvous())
    late.join(10)
    return [got[0], got[1]]


def test_the_nodes_of_a_round_name_their_group_alike_and_each_round_afresh():
    first = names(dist.HashStore())
    again = names(dist.HashStore())  # the next round: a store scoped to it
    assert first[0] == first[1] and again[0] == again[1] and first[0] != again[0]


def test_the_launcher_hands_the_name_to_its_workers(monkeypatch):
    monkeypatch.delenv(WORKER_GROUP, raising=False)
    store = dist.HashStore()
    NamedGroups(Round(store, 0)).next_rendezvous()
    assert os.environ[WORKER_GROUP] == group_name(Round(store, 1).next_rendezvous())


def test_the_workers_key_space_follows_the_name_not_the_restart_count():
    failed = {WORKER_GROUP: "abc", "TORCHELASTIC_RESTART_COUNT": "1"}
    joined = {WORKER_GROUP: "abc", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert group_prefix(24, failed) == group_prefix(24, joined) == "ddp/group-abc"


def test_under_torchrun_it_is_the_restart_count_and_world_size():
    assert group_prefix(24, {"TORCHELASTIC_RESTART_COUNT": "2"}) == "ddp/attempt-2-24"


def test_the_wrapper_answers_as_its_own_backend_and_passes_the_rest_on():
    handler = NamedGroups(Round(dist.HashStore(), 0))
    assert handler.get_backend() == BACKEND and handler.num_nodes_waiting() == 0


def test_registering_twice_is_harmless():
    register()
    register()


def test_a_group_resumes_its_newest_checkpoint_where_any_rank_restarted(one_process_group, tmp_path,
                                                                        monkeypatch):
    """After a lost node, rank 0 may sit on a node whose restart count stayed 0 (a membership change):
    the group still resumes the newest checkpoint, because another rank's launcher restarted."""
    import torch
    import torch.distributed as dist

    from ddp_cli.distributed.setup import DistContext
    from ddp_cli.run import training
    from ddp_cli.run.jobs import Job
    from ddp_cli.train.checkpoint import CheckpointStore, RunState

    store = CheckpointStore(tmp_path / "checkpoints", keep_last=2)
    store.save({**RunState(step=4).state_dict(), "format": "ddp-checkpoint"}, {"epoch": 1, "step": 4},
               best=False)
    ctx = DistContext(0, 2, 0, 1, torch.device("cpu"), "gloo")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    for others, expected in ((1, "step-000000004.pt"), (0, None)):
        monkeypatch.setattr(dist, "all_gather_object",
                            lambda out, mine, n=others: out.__setitem__(slice(None), [mine, n]))
        chosen = training.resume_point(Job("train", True, resume="never"), tmp_path, ctx)
        assert (chosen.name if chosen else None) == expected
