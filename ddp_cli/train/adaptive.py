"""FreeMatch's and SoftMatch's pseudo-label rules: FixMatch's fixed threshold replaced by one that follows
the model's own confidence, from running statistics of the weak views (as USB implements them,
microsoft/Semi-supervised-learning).

- FreeMatch (Wang et al. 2023): a global threshold tau, the EMA of the batches' mean top probability,
  modulated per class by p~, the EMA of the mean class probabilities (MaxNorm: p~ / max p~); an image
  counts where its top probability reaches tau x MaxNorm(p~)[its class]; plus the fairness term
  lambda_f x sum(SumNorm(p~ / h~) x log SumNorm(pbar_s / h_s)) over the strong views that count (h~: the
  EMA of the pseudo-labels' histogram; pbar_s, h_s: the strong views' mean probabilities and histogram).
  tau, p~ and h~ start at 1 / classes.
- SoftMatch (Chen et al. 2023): each image weighted by a truncated Gaussian of its top probability,
  exp(-(p - mu)^2 / (2 sigma^2 / n^2)) below mu, 1 above; mu and sigma^2 the EMAs of the batches' mean
  and (unbiased) variance of the top probability (start: 1 / classes and 1), after uniform distribution
  alignment: the weak view's probabilities times uniform / (the EMA of the model's mean prediction),
  renormalised. That EMA becomes the first batch's mean (as USB's) and aligns each batch by the
  batches before it (the first: not at all), so that one all-reduce per micro-step updates every
  statistic (USB aligns by an EMA that already holds the batch: a 1 - momentum share of difference).

Each micro-step's batch statistics are averaged over the ranks (every rank has the same count of
unlabelled images) in ONE all-reduce of a small float64 tensor on the device, then every statistic moves
by the same momentum: the statistics are the global batch's, identical on every rank, so a checkpoint
keeps them at any world size. Nothing here reads a tensor on the host except `signals` and
`state_dict`, at a record and a save.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddp_cli.config import SemiConfig


def mean_over_ranks(batch: torch.Tensor) -> torch.Tensor:
    """`batch` averaged over the ranks (itself in a one-process world or without a process group)."""
    if world_size() > 1:
        dist.all_reduce(batch)
        batch /= world_size()
    return batch


def histogram(labels: torch.Tensor, classes: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The (weighted) count of each class among `labels`, on their device without a host sync (bincount
    reads the largest label back to size its output)."""
    ones = torch.ones(len(labels), device=labels.device) if weight is None else weight.float()
    return torch.zeros(classes, device=labels.device).index_add_(0, labels, ones)


def inverse(values: torch.Tensor) -> torch.Tensor:
    """1 / values, 0 where a value is 0 (USB's nan_to_num of 1 / h)."""
    return torch.where(values > 0, 1 / values.clamp_min(torch.finfo(values.dtype).tiny), 0)


class Statistics:
    """A method's running statistics: ONE flat float64 tensor on the device, laid out by `layout`
    (name -> width, a width of 0 meaning one per class), made at the first batch (the class count is its
    width) from `initial` or from a checkpoint's lists, and moved toward each batch's by `momentum`."""

    layout: dict[str, int]

    def __init__(self, semi: SemiConfig) -> None:
        self.semi, self.momentum = semi, semi.stats_momentum
        self.flat: torch.Tensor | None = None
        self.saved: dict[str, list[float]] = {}  # a checkpoint's, until the first batch makes `flat`

    def initial(self, classes: int) -> dict[str, list[float]]:
        raise NotImplementedError

    def start(self, classes: int, device: torch.device) -> None:
        values = self.saved or self.initial(classes)
        # made on the host and copied without the host waiting (a tensor made on a GPU from a list blocks)
        flat = torch.tensor([v for name in self.layout for v in values[name]], dtype=torch.float64)
        self.flat = flat.to(device, non_blocking=True)

    def view(self, classes: int) -> dict[str, torch.Tensor]:
        """Each statistic, a view of the flat tensor (scalars as 0-d)."""
        out, at = {}, 0
        for name, width in self.layout.items():
            n = width or classes
            out[name] = self.flat[at:at + n] if not width else self.flat[at]
            at += n
        return out

    def update(self, batch: dict[str, torch.Tensor], classes: int) -> dict[str, torch.Tensor]:
        """The statistics moved toward this micro-batch's of every rank (`batch`, laid out alike)."""
        if self.flat is None:
            self.start(classes, next(iter(batch.values())).device)
        flat = mean_over_ranks(torch.cat([batch[name].double().reshape(-1) for name in self.layout]))
        self.flat.mul_(self.momentum).add_(flat, alpha=1 - self.momentum)
        return self.view(classes)

    def state_dict(self) -> dict[str, list[float]]:
        if self.flat is None:
            return dict(self.saved)
        values, out, at = self.flat.tolist(), {}, 0
        classes = (len(values) - sum(self.layout.values())) // sum(1 for w in self.layout.values() if not w)
        for name, width in self.layout.items():
            n = width or classes
            out[name], at = values[at:at + n], at + n
        return out

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.saved, self.flat = dict(state), None


