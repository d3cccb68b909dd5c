"""Peak memory per device, by part, for every pipeline rank, as plait's executor holds it.

The peak of a step is the largest of a few moments, each linear in the number of blocks a rank holds
(``fixed + layers * per_layer``, which the stage-split search relies on):

* "loss": the start of the backward pass of the youngest micro-batch: every in-flight micro-batch's saved
  activations (plait.cost.activations), the head's, and the loss's gradient temporaries (last rank);
* "recompute": the backward of a block, which rematerializes what its recompute mode dropped and holds
  that block's gradient temporaries;
* "gradients": where gradients are created afresh in the step's only backward (one micro-batch, no
  pipeline, data parallelism on DDP or none), its end: every gradient, one block's activations.

Parts, named as PyTorch's memory tracker names them (benchmarks/memory_accuracy.py compares them):

* params, optimizer, grads: what the data-parallel carrier keeps (plait.legality.data_parallel_mode,
  read through Layout.dp_mode): DDP (and one replica) keeps fp32 parameters (16-bit runs autocast over
  them), fp32 gradients and AdamW's two fp32 moments, the moments sharded by ZeroRedundancyOptimizer
  under ZeRO-1; fully_shard keeps fp32 shards of the parameters, the moments and the gradients, plus the
  gathered compute-dtype parameters of every unit where they are not resharded after forward, or of the
  root and one block where they are (ZeRO-3). Gradients persist through a step of several micro-batches
  (accumulated; fully_shard accumulates them unsharded, in fp32, until the last micro-batch);
* activations: per block per micro-batch in flight (GPipe m; 1F1B min(m, p - r); interleaved Megatron's
  warm-up count), the embedding's token ids and the head's saved tensors;
* temporaries: the loss's gradients, a block's backward, fully_shard's all-gather and reduce-scatter
  buffers of one unit;
* buffers: DDP's gradient buckets (as large as the gradients), torch.distributed.pipelining's receive
  buffers (one per micro-batch and direction per virtual stage) and the stage outputs it keeps until
  their backward;
* reserve: the caching allocator's fragmentation and the runtime's context (RESERVE_FRACTION).

`model_state_bytes` keeps the ZeRO paper's accounting (2Ψ + 2Ψ + KΨ, Rajbhandari et al. 2020, section 5)
for the published check; the planner prices the executor's (`state_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from plait.cost.activations import (FP32_BYTES, INDEX_BYTES, Dtypes, activation_bytes, head_saved_bytes,
                                    layer_backward_bytes, loss_backward_bytes, probabilities_bytes,
                                    stage_input_is_kept)
from plait.cost.layout import Layout, Setting
from plait.cost.schedule import V_SCHEDULES, rank_actions
from plait.spec.model import ModelSpec
from plait.spec.train import TrainSpec

RESERVE_FRACTION = 0.05
"""Share of device memory kept back for the caching allocator's fragmentation and the runtime context: an
assumption (PyTorch's allocator rounds blocks up and keeps freed segments), neither fitted nor measured here --
a tensor count (benchmarks/memory_accuracy.py) cannot see it. With it the torchtitan H100 96GB rows come out 10%
and 6% under their published maximum reserved memory."""
ADAM_STATE_BYTES = 8
"""AdamW's exp_avg and exp_avg_sq per parameter: fp32, the dtype of the parameters the optimizer steps
(DDP's fp32 parameters, fully_shard's fp32 shards)."""
PART_NAMES = ("params", "grads", "optimizer", "activations", "temporaries", "buffers", "reserve")


@lru_cache(maxsize=4096)
def layer_params(model: ModelSpec, tp: int) -> float:
    """Parameters of one layer on one device: weights split by tp, the two norms replicated."""
    norms = 2 * model.norm_params
    return (model.params_per_layer - norms) / tp + norms


def first_stage_params(model: ModelSpec, tp: int) -> float:
    """Vocabulary-parallel token embedding (+ replicated position table for gpt)."""
    positions = model.embedding_params - model.vocab_size * model.hidden_size
    return model.vocab_size * model.hidden_size / tp + positions


def last_stage_params(model: ModelSpec, tp: int, shares_embedding_rank: bool) -> float:
    """Final norm + output layer; a tied output layer on another rank keeps its own copy (Megatron)."""
    out = model.vocab_size * model.hidden_size / tp
    if model.tied_embeddings and shares_embedding_rank:
        out = 0.0
    return model.norm_params + out


def model_state_bytes(num_params: float, dp: int, zero: int, train: TrainSpec) -> dict[str, float]:
    """The ZeRO paper's model states per device: 16-bit params and grads, K bytes of optimizer state per parameter
    (the published check; the planner uses `state_bytes`)."""
    p, g, k = train.param_bytes, train.param_bytes, train.optimizer_bytes
    return {
        "params": num_params * p / (dp if zero >= 3 else 1),
        "grads": num_params * g / (dp if zero >= 2 else 1),
        "optimizer": num_params * k / (dp if zero >= 1 else 1),
    }


def plan_dtypes(setting: Setting, layout: Layout) -> Dtypes:
    """The compute dtype, and the residual stream's: fp32 where 16-bit runs autocast over fp32 parameters (DDP,
    one replica), the compute dtype under fully_shard's mixed precision."""
    c = setting.dtype_bytes
    return Dtypes(compute=c, residual=FP32_BYTES if layout.dp_mode.carrier in ("none", "ddp") else c)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of this rank (already divided by tp) that the carrier holds through the step."""

    params: float
    optimizer: float
    buckets: float
    """DDP's gradient buckets."""
    accumulated_grads: float
    """Gradients held between micro-batches (DDP's fp32 .grad; fully_shard's unsharded fp32 accumulation)."""
    step_grads: float
    """Gradients at the optimizer step (fully_shard's fp32 shards)."""
    gathered_units: bool
    """fully_shard gathers one unit at a time (ZeRO-3): the root and one block are held, not every block."""


