"""apply_ac: activation recomputation per transformer block, as the plan says for this pipeline rank.

* "full": keep only each block's input and recompute the whole block in backward
  (Chen et al. 2016; Megatron's full recompute).
* "selective": keep the outputs of the matrix multiplications (and collectives) and
  recompute the cheap, memory-hungry rest -- attention's softmax core, norms, activations.
  This is Korthikanti et al.'s selective recompute, written as a PyTorch
  selective-checkpoint policy.
* "none": keep everything.

Always non-reentrant: reentrant checkpointing breaks under pipelining (and the other
ranks then hang), and it does not compose with DTensor/FSDP hooks.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _saved_ops() -> set:
    """Ops whose outputs selective recompute keeps: matmuls, and collectives (re-running a
    collective in backward would cost communication and must not diverge between ranks)."""
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    functional = getattr(torch.ops, "_c10d_functional", None)
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
        if functional is not None and hasattr(functional, name):
            ops.add(getattr(functional, name).default)
    return ops


def _policy(saved: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(partial(_policy, _saved_ops()))


def apply_ac(module: nn.Module, mode: str) -> None:
    """Wrap every block of a stage module in place (names gain `_checkpoint_wrapped_module.`,
    which torch.distributed.checkpoint's state-dict helpers strip again)."""
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"recompute mode {mode!r} is not one of none, selective, full")
    extra = {"context_fn": _selective_context} if mode == "selective" else {}
    for name, block in list(module.layers.items()):
        # preserve_rng_state=False: the blocks have no dropout, and saving RNG state costs time
        module.layers[name] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                 preserve_rng_state=False, **extra)
