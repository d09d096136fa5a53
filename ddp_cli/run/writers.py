"""Who writes the job folder's files: one writer per copy of the folder.

The nodes of a run may share its run dir (NFS, Lustre) or each keep one on its own disk. What the
workers write there (checkpoints and their manifests, result.json; metrics and evaluation.json are
rank 0's anyway) needs one writer per copy: two nodes saving, linking and pruning the same checkpoint
files race each other (a hard link to a file the other just replaced or pruned, a manifest of the
other's file), while a node with a folder of its own needs its own copy to resume from. So global
rank 0 writes where a node sees rank 0's folder, and each node's first worker where it does not. A
path cannot tell which: rank 0 leaves a file of a name nobody could guess in its folder, and every
rank looks for it in its own. Rank logs and error records are per rank (`logs/rank<N>.*`,
`errors/rank<N>.json`): each rank writes its own wherever the folder is.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import torch.distributed as dist

from ddp_cli.distributed.setup import DistContext
from ddp_cli.io import write_text

PROBE = ".ddp-folder-{}"  # rank 0's mark, named by a fresh token


def writes_folder(folder: Path, ctx: DistContext) -> bool:
    """Whether this rank writes the files of the job folder (a collective: every rank calls it)."""
    return writer(ctx, sees_rank0s_folder(folder, ctx))


def writer(ctx: DistContext, shared: bool) -> bool:
    """Rank 0, and each node's first worker where its folder is not rank 0's."""
    return ctx.is_main or (ctx.local_rank == 0 and not shared)


def sees_rank0s_folder(folder: Path, ctx: DistContext) -> bool:
    """Whether `folder` here is the very folder rank 0 sees (a collective); the mark is gone after."""
    token = [uuid.uuid4().hex if ctx.is_main else None]
    if ctx.is_main:
        write_text(folder / PROBE.format(token[0]), "")
    dist.broadcast_object_list(token, src=0)
    mark = folder / PROBE.format(token[0])
    shared = mark.exists()  # a name never looked up before: no file system's cache can answer for it
    dist.barrier()  # every rank has looked
    if ctx.is_main:
        mark.unlink()
    return shared
