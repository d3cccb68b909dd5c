"""apply_ac: activation recomputation per block, as the plan says for this pipeline rank.

* "full": keep only each block's input and recompute the whole block in backward (Chen et al. 2016;
  Megatron's full recompute).
* "selective": recompute what is cheap to recompute and costly to keep, which depends on the attention
  path (ModelSpec.attention):
  - "math" (the unfused core keeps its s x s probabilities): checkpoint the attention core,
    softmax(q·kᵀ)·v, and nothing else (Korthikanti et al. 2022, section 4.2; Megatron's selective
    recompute). The adapter names the core (ModelAdapter.selective).
  - "fused" (SDPA's kernels keep no s x s matrix, so the core costs nothing to keep): torchtitan's per-op
    selective checkpointing of the whole block (torchtitan/models/llama3/infra/parallelize.py,
    `_apply_ac_to_transformer_block`, op mode): the outputs of the fused attention kernel, of every
    second GEMM of the block's forward (the 1st, 3rd, ...) and of reduce-scatters / all-reduces are
    saved, everything else (norms, activation functions, rotary embeddings, the other GEMMs, all-gathers)
    is recomputed. plait.cost.compute prices exactly this policy (`saved_tensors`).
* "none": keep everything.

The fused policy runs a Python decision per op of the forward and of the recompute; on CPU processes that is
host time the cost model's layer-pass host term covers only roughly (measured on tiny-gpt, 2 gloo ranks,
before fused attention: a per-op policy cost +6.4 ms per layer and micro-batch against full's +3.7 ms). On
GPUs it hides under the kernels, which is where it is meant to save memory.

Always non-reentrant: reentrant checkpointing breaks under pipelining (and the other ranks then hang),
and it does not compose with DTensor/FSDP hooks.
"""

from __future__ import annotations

from torch import nn
from plait.torch_internals import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from plait.models.saved_bytes import SELECTIVE_ALWAYS_SAVED, SELECTIVE_GEMMS
from plait.plan import RECOMPUTE_MODES


# the policy's ops live with the measurement that prices them (plait.models.saved_bytes: one rule, one place)
GEMMS = SELECTIVE_GEMMS
"""The GEMMs of a block's linear layers (biased ones are addmm); every second one's output is saved."""
ALWAYS_SAVED = SELECTIVE_ALWAYS_SAVED
"""Fused attention kernels (their output and logsumexp: the scores are never materialized, so rerunning the
kernel would cost its whole forward) and the collectives whose rerun would communicate again."""


def selective_policy():
    """torchtitan's op policy with the GEMM count restarted on every pass, so that the same GEMMs are saved in
    every micro-batch and the recompute makes the same choices as the forward."""
    counts = {False: 0, True: 0}  # GEMMs seen in the forward / in the recompute of this pass

    def policy(ctx, op, *args, **kwargs):
        if op in GEMMS:
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in ALWAYS_SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_contexts():
    # called once per checkpointed forward: a fresh count per pass
    return create_selective_checkpoint_contexts(selective_policy())


def checkpointed(module: nn.Module, context_fn=None, random: bool = False) -> nn.Module:
    # preserve_rng_state=False: plait runs without dropout, and saving RNG state costs time; `random`: LoRA's adapter
    # dropout, whose recompute must draw the forward's masks
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=random, **kwargs)


def apply_ac(stage: nn.Module, mode: str) -> None:
    """Wrap every block (full, and selective on the fused path) or what the adapter recomputes of each block
    (selective on the math path) of a Stage in place. A wrapped block's names gain `_checkpoint_wrapped_module.`,
    which torch.distributed.checkpoint's state-dict helpers strip again."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    stage.recompute_mode, stage.selective_units = mode, 0
    if mode == "none":
        return
    blocks = stage.stage_blocks()
    fused = stage.adapter.spec.attention == "fused"
    lora = stage.adapter.spec.lora
    random = lora is not None and lora.dropout > 0
    for name, block in list(blocks.items()):
        if mode == "full":
            blocks[name] = checkpointed(block, random=random)
        elif fused:
            blocks[name] = checkpointed(block, _selective_contexts, random=random)
            stage.selective_units += 1
        else:
            stage.selective_units += stage.adapter.selective(block, checkpointed)
