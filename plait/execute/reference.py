"""The single-process truth a parallel run is compared with: the same model (its author's own forward), initial
weights, data and AdamW steps on one process, no parallelism at all."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from plait.execute.batches import batch_for_step
from plait.models import adapter_for, build_model
from plait.plan import Plan

BatchFn = Callable[[int], tuple]
"""step -> (tokens, targets) or (tokens, targets, positions or None), each [global_batch, seq_len]: the whole global
batch of that step (positions: of packed documents, plait.train.documents)."""


@dataclass
class ReferenceRun:
    losses: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """Final parameters (named_parameters: a tied output layer appears once, under the embedding's name)."""
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    first_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """Gradients of the first step, before clipping and the optimizer."""
    grad_norms: list[float] = field(default_factory=list)


def single_process_reference(plan: Plan, batches: BatchFn | None = None, steps: int = 3, seed: int = 0,
                             lr: float = 1e-3, *, max_norm: float | None = None, weight_decay: float = 0.0,
                             betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                             dtype: torch.dtype = torch.float32,
                             initial_state: dict[str, torch.Tensor] | None = None,
                             weights: str | None = None, optimizer: str = "adamw") -> ReferenceRun:
    """Train `plan.model` for `steps` AdamW (or `optimizer` "sgd") steps on one process over the plan's global batches. `batches`
    defaults to the random batches of `batch_for_step(plan, seed, step)`; with `max_norm`, gradients are
    clipped (their norms before clipping are recorded)."""
    batches = batches or (lambda step: batch_for_step(plan, seed, step))
    adapter = adapter_for(plan.model)
    if weights is not None:  # the author's own loader: what `from_pretrained` gives a user
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(weights, config=adapter.hf_config(), dtype=torch.float32)
        initial_state = None
        if plan.model.lora is not None:  # peft's way: adapters on the loaded base, started from the seed
            from plait.models.lora import apply_lora

            apply_lora(model, plan.model.lora, adapter.blocks_path)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if not param.requires_grad:
                        continue
                    param.copy_(adapter.initial_tensor(name, tuple(param.shape), seed))
    else:
        model = build_model(plan.model, device="cpu", seed=None if initial_state is not None else seed)
    if initial_state is not None:
        model.load_state_dict(initial_state, strict=False)
        adapter.reset_buffers(model)
    adapter.own_attention(model)  # the class's own attention and masks: what plait's kernels must equal
    model.to(dtype)
    trained = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "sgd":  # linear in the gradient: what DiLoCo at H = 1 equals (plait/train/islands_check.py)
        optimizer = torch.optim.SGD(trained, lr=lr, weight_decay=weight_decay)
    else:
        optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    run = ReferenceRun(initial={n: p.detach().clone() for n, p in model.named_parameters()})
    for step in range(steps):
        tokens, targets, *rest = batches(step)
        positions = rest[0] if rest else None
        logits = adapter.forward(model, tokens) if positions is None else adapter.forward(model, tokens, positions)
        loss = adapter.loss(logits, targets)
        loss.backward()
        if step == 0:
            run.first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        if max_norm is not None:
            run.grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        run.losses.append(loss.item())
    run.params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return run
