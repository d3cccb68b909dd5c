"""apply_ac: activation recomputation per transformer block, as the plan says for this pipeline rank.

* "full": keep only each block's input and recompute the whole block in backward
  (Chen et al. 2016; Megatron's full recompute).
* "selective": recompute only the attention core, softmax(q·kᵀ)·v, whose activations grow with
  the square of the sequence while costing few FLOPs (Korthikanti et al. 2022, section 4.2):
  each block's `attention.core` module is checkpointed, everything else is kept.
* "none": keep everything.

Selective recompute checkpoints a module rather than running a selective-checkpoint policy over
the whole block: a policy is a Python call on every op of the forward and again of the recompute,
which on CPU processes made "selective" slower than "full" (measured on tiny-gpt, 2 gloo ranks:
+6.4 ms per layer and micro-batch against full's +3.7 ms); one checkpointed core costs one extra
forward of that core.

Always non-reentrant: reentrant checkpointing breaks under pipelining (and the other
ranks then hang), and it does not compose with DTensor/FSDP hooks.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper


def _checkpointed(module: nn.Module) -> nn.Module:
    # preserve_rng_state=False: the blocks have no dropout, and saving RNG state costs time
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)


def apply_ac(module: nn.Module, mode: str) -> None:
    """Wrap every block (full) or every block's attention core (selective) of a stage module in place.
    Full recompute's names gain `_checkpoint_wrapped_module.`, which torch.distributed.checkpoint's
    state-dict helpers strip again; the attention core has no parameters, so selective renames nothing."""
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"recompute mode {mode!r} is not one of none, selective, full")
    for name, block in list(module.layers.items()):
        if mode == "full":
            module.layers[name] = _checkpointed(block)
        else:
            block.attention.core = _checkpointed(block.attention.core)
