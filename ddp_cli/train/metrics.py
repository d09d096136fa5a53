"""Validation totals summed across ranks: no averaging of averages, no padding."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class EvalTotals:
    """Running [loss sum, top-1 hits, top-5 hits, images] on the device."""

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    def add(self, logits: torch.Tensor, target: torch.Tensor, keep: torch.Tensor) -> None:
        logits, target = logits[keep].float(), target[keep]
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hits = top.eq(target[:, None])
        self.sums += torch.stack([
            F.cross_entropy(logits, target, reduction="sum").double(),
            hits[:, 0].sum().double(),
            hits.any(dim=1).sum().double(),
            torch.tensor(float(len(target)), dtype=torch.float64, device=logits.device),
        ])

    def reduce(self) -> dict[str, float]:
        if dist.is_initialized():
            dist.all_reduce(self.sums)
        loss, top1, top5, n = self.sums.tolist()
        n_safe = max(n, 1.0)
        return {"loss": loss / n_safe, "top1": top1 / n_safe, "top5": top5 / n_safe, "images": int(n)}