def optimizer_shards(layout: Layout) -> int:
    """Ranks the optimizer states are sharded over: every data-parallel rank on fully_shard (its parameters are
    shards), under ZeroRedundancyOptimizer (ZeRO-1 on DDP); none on DDP or one replica."""
    mode = layout.dp_mode
    return layout.dp if mode.carrier == "fully_shard" or (mode.carrier == "ddp" and layout.zero == 1) else 1


def state_bytes(setting: Setting, layout: Layout) -> StateBytes:
    mode, d, c = layout.dp_mode, layout.dp, setting.dtype_bytes
    if mode.carrier == "fully_shard":
        gathered = 0.0 if mode.reshard_after_forward else c
        return StateBytes(params=FP32_BYTES / d + gathered, optimizer=ADAM_STATE_BYTES / optimizer_shards(layout),
                          buckets=0.0,
                          accumulated_grads=FP32_BYTES, step_grads=FP32_BYTES / d,
                          gathered_units=mode.reshard_after_forward)
    return StateBytes(params=FP32_BYTES, optimizer=ADAM_STATE_BYTES / optimizer_shards(layout),
                      buckets=FP32_BYTES if mode.carrier == "ddp" else 0.0, accumulated_grads=FP32_BYTES,
                      step_grads=FP32_BYTES, gathered_units=False)


def in_flight(layout: Layout, rank: int) -> float:
    """Micro-batches of activations rank `rank` holds at its peak, per layer it owns."""
    p, m, v = layout.pp, layout.num_micro_batches, layout.interleave
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved":
        # Megatron's warm-up: 2(p - r - 1) + (v - 1)p forward chunks before the first backward, then one more.
        chunks = min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1)
        return chunks / v
    if layout.schedule in V_SCHEDULES:
        return live_peak(layout.schedule, p, m, v, rank) / v
    return float(min(m, p - rank))


@lru_cache(maxsize=1024)
def live_peak(schedule: str, pp: int, m: int, v: int, rank: int) -> int:
    """Most (stage, micro-batch) activations rank `rank` holds at once in the schedule's own order: a forward keeps
    them, the backward (its weight-gradient half, where the backward is split) frees them."""
    live = peak = 0
    for kind, _, _ in rank_actions(schedule, pp, m, v)[rank]:
        if kind == "F":
            live += 1
            peak = max(peak, live)
        elif kind in ("B", "W"):
            live -= 1
    return peak


@dataclass(frozen=True)
class Line:
    """One moment's memory as ``fixed + layers * per_layer``, by part; `per_layer["activations"]` scales with the
    activation load, the rest with the parameter load (plait.cost.compute.block_loads)."""

    fixed: dict[str, float]
    per_layer: dict[str, float]

    def parts(self, layers: float, activation_layers: float) -> dict[str, float]:
        return {k: self.fixed.get(k, 0.0) + (activation_layers if k == "activations" else layers)
                * self.per_layer.get(k, 0.0) for k in PART_NAMES}


