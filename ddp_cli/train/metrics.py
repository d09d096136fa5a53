"""Validation totals summed across ranks: no averaging of averages, no padding.

Besides the loss and the top-k hits, the confusion matrix (true class x top-1
class) is kept: per-class accuracy is its diagonal over its row sums, so every
number `validate --per-class` prints comes from integer counts summed over
ranks, exact at any world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

DEFAULT_TOPK = (1, 5)  # always reported: the contract's top1 and top5


class EvalTotals:
    """Running loss sum, images, hits at each k and the confusion matrix, on the device.

    `keep_topk` > 0 also keeps, per image, its split position and its `keep_topk`
    best classes with their probabilities (`kept`, on rank 0 after `reduce`), for a predictions file.
    Nothing is read back to the host before `reduce`: each read would make the host wait for the
    device, batch after batch; so a bad file's stand-in is weighed 0, not masked out (a boolean mask
    is a read: its output size depends on the data).
    """

    def __init__(self, device: torch.device, topk: tuple[int, ...] = DEFAULT_TOPK,
                 keep_topk: int = 0) -> None:
        self.device, self.ks = device, tuple(sorted(set(DEFAULT_TOPK) | set(topk)))
        self.sums = torch.zeros(2 + len(self.ks), dtype=torch.float64, device=device)  # loss, n, hits
        self.confusion: torch.Tensor | None = None  # allocated at the first batch: classes x classes
        self.keep_topk, self.kept = keep_topk, []
        self.positions: list[int] = []  # keep_topk: each image's split position (on the host)
        self.rows: list[torch.Tensor] = []  # and on the device: counted (1/0), label, top-k classes, probs
        self.metrics: dict[str, float] = {}  # set by reduce()

    def add(self, logits: torch.Tensor, target: torch.Tensor, keep: torch.Tensor | None = None,
            positions: list[int] | None = None) -> None:
        """A batch: `keep` False for a bad file's stand-in (None: every image counts)."""
        logits, classes = logits.float(), logits.shape[1]
        keep = torch.ones_like(target, dtype=torch.bool) if keep is None else keep
        top = logits.topk(min(max(self.ks), classes), dim=1).indices
        hits = top.eq(target[:, None]).cumsum(dim=1).clamp(max=1) * keep[:, None]  # j: within the first j+1
        losses = F.cross_entropy(logits, target, reduction="none").double()
        self.sums += torch.stack([
            losses.where(keep, 0).sum(),
            keep.sum(dtype=torch.float64),
            *(hits[:, min(k, classes) - 1].sum(dtype=torch.float64) for k in self.ks),
        ])
        if self.confusion is None:
            self.confusion = torch.zeros(classes, classes, dtype=torch.int64, device=self.device)
        self.confusion.index_put_((target, top[:, 0]), keep.long(), accumulate=True)
        if self.keep_topk:
            self.keep(logits, target, keep, positions)

    def keep(self, logits: torch.Tensor, target: torch.Tensor, keep: torch.Tensor,
             positions: list[int] | None) -> None:
        if len(positions or []) != len(target):
            raise ValueError(f"kept predictions: {len(positions or [])} positions do not zip with "
                             f"{len(target)} images")
        probs, classes = logits.softmax(dim=1).topk(min(self.keep_topk, logits.shape[1]), dim=1)
        self.positions += positions
        columns = (keep[:, None], target[:, None], classes, probs)
        self.rows.append(torch.cat([column.double() for column in columns], dim=1))

    def kept_rows(self) -> list[tuple[int, int, list[int], list[float]]]:
        """The kept predictions of the counted images, (position, label, classes, probabilities): read
        back to the host in one piece."""
        rows = torch.cat(self.rows).tolist() if self.rows else []
        k = (len(rows[0]) - 2) // 2 if rows else 0
        return [(position, int(row[1]), [int(c) for c in row[2:2 + k]], row[2 + k:])
                for position, row in zip(self.positions, rows, strict=True) if row[0]]

    def reduce(self) -> dict[str, float]:
        """Sum over ranks (every rank calls it); the metrics. A rank that saw no image (a val split
        smaller than the world) learns the class count from the others."""
        if self.confusion is None:
            self.confusion = torch.zeros(0, 0, dtype=torch.int64, device=self.device)
        self.kept = self.kept_rows() if self.keep_topk else []
        if dist.is_initialized():
            dist.all_reduce(self.sums)
            size = torch.full((), self.confusion.shape[0], dtype=torch.int64, device=self.device)
            dist.all_reduce(size, op=dist.ReduceOp.MAX)
            classes = int(size.item())
            if self.confusion.shape[0] < classes:
                self.confusion = torch.zeros(classes, classes, dtype=torch.int64, device=self.device)
            dist.all_reduce(self.confusion)
            if self.keep_topk:  # only rank 0 writes them: gathered there, not to every rank
                everyone: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
                dist.gather_object(self.kept, everyone, dst=0)
                self.kept = sorted(row for rank in everyone for row in rank) if everyone else []
        loss, n, *hits = self.sums.tolist()
        n_safe = max(n, 1.0)
        at_k = {f"top{k}": h / n_safe for k, h in zip(self.ks, hits, strict=True)}
        self.metrics = {"loss": loss / n_safe, **at_k, "images": int(n)}
        return self.metrics

    def per_class(self, classes: list[str], descriptions: list[str]) -> list[dict[str, Any]]:
        """Each class's images and top-1, in class order (from the reduced confusion matrix)."""
        counts = self.confusion.sum(dim=1).tolist()
        right = self.confusion.diagonal().tolist()
        return [{"index": i, "synset": synset, "description": text, "images": n,
                 "top1": right[i] / n if n else None}
                for i, (synset, text, n) in enumerate(zip(classes, descriptions, counts, strict=True))]
