"""One writer per copy of the run dir: global rank 0 where the nodes share it (NFS, Lustre), each
node's first worker where a node has its own. Two ranks of different nodes played by two threads."""

from __future__ import annotations

import threading

import pytest
import torch

from ddp_cli.distributed.setup import DistContext
from ddp_cli.run import writers


class TwoRanks:
    """torch.distributed's broadcast and barrier, for two threads of one process."""

    def __init__(self) -> None:
        self.sync, self.sent = threading.Barrier(2, timeout=10), []

    def broadcast_object_list(self, objects: list, src: int) -> None:
        if objects[0] is not None:
            self.sent.append(objects[0])
        self.sync.wait()
        objects[0] = self.sent[0]

    def barrier(self) -> None:
        self.sync.wait()


def ctx(rank: int, local_rank: int) -> DistContext:
    return DistContext(rank, 4, local_rank, 2, torch.device("cpu"), "gloo")


@pytest.mark.parametrize("shared", [True, False])
def test_a_node_sees_whether_its_run_dir_is_rank_0s(tmp_path, monkeypatch, shared):
    monkeypatch.setattr(writers, "dist", TwoRanks())
    node0, node1 = tmp_path / "node0", tmp_path / ("node0" if shared else "node1")
    node0.mkdir(), node1.mkdir(exist_ok=True)
    seen = {}

    def look(rank, folder):
        seen[rank] = writers.sees_rank0s_folder(folder, ctx(rank, 0))

    threads = [threading.Thread(target=look, args=(0, node0)), threading.Thread(target=look, args=(2, node1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert seen == {0: True, 2: shared}
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "rank 0's mark is left behind"


@pytest.mark.parametrize(("rank", "local_rank", "shared", "writes"), [
    (0, 0, True, True),
    (2, 0, True, False),  # node 1's first worker, on rank 0's run dir: rank 0 writes it
    (2, 0, False, True),  # ... on a run dir of its own: it keeps its own copy
    (3, 1, False, False),
    (1, 1, True, False),
])
def test_rank_0_writes_a_shared_run_dir_and_each_node_a_run_dir_of_its_own(rank, local_rank, shared, writes):
    assert writers.writer(ctx(rank, local_rank), shared) is writes
