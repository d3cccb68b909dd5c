"""apply_ac: activation recomputation per block, as the plan says for this pipeline rank.

* "full": keep only each block's input and recompute the whole block in backward (Chen et al. 2016;
  Megatron's full recompute).
* "selective": recompute only what the adapter names (ModelAdapter.selective): the attention core,
  softmax(q·kᵀ/√d)·v (Korthikanti et al. 2022, section 4.2), for plait's and Hugging Face's models.
* "none": keep everything.

Selective recompute checkpoints a module (or the attention function) rather than running a
selective-checkpoint policy over the whole block: a policy is a Python call on every op of the forward
and again of the recompute, which on CPU processes made "selective" slower than "full" (measured on
tiny-gpt, 2 gloo ranks: +6.4 ms per layer and micro-batch against full's +3.7 ms).

Always non-reentrant: reentrant checkpointing breaks under pipelining (and the other ranks then hang),
and it does not compose with DTensor/FSDP hooks.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from plait.plan import RECOMPUTE_MODES


def checkpointed(module: nn.Module) -> nn.Module:
    # preserve_rng_state=False: plait runs without dropout, and saving RNG state costs time
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)


def apply_ac(stage: nn.Module, mode: str) -> None:
    """Wrap every block (full) or what the adapter recomputes of each block (selective) of a Stage in place.
    Full recompute's names gain `_checkpoint_wrapped_module.`, which torch.distributed.checkpoint's
    state-dict helpers strip again."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    stage.recompute_mode, stage.selective_units = mode, 0
    if mode == "none":
        return
    blocks = stage.stage_blocks()
    for name, block in list(blocks.items()):
        if mode == "full":
            blocks[name] = checkpointed(block)
        else:
            stage.selective_units += stage.adapter.selective(block, checkpointed)