@dataclass(frozen=True)
class RankMemory:
    """Memory of one pipeline rank: the largest of its moments (`lines`)."""

    lines: tuple[Line, ...]

    def parts(self, layers: float, activation_layers: float | None = None) -> dict[str, float]:
        """`layers` blocks' worth of parameters (and `activation_layers` of activations, where blocks differ:
        plait.cost.compute.block_loads), at the rank's peak moment."""
        acts = layers if activation_layers is None else activation_layers
        return max((line.parts(layers, acts) for line in self.lines), key=lambda parts: sum(parts.values()))

    def total(self, layers: float, activation_layers: float | None = None) -> float:
        return sum(self.parts(layers, activation_layers).values())

    def coefficients(self, layers: float) -> tuple[float, float, float]:
        """(fixed, per-layer model states, per-layer activations) bytes of the moment that is the peak at `layers`
        blocks: the search's memory table, exact at the even share of blocks it is taken at (the plans it keeps
        are priced again exactly)."""
        line = max(self.lines, key=lambda x: sum(x.parts(layers, layers).values()))
        states = sum(v for k, v in line.per_layer.items() if k != "activations")
        return sum(line.fixed.values()), states, line.per_layer.get("activations", 0.0)


def rank_memory(setting: Setting, layout: Layout, rank: int, mode: str) -> RankMemory:
    """Memory of pipeline rank `rank` running recompute `mode` on all its blocks: its moments (module docstring)."""
    model, tp, sp, b, s = setting.model, layout.tp, layout.sp, layout.micro_batch, setting.seq_len
    dtypes, states = plan_dtypes(setting, layout), state_bytes(setting, layout)
    chunks = layout.stages_of(rank)
    first, last = 0 in chunks, layout.num_stages - 1 in chunks
    tokens, flight, m = b * s, in_flight(layout, rank), layout.num_micro_batches
    # the rank's largest in-flight count recurs after its first backward (a steady state), so earlier micro-batches'
    # gradients are there; not where every forward comes first (GPipe, one micro-batch, a short 1F1B)
    steady = flight < m
    head_params = last_stage_params(model, tp, shares_embedding_rank=first) if last else 0.0
    ends = (first_stage_params(model, tp) if first else 0.0) + head_params
    n_layer, c = layer_params(model, tp), setting.dtype_bytes
    act = {x: activation_bytes(model, b, s, tp, sp, x, dtypes) for x in ("none", mode)}

    held = {"params": states.params, "optimizer": states.optimizer, "buffers": states.buckets}
    base = {k: v * ends for k, v in held.items()}
    per_layer = {k: v * n_layer for k, v in held.items()}
    gather = scatter = 0.0
    if states.gathered_units:  # ZeRO-3: the root unit and one block gathered, the next one's gather in flight
        base["params"] += c * (ends + n_layer)
        gather, scatter = c * n_layer, FP32_BYTES * n_layer  # the next block's all-gather; a reduce-scatter's input
    base["buffers"] += _pipeline_buffers(setting, layout, chunks, flight, mode, dtypes)
    head = head_saved_bytes(model, tokens, tp, sp, dtypes) if last else 0.0
    ids = tokens * INDEX_BYTES if first else 0.0  # the embedding keeps the token ids
    base["reserve"] = RESERVE_FRACTION * setting.cluster.memory_bytes
    # a block's backward: the youngest micro-batch's head is done, the block rematerializes what its mode dropped
    # (and on the math path swaps its probabilities for their two gradients)
    backward = (gather + scatter + act["none"] - act[mode]
                + layer_backward_bytes(model, s, tokens, tp, sp, dtypes))
    released = head + probabilities_bytes(model, s, tokens, tp, dtypes)

    def line(micro_batches: float, grads: float, grads_fixed: float, acts_fixed: float, temporaries: float) -> Line:
        fixed = {**base, "activations": micro_batches * (ids + head) + acts_fixed, "grads": grads * ends + grads_fixed,
                 "temporaries": temporaries}
        return Line(fixed, {**per_layer, "activations": micro_batches * act[mode], "grads": grads * n_layer})

    accumulated = states.accumulated_grads if steady else 0.0
    loss = loss_backward_bytes(model, tokens, tp) if last else 0.0
    lines = [line(flight, accumulated, 0.0, 0.0, gather + loss),                                   # the loss
             line(flight, accumulated, 0.0 if steady else states.step_grads * head_params, -released, backward),
             line(0.0, states.step_grads, 0.0, 0.0, 0.0)]                                         # the optimizer step
    if m > 1 and not steady:  # the last micro-batch's backward: every micro-batch's gradients, its own activations
        # (GPipe waits on its gradient sends when the step ends: the m - 1 sent before stay held)
        sent = (m - 1) * _stage_hidden_bytes(setting, layout, dtypes) if layout.pp > 1 and not first else 0.0
        lines.append(line(1.0, states.accumulated_grads, 0.0, -released, backward + sent))
    if m == 1:  # the backward of the first block: every gradient but its own and the embedding's; one block's acts
        lines.append(Line({**base, "activations": ids + act[mode], "temporaries": backward,
                           "grads": states.step_grads * (head_params - n_layer)},
                          {**per_layer, "grads": states.step_grads * n_layer}))
    return RankMemory(tuple(lines))


