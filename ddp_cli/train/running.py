"""The epoch's running sums of a rank, named: the loss sum, the steps, and the objective's own sums.

They stay on the device as ONE flat float64 tensor, `[loss, steps, *objective]`, so
that a step adds to them without the host waiting for the device, every rank's are
summed in one all-reduce (`reduced`), and a checkpoint gathers them in one
all-gather (`gathered`): a rank's row of `RunState.running`, in that order. The
host reads them (`read`) only at a logging window and an epoch's end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_cli.distributed.setup import queued_copy

HEAD = ("loss", "steps")  # before the objective's sums, in the flat tensor and a checkpoint's rows


@dataclass(frozen=True)
class Sums:
    """Running sums read back to the host."""

    loss: float
    steps: float
    objective: list[float]  # in the order of the objective's `sums`


class RunningSums:
    """`names`: the objective's sums (its `sums`), after the loss sum and the step count."""

    def __init__(self, names: tuple[str, ...], device: torch.device,
                 flat: torch.Tensor | None = None) -> None:
        self.names = names
        self.flat = torch.zeros(len(HEAD) + len(names), dtype=torch.float64, device=device) \
            if flat is None else flat

    def __len__(self) -> int:
        return len(self.flat)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every sum's name, in the flat tensor's (and a checkpoint row's) order."""
        return (*HEAD, *self.names)

    @property
    def loss(self) -> torch.Tensor:
        return self.flat[0]

    @property
    def steps(self) -> torch.Tensor:
        return self.flat[1]

    @property
    def objective(self) -> torch.Tensor:
        return self.flat[len(HEAD):]

    def add(self, step: torch.Tensor) -> None:
        """A step's `(loss, *objective sums)` (as `Trainer.train_step` returns them), counted as one step:
        on the device, queued."""
        self.flat += torch.cat([step[:1], self.flat.new_ones(1), step[1:]])

    def mean_loss(self) -> torch.Tensor:
        """The loss per step so far, on the device (0 before any step)."""
        return self.loss / self.steps.clamp(min=1)

    def zero(self) -> None:
        self.flat.zero_()

    def restore(self, row: list[float]) -> None:
        """A rank's row as a checkpoint keeps it (`RunState.running_of`), copied without the host waiting."""
        self.flat.copy_(queued_copy(torch.tensor(row, dtype=torch.float64), self.flat.device))

    def clone(self) -> RunningSums:
        return RunningSums(self.names, self.flat.device, self.flat.clone())

    def __sub__(self, other: RunningSums) -> RunningSums:
        """What was added between `other` (earlier) and these."""
        return RunningSums(self.names, self.flat.device, self.flat - other.flat)

    def reduced(self) -> RunningSums:
        """Every rank's summed (a collective: every rank calls it)."""
        every = self.clone()
        dist.all_reduce(every.flat)
        return every

    def gathered(self, world_size: int) -> list[list[float]]:
        """Every rank's own, a row each in rank order: `RunState.running` (a collective, and a host read)."""
        everyone = [torch.empty_like(self.flat) for _ in range(world_size)]
        dist.all_gather(everyone, self.flat)
        return [rank.tolist() for rank in everyone]

    def read(self) -> Sums:
        """On the host (one read of the device)."""
        loss, steps, *objective = self.flat.tolist()
        return Sums(loss, steps, objective)
