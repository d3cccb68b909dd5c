"""The single-process truth a parallel run is compared with: the same model, initial weights,
data and AdamW steps on one process, no parallelism at all."""

from __future__ import annotations

from typing import Callable

import torch

from plait.execute.batches import batch_for_step
from plait.execute.parallelize import cross_entropy
from plait.models import build_model
from plait.plan import Plan

BatchFn = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""step -> (tokens, targets), each [global_batch, seq_len]: the whole global batch of that step."""


def single_process_reference(plan: Plan, batches: BatchFn | None = None, steps: int = 3, seed: int = 0,
                             lr: float = 1e-3, *, max_norm: float | None = None, weight_decay: float = 0.0,
                             betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                             grad_norms: list[float] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train `plan.model` for `steps` AdamW steps on one process over the plan's global batches;
    returns the per-step losses (mean token cross-entropy over the global batch) and the final
    parameters. `batches` defaults to the random batches of `batch_for_step(plan, seed, step)`.
    With `max_norm`, gradients are clipped, and their norms before clipping are appended to
    `grad_norms` when given."""
    batches = batches or (lambda step: batch_for_step(plan, seed, step))
    model = build_model(plan.model, device="cpu", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    losses = []
    for step in range(steps):
        tokens, targets = batches(step)
        loss = cross_entropy(model(tokens), targets)
        loss.backward()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if grad_norms is not None:
                grad_norms.append(norm.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}