def _pipeline_buffers(setting: Setting, layout: Layout, chunks: list[int], flight: float, mode: str,
                      dtypes: Dtypes) -> float:
    """torch.distributed.pipelining's buffers on one rank: per virtual stage, a receive buffer per micro-batch for
    its input (all but the first stage) and for its output's gradient (all but the last), and each in-flight
    micro-batch's output until its backward (the logits on the last stage); less the received inputs the first
    block keeps anyway (the same tensors). The interleaved schedule's runtime waits on its sends only when the
    step ends, so every output and every gradient it has sent stays held until then: at its last peak, every
    micro-batch's output and the gradients of those already done (m - in flight)."""
    if layout.pp == 1:
        return 0.0
    model, tokens, m = setting.model, layout.micro_batch * setting.seq_len, layout.num_micro_batches
    hidden = _stage_hidden_bytes(setting, layout, dtypes)
    total, last = 0.0, layout.num_stages - 1
    interleaved = layout.schedule == "interleaved"
    for k in chunks:
        if k > 0:
            total += m * hidden + (m - flight if interleaved else 0.0) * hidden  # receive buffers, gradients sent
            if stage_input_is_kept(model, mode, dtypes):
                total -= flight * hidden
        if k < last:
            total += m * hidden + (m if interleaved else flight) * hidden  # gradient receive buffers, outputs kept
        else:
            total += flight * tokens * model.vocab_size / layout.tp * dtypes.compute
    return total


def _stage_hidden_bytes(setting: Setting, layout: Layout, dtypes: Dtypes) -> float:
    """One micro-batch's hidden states between pipeline stages (sharded along the sequence under SP)."""
    tokens = layout.micro_batch * setting.seq_len
    return tokens * setting.model.hidden_size / (layout.tp if layout.sp else 1) * dtypes.residual


def memory_table(setting: Setting, layout: Layout, modes: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(fixed [pp, M], per_layer [pp, M]) bytes for every pipeline rank and recompute mode: `rank_memory`'s peak
    moment at an even share of the blocks (RankMemory.coefficients), for the search."""
    fixed, states, acts = memory_table_parts(setting, layout, modes)
    return fixed, states[:, None] + acts


def memory_table_parts(setting: Setting, layout: Layout, modes: tuple[str, ...]
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fixed [pp, M], per-layer model states [pp], per-layer activations [pp, M]): `memory_table` with a layer's
    parameters and activations apart (blocks that differ weigh them differently)."""
    pp = layout.pp
    fixed, acts = np.zeros((pp, len(modes))), np.zeros((pp, len(modes)))
    share = -(-setting.model.num_layers // pp)
    mode_states = np.zeros((pp, len(modes)))
    for r in range(pp):
        for i, mode in enumerate(modes):
            fixed[r, i], mode_states[r, i], acts[r, i] = rank_memory(setting, layout, r, mode).coefficients(share)
    # one per-layer state per rank: where a mode's peak moment holds more (gradients), the rest counts with its
    # activations
    states = mode_states.min(axis=1)
    return fixed, states, acts + mode_states - states[:, None]
