"""Peak memory per device, by part, for every pipeline rank.

A rank's memory is linear in the number of transformer layers it holds:
``fixed + layers * per_layer`` (the partition search relies on it). Parts:

* params, grads, optimizer: mixed-precision Adam keeps 2Ψ + 2Ψ + KΨ bytes (K = 12), split
  by ZeRO over the data-parallel group (Rajbhandari et al. 2020, section 5);
* activations: per layer per micro-batch by recompute mode (plait.cost.compute), times the
  micro-batches the schedule keeps in flight on that rank (GPipe m; 1F1B min(m, p - r);
  interleaved 1F1B Megatron's warm-up count over v chunks, which gives Korthikanti's factor
  1 + (p - 1)/(p·v) on the first rank); plus one layer re-materialized during its backward;
* logits: the last stage's fp32 logits b·s·V/t;
* buffers: tensor-parallel and pipeline send/receive buffers, DDP buckets, ZeRO-3 gathered layers;
* reserve: allocator fragmentation and runtime context, a fixed share of the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from plait.cost.compute import activation_bytes
from plait.cost.layout import Layout, Setting
from plait.cost.schedule import V_SCHEDULES, rank_actions
from plait.spec.model import ModelSpec
from plait.spec.train import TrainSpec

RESERVE_FRACTION = 0.05
"""Share of device memory kept back for the caching allocator's fragmentation and the runtime."""
BUCKET_BYTES = 25 * 2**20
"""DDP / ZeRO gradient bucket (PyTorch's default bucket_cap_mb = 25); two in flight."""
PART_NAMES = ("params", "grads", "optimizer", "activations", "logits", "buffers", "reserve")


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
    """ZeRO's model states per device: 16-bit params and grads, K bytes of optimizer state per parameter."""
    p, g, k = train.param_bytes, train.param_bytes, train.optimizer_bytes
    return {
        "params": num_params * p / (dp if zero >= 3 else 1),
        "grads": num_params * g / (dp if zero >= 2 else 1),
        "optimizer": num_params * k / (dp if zero >= 1 else 1),
    }


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
class RankMemory:
    """Memory of one pipeline rank as ``fixed + layers * per_layer``, by part."""

    fixed: dict[str, float]
    per_layer: dict[str, float]

    def parts(self, layers: float, activation_layers: float | None = None) -> dict[str, float]:
        """`layers` blocks' worth of parameters (and `activation_layers` of activations, where blocks differ:
        plait.cost.compute.block_loads)."""
        acts = layers if activation_layers is None else activation_layers
        return {k: self.fixed[k] + (acts if k == "activations" else layers) * self.per_layer[k] for k in PART_NAMES}

    def total(self, layers: float, activation_layers: float | None = None) -> float:
        return sum(self.parts(layers, activation_layers).values())


def held_zero(layout: Layout) -> int:
    """The ZeRO stage whose memory a rank holds at its peak (plait.legality.data_parallel_mode: ZeRO-3's
    parameters stay gathered through a pipeline schedule, which is ZeRO-2's memory)."""
    return layout.dp_mode.held_zero


def rank_memory(setting: Setting, layout: Layout, rank: int, mode: str) -> RankMemory:
    """Memory coefficients of pipeline rank `rank` running recompute `mode` on all its layers."""
    model, train, tp, b = setting.model, setting.train, layout.tp, layout.micro_batch
    first, last = rank == 0, rank == layout.last_rank
    dtype, s = setting.dtype_bytes, setting.seq_len
    ends = (first_stage_params(model, tp) if first else 0.0) + (
        last_stage_params(model, tp, shares_embedding_rank=first and layout.pp == 1) if last else 0.0)
    fixed = model_state_bytes(ends, layout.dp, held_zero(layout), train)
    per_layer = model_state_bytes(layer_params(model, tp), layout.dp, held_zero(layout), train)
    flight = in_flight(layout, rank)
    act = {m: activation_bytes(model, b, s, tp, layout.sp, m, dtype) for m in ("none", mode)}
    per_layer["activations"] = flight * act[mode]
    sbh = b * s * model.hidden_size * dtype
    embed_out = 1.5 * sbh / (tp if layout.sp else 1)  # embedding output + dropout mask
    fixed["activations"] = (act["none"] - act[mode]) + (flight * embed_out if first else 0.0)
    fixed["logits"] = 4.0 * b * s * model.vocab_size / tp if last else 0.0
    fixed["buffers"] = _buffers(setting, layout)
    fixed["reserve"] = RESERVE_FRACTION * setting.cluster.memory_bytes
    for name in ("logits", "buffers", "reserve"):
        per_layer[name] = 0.0
    return RankMemory(fixed=fixed, per_layer=per_layer)


def _buffers(setting: Setting, layout: Layout) -> float:
    sbh = layout.micro_batch * setting.seq_len * setting.model.hidden_size * setting.dtype_bytes
    total = 2.0 * sbh if layout.tp > 1 else 0.0
    if layout.pp > 1:  # send and receive, activations forward and gradients backward
        total += 4.0 * sbh / (layout.tp if layout.sp else 1)
    if layout.dp > 1:
        total += 2.0 * BUCKET_BYTES
    if held_zero(layout) >= 3 and layout.dp > 1:  # the layer in use and the prefetched next one, gathered
        total += 2.0 * layer_params(setting.model, layout.tp) * setting.dtype_bytes
    return total


def memory_table(setting: Setting, layout: Layout, modes: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(fixed [pp, M], per_layer [pp, M]) bytes for every pipeline rank and recompute mode: the totals of
    `rank_memory` in one array pass, for the search."""
    fixed, states, acts = memory_table_parts(setting, layout, modes)
    return fixed, states[:, None] + acts


def memory_table_parts(setting: Setting, layout: Layout, modes: tuple[str, ...]
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fixed [pp, M], per-layer model states [pp], per-layer activations [pp, M]): `memory_table` with a layer's
    parameters and activations apart (blocks that differ weigh them differently)."""
    model, train, tp, b = setting.model, setting.train, layout.tp, layout.micro_batch
    pp = layout.pp
    flight = np.array([in_flight(layout, r) for r in range(pp)])
    act = np.array([activation_bytes(model, b, setting.seq_len, tp, layout.sp, m, setting.dtype_bytes) for m in modes])
    act_none = activation_bytes(model, b, setting.seq_len, tp, layout.sp, "none", setting.dtype_bytes)
    states = sum(model_state_bytes(layer_params(model, tp), layout.dp, held_zero(layout), train).values())
    acts = flight[:, None] * act[None, :]
    ends = np.zeros(pp)
    ends[0] += first_stage_params(model, tp)
    ends[layout.last_rank] += last_stage_params(model, tp, shares_embedding_rank=pp == 1)
    ends_bytes = np.array([sum(model_state_bytes(e, layout.dp, held_zero(layout), train).values()) for e in ends])
    sbh = b * setting.seq_len * model.hidden_size * setting.dtype_bytes
    extra = np.zeros(pp)
    extra[0] += flight[0] * 1.5 * sbh / (tp if layout.sp else 1)
    extra[layout.last_rank] += 4.0 * b * setting.seq_len * model.vocab_size / tp
    common = _buffers(setting, layout) + RESERVE_FRACTION * setting.cluster.memory_bytes
    fixed = (ends_bytes + extra + common)[:, None] + (act_none - act)[None, :]
    return fixed, np.full(pp, states), acts