class FreeMatch(Statistics):
    """FreeMatch's self-adaptive threshold, per-class modulation and fairness term (module docstring)."""

    layout = {"tau": 1, "p_model": 0, "label_hist": 0}

    def initial(self, classes: int) -> dict[str, list[float]]:
        uniform = [1 / classes] * classes
        return {"tau": [1 / classes], "p_model": uniform, "label_hist": uniform}

    def select(self, probs: torch.Tensor,
               strong: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        classes = probs.shape[1]
        confidence, pseudo = probs.max(dim=1)
        s = self.update({"tau": confidence.mean(), "p_model": probs.mean(dim=0),
                         "label_hist": histogram(pseudo, classes) / len(pseudo)}, classes)
        mask = (confidence >= s["tau"] * thresholds(s["p_model"])[pseudo]).float()
        weight = self.semi.fairness_weight
        fair = weight * fairness_loss(strong, mask, s["p_model"], s["label_hist"]) if weight else None
        return pseudo, mask, fair

    def signals(self) -> dict[str, Any]:
        """tau, and each class's threshold tau x MaxNorm(p~)."""
        if self.flat is None:
            return {}
        state = self.state_dict()
        top = max(state["p_model"])
        return {"freematch_tau": state["tau"][0],
                "class_thresholds": [state["tau"][0] * p / top for p in state["p_model"]]}


def thresholds(p_model: torch.Tensor) -> torch.Tensor:
    """FreeMatch's per-class modulation, MaxNorm(p~): each class's mean probability over the largest."""
    return p_model / p_model.max()


def fairness_loss(strong: torch.Tensor, mask: torch.Tensor, p_model: torch.Tensor,
                  label_hist: torch.Tensor) -> torch.Tensor:
    """FreeMatch's self-adaptive fairness term (USB's entropy_loss) over the strong views `mask` keeps,
    0 where it keeps none: no boolean indexing and no branch on the host."""
    probs = strong.float().softmax(dim=1)
    classes, kept = probs.shape[1], mask.sum()
    hist = histogram(probs.argmax(dim=1).detach(), classes, mask)
    hist = hist / kept.clamp_min(1)
    target = p_model.float() * inverse(label_hist.float())
    target = target / target.sum()
    mean = (probs * mask[:, None]).sum(dim=0) / kept.clamp_min(1) * inverse(hist)
    mean = mean / mean.sum().clamp_min(1e-12)
    return (target * torch.log(mean + 1e-12)).sum() * (kept > 0)


class SoftMatch(Statistics):
    """SoftMatch's truncated-Gaussian weights after uniform distribution alignment (module docstring)."""

    layout = {"mu": 1, "var": 1, "p_model": 0, "batches": 1}

    def initial(self, classes: int) -> dict[str, list[float]]:
        return {"mu": [1 / classes], "var": [1.0], "p_model": [1 / classes] * classes, "batches": [0.0]}

    def select(self, probs: torch.Tensor,
               strong: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        classes, count = probs.shape[1], len(probs) * world_size()
        if self.flat is None:
            self.start(classes, probs.device)
        old, m = self.view(classes), self.momentum
        mean = probs.double().mean(dim=0)
        aligned = align(probs, old["p_model"]) if self.semi.dist_align else probs
        confidence, pseudo = aligned.max(dim=1)
        top = confidence.double()
        # the mean and second moment of every rank's batch make the global batch's unbiased variance
        batch = mean_over_ranks(torch.cat([top.mean().view(1), (top ** 2).mean().view(1), mean]))
        var = (batch[1] - batch[0] ** 2) * count / max(count - 1, 1)
        p_model = torch.where(old["batches"] == 0, batch[2:], old["p_model"] * m + batch[2:] * (1 - m))
        self.flat.copy_(torch.cat([(old["mu"] * m + batch[0] * (1 - m)).view(1),
                                   (old["var"] * m + var * (1 - m)).view(1), p_model,
                                   (old["batches"] + 1).view(1)]))
        return pseudo, truncated_gaussian(top, self.flat[0], self.flat[1], self.semi.n_sigma).float(), None

    def signals(self) -> dict[str, Any]:
        """mu and sigma of the top probability (after alignment)."""
        if self.flat is None:
            return {}
        state = self.state_dict()
        return {"softmatch_mu": state["mu"][0], "softmatch_sigma": state["var"][0] ** 0.5}


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def align(probs: torch.Tensor, p_model: torch.Tensor) -> torch.Tensor:
    """Uniform distribution alignment (USB's DistAlignEMAHook, p_target uniform): each row times
    uniform / p_model, renormalised."""
    classes = probs.shape[1]
    aligned = probs * ((1 / classes + 1e-6) / (p_model.float() + 1e-6))
    return aligned / aligned.sum(dim=1, keepdim=True)


def truncated_gaussian(confidence: torch.Tensor, mu: torch.Tensor, var: torch.Tensor,
                       n_sigma: float) -> torch.Tensor:
    """SoftMatch's weight: 1 at or above mu, exp(-(p - mu)^2 / (2 var / n^2)) below."""
    return torch.exp(-(torch.clamp(confidence - mu, max=0.0) ** 2) / (2 * var / n_sigma ** 2))
