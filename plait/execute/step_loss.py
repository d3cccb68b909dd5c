"""The loss of a training step, under any plan: the mean of the per-token losses over the step's trained tokens.

A step trains on the targets of every micro-batch of every data-parallel and context-parallel rank; some are not
trained (chat mode's prompts, `IGNORE_INDEX`), so two micro-batches may hold different numbers of trained tokens.
The step's loss is

    sum of the per-token losses over the step's trained tokens / the number of those tokens

as Hugging Face's Trainer (``num_items_in_batch``) and torchtitan compute it, and as one process computes it on the
whole batch (plait.execute.reference). It does not depend on how the batch is cut: a mean of per-micro-batch means
would weigh a token of a micro-batch holding few trained tokens more than one of a full micro-batch, and so change
the gradient with the plan; a window without a trained token would add a zero to the mean.

Each piece of the batch (a micro-batch on one rank) contributes its loss *sum* times ``ranks / N``: N is the step's
trained tokens over all ranks (one all-reduce of a count, before the forward), ``ranks`` the data x context ranks
whose gradients are averaged (DDP, fully_shard and plait's own replicated reductions divide by them). The gradient
accumulated over the micro-batches and averaged over the ranks is then the gradient of the step's token mean;
pipeline schedules run with ``scale_grads=False`` (the scale is in the loss already).

`StepLoss` is the one owner of this rule: the decoder executor (plait.execute.parallelize) calls it for every
micro-batch, its forward-only evaluation too, and any other loop can (`start`, then call it per piece).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from plait.models.adapter import IGNORE_INDEX

LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits, targets) -> the sum of the per-token losses of the trained targets (ModelAdapter.loss_sum)."""


def trained_tokens(targets: torch.Tensor) -> torch.Tensor:
    """How many of `targets` are trained (not IGNORE_INDEX), as a 0-d int64 tensor on their device."""
    return (targets != IGNORE_INDEX).sum()


def step_trained_tokens(targets: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """The trained tokens of the whole step: this rank's `targets` (all its micro-batches) summed over `group`, the
    ranks holding the other rows and sequence slices (None: this rank holds the whole step)."""
    count = trained_tokens(targets).to(torch.float64).reshape(1)  # float64: gloo and NCCL both reduce it
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return int(count.item())


class StepLoss:
    """The criterion of one step's pieces: `loss_sum(logits, targets) * ranks / N` (see the module docstring).

    `start(targets, group, ranks)` before a step's first forward; then each call returns a piece's share, whose
    backward accumulates the piece's share of the step's gradient, and `value(shares)` the step's loss from the
    sum of the shares of every piece on every rank."""

    def __init__(self, loss_sum: LossSum) -> None:
        self.loss_sum = loss_sum
        self.tokens = 0
        self.ranks = 1

    def start(self, targets: torch.Tensor, group: dist.ProcessGroup | None = None, ranks: int = 1) -> int:
        """Count the step's trained tokens (collective over `group`); `ranks`: how many ranks' gradients the data-
        parallel reduction averages. Returns the count."""
        self.tokens = step_trained_tokens(targets, group)
        self.ranks = ranks
        return self.tokens

    @property
    def scale(self) -> float:
        """What a piece's loss sum is multiplied by; a step without a trained token weighs nothing (0 / 1)."""
        return self.ranks / max(self.tokens, 1)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_sum(logits, targets) * self.scale

    def value(self, summed_shares: float) -> float:
        """The step's loss from the sum of every piece's share over every rank (each carried `ranks` times)."""
        return summed_shares / self.ranks
