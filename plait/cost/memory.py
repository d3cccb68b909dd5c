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
  them, which keeps a 16-bit copy of each through the step: `autocast_copy_bytes`), fp32 gradients and
  AdamW's two fp32 moments, the moments sharded by ZeroRedundancyOptimizer under ZeRO-1; fully_shard keeps
  fp32 shards of the parameters (over dp x cp: the executor's "dp_cp" mesh), the moments and the gradients, plus the gathered compute-dtype parameters of every unit where
  they are not resharded after forward, or of the root and one block where they are (ZeRO-3). Gradients
  persist through a step of several micro-batches (accumulated; fully_shard accumulates them unsharded,
  in fp32, until the last micro-batch). Experts that expert or tensor parallelism splits (DTensors on
  the ("ep", "tp") mesh: plait/execute/expert.py), E/ep experts per layer at 1/tp of their width
  (`expert_params`), are fully_shard units of their own over the ranks holding copies of them, edp x cp
  (`expert_state_bytes`); with one copy they are held whole: fp32 parameters, gradients and moments;
* activations: per block per micro-batch in flight (GPipe m; 1F1B min(m, p - r); interleaved Megatron's
  warm-up count), the embedding's token ids and the head's saved tensors;
* temporaries: the loss's gradients, a block's backward, fully_shard's all-gather and reduce-scatter
  buffers of one unit;
* buffers: DDP's gradient buckets (as large as the gradients), the pipeline's receive buffers (the executor's
  pool holds those in flight: plait.cost.live_set, one rule with plait/execute/buffers.py) and the stage outputs
  kept until their backward;
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
from plait.cost.compute import block_weights, layer_expert_weights, replicated_block_weights, replicated_kv_weights
from plait.cost.layout import Setting
from plait.plan import Layout
from plait.cost.live_set import live_buffers
from plait.cost.schedule import rank_actions, steady_micro_batches
from plait.cost.trainable import adapter_layer_params, kept_activations, trained, trained_layer_params
from plait.plan import V_SCHEDULES
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
def layer_params(model: ModelSpec, tp: int, ep: int = 1) -> float:
    """Parameters of one layer on one device: weights split by tp, the two norms replicated, the experts split over
    ep too; key and value projections whole on every tensor rank where tp exceeds their heads; LoRA's adapters."""
    norms = 2 * model.norm_params
    experts = layer_expert_weights(model)
    # held whole, not the 1/tp counted above
    replicated = (replicated_kv_weights(model, tp) + replicated_block_weights(model)) * (1 - 1 / tp)
    return ((model.params_per_layer - norms - experts) / tp + norms + experts / tp / ep + replicated
            + adapter_layer_params(model, tp))


def expert_params(model: ModelSpec, tp: int, ep: int) -> float:
    """Parameters of one layer's experts this device holds apart from the dense weights: E/ep experts at 1/tp of
    their width, where expert or tensor parallelism makes them DTensors (plait/execute/expert.py) that the carrier
    shards over their own copies (`expert_state_bytes`); 0 where they are plain parameters the carrier shards like
    the rest (ep = tp = 1) or the model has no experts."""
    if not model.num_experts or (ep == 1 and tp == 1):
        return 0.0
    return layer_expert_weights(model) / tp / ep


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
    """Ranks the optimizer states are sharded over: every data- and context-parallel rank on fully_shard (its
    parameters are shards), under ZeroRedundancyOptimizer (ZeRO-1 on DDP); none on DDP or one replica."""
    mode = layout.dp_mode
    if mode.carrier == "fully_shard" or (mode.carrier == "ddp" and layout.zero == 1):
        return layout.shard_degree
    return 1


def autocast_copy_bytes(setting: Setting, layout: Layout) -> float:
    """Bytes per parameter of autocast's cached 16-bit copies: where 16-bit runs autocast over fp32 parameters (one
    replica, DDP), the first matmul to read a weight casts it and autocast keeps the copy until its region ends,
    which is the whole step's forward and backward (plait.execute.parallelize.ParallelModel._compute_context): one
    copy of every weight through the step, whatever the recompute mode (measured on an H200: 2.61 GiB, 2 bytes per
    parameter of a 1.4B model, in every row of benchmarks/gpu_check.py's grid). Norm weights and biases are not
    cast; counted anyway (under 0.1% of a decoder's parameters)."""
    if layout.dp_mode.carrier in ("none", "ddp") and setting.dtype_bytes < FP32_BYTES:
        return float(setting.dtype_bytes)
    return 0.0


def state_bytes(setting: Setting, layout: Layout) -> StateBytes:
    """Bytes per dense parameter the carrier holds (module docstring)."""
    mode = layout.dp_mode
    if mode.carrier == "fully_shard":
        return _sharded_state_bytes(setting, layout, layout.shard_degree)
    return StateBytes(params=FP32_BYTES + autocast_copy_bytes(setting, layout),
                      optimizer=ADAM_STATE_BYTES / optimizer_shards(layout),
                      buckets=FP32_BYTES if mode.carrier == "ddp" else 0.0, accumulated_grads=FP32_BYTES,
                      step_grads=FP32_BYTES, gathered_units=False)


def _sharded_state_bytes(setting: Setting, layout: Layout, shards: int) -> StateBytes:
    """fully_shard's bytes per parameter sharded over `shards` ranks: fp32 shards of the parameter, its moments and
    its gradient at the step; the gathered compute-dtype copy where not resharded after forward; the gradient
    between micro-batches: unsharded in fp32 where reduced once a step, its shard where reduced after every
    micro-batch (Layout.grad_sync)."""
    mode = layout.dp_mode
    gathered = 0.0 if mode.reshard_after_forward else setting.dtype_bytes
    accumulated = FP32_BYTES / shards if layout.grad_sync == "micro_batch" else FP32_BYTES
    return StateBytes(params=FP32_BYTES / shards + gathered, optimizer=ADAM_STATE_BYTES / shards, buckets=0.0,
                      accumulated_grads=accumulated, step_grads=FP32_BYTES / shards,
                      gathered_units=mode.reshard_after_forward)


def expert_state_bytes(setting: Setting, layout: Layout) -> StateBytes:
    """Bytes per expert parameter (of `expert_params`): fully_shard's over the expert's copies (Layout.expert_shards,
    plait/execute/data.py), or, with one copy, whole: fp32 parameter, AdamW's two moments, the fp32 gradient."""
    if layout.expert_shards > 1:
        return _sharded_state_bytes(setting, layout, layout.expert_shards)
    return StateBytes(params=FP32_BYTES + autocast_copy_bytes(setting, layout), optimizer=ADAM_STATE_BYTES,
                      buckets=0.0, accumulated_grads=FP32_BYTES,
                      step_grads=FP32_BYTES, gathered_units=False)


def in_flight(layout: Layout, rank: int) -> float:
    """Micro-batches of activations rank `rank` holds at its peak, per layer it owns."""
    return float(in_flight_all(layout)[rank])


def in_flight_all(layout: Layout) -> np.ndarray:
    """`in_flight` of every pipeline rank."""
    p, m, v = layout.pp, layout.num_micro_batches, layout.interleave
    ranks = np.arange(p)
    if p == 1:
        return np.ones(1)
    if layout.schedule == "gpipe":
        return np.full(p, float(m))
    if layout.schedule == "interleaved":
        # Megatron's warm-up: 2(p - r - 1) + (v - 1)p forward chunks before the first backward, then one more.
        return np.minimum(m * v, 2 * (p - ranks - 1) + (v - 1) * p + 1) / v
    if layout.schedule in V_SCHEDULES:  # read from the V's own order, up to its steady state
        return np.array(live_peaks(layout.schedule, p, steady_micro_batches(layout.schedule, p, m), v), dtype=float) / v
    return np.minimum(m, p - ranks).astype(float)


def live_peak(schedule: str, pp: int, m: int, v: int, rank: int) -> int:
    """Most (stage, micro-batch) activations rank `rank` holds at once in the schedule's own order: a forward keeps
    them, the backward (its weight-gradient half, where the backward is split) frees them."""
    return live_peaks(schedule, pp, m, v)[rank]


@lru_cache(maxsize=1024)
def live_peaks(schedule: str, pp: int, m: int, v: int) -> tuple[int, ...]:
    """`live_peak` of every rank (one pass over the schedule's actions)."""
    peaks = []
    for actions in rank_actions(schedule, pp, m, v):
        live = peak = 0
        for kind, _, _ in actions:
            if kind == "F":
                live += 1
                peak = max(peak, live)
            elif kind in ("B", "W"):
                live -= 1
        peaks.append(peak)
    return tuple(peaks)


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
        sums = [(sum(x.fixed.values()), sum(x.per_layer.values()), x) for x in self.lines]
        fixed, per_layer, line = max(sums, key=lambda t: t[0] + layers * t[1])  # the total is linear in the blocks
        activations = line.per_layer.get("activations", 0.0)
        return fixed, per_layer - activations, activations


def rank_memory(setting: Setting, layout: Layout, rank: int, mode: str) -> RankMemory:
    """Memory of pipeline rank `rank` running recompute `mode` on all its blocks: its moments (module docstring)."""
    return LayoutMemory(setting, layout).rank(rank, mode)


class LayoutMemory:
    """The moments of every pipeline rank of one layout, as arrays over the ranks: what the ranks share (the
    carrier's bytes per parameter) once, what sets them apart (the ends they hold, their micro-batches in flight,
    their pipeline buffers) per rank, and what depends on the recompute mode (a block's activations and backward
    temporaries) per mode. `rank(r, mode)` is one rank's RankMemory; `coefficients(mode, layers)` the whole
    pipeline's memory table column at once (for the search)."""

    def __init__(self, setting: Setting, layout: Layout) -> None:
        model, tp, sp, pp = setting.model, layout.tp, layout.sp, layout.pp
        self.setting, self.layout = setting, layout
        self.dtypes, self.states = plan_dtypes(setting, layout), state_bytes(setting, layout)
        self.expert_states = expert_state_bytes(setting, layout)
        self.tokens = layout.micro_batch * setting.seq_len / layout.cp
        self.n_expert = expert_params(model, tp, layout.ep)
        self.n_layer = layer_params(model, tp, layout.ep) - self.n_expert  # what the carrier holds of a layer
        ranks = np.arange(pp)
        self.first = (ranks == 0).astype(float)  # the first virtual stage is on rank 0 in every layout
        self.last = (ranks == layout.last_rank).astype(float)
        self.flight = in_flight_all(layout)
        self.head_params = self.last * np.where(self.first > 0, last_stage_params(model, tp, True),
                                                last_stage_params(model, tp, False))
        self.ends = self.first * first_stage_params(model, tp) + self.head_params
        # what of them trains (gradients; plait.cost.trainable): all, or a LoRA run's adapters alone
        self.trained_layer = trained_layer_params(model, tp, self.n_layer)
        self.trained_expert = trained(model, self.n_expert)
        self.trained_head = trained(model, self.head_params) + np.zeros(pp)
        self.trained_ends = trained(model, self.ends) + np.zeros(pp)
        self.zeros = np.zeros(pp)
        base, self.per_layer = (({k: v + self.zeros for k, v in d.items()}) for d in _held(
            setting, layout, self.states, self.expert_states, self.ends, self.n_layer, self.n_expert))
        buffers, self.kept_inputs = _pipeline_buffers(setting, layout, self.first, self.last, self.flight, self.dtypes)
        base["buffers"] = base["buffers"] + buffers
        self.base = base
        self.head = self.last * head_saved_bytes(model, self.tokens, tp, sp, self.dtypes)
        self.ids = self.first * self.tokens * INDEX_BYTES  # the embedding keeps the token ids
        self.loss = self.last * loss_backward_bytes(model, self.tokens, tp)
        # torch's GPipe loop waits on its gradient sends only when the step ends (plait/execute/buffers.py)
        self.sent = (layout.num_micro_batches - 1) * _stage_hidden_bytes(setting, layout, self.dtypes) * (
            1 - self.first) if pp > 1 and layout.schedule == "gpipe" else self.zeros
        self._moments: dict[str, tuple[list, list]] = {}
        self._loss_lines: dict[str, tuple[tuple[dict, dict], tuple[np.ndarray, np.ndarray]]] = {}
        self._moment_totals: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._states_total = sum(self.per_layer.values())  # a block's model states: what every moment's per-layer adds to
        self._bases: dict[bool, tuple[dict, np.ndarray]] = {}  # _mode_base's parts and their sum, by whether kept
        self._shared: dict[str, tuple] = {}  # _moment's parts that no recompute mode changes, by moment
        self._partial_totals: dict[tuple[str, bool], np.ndarray] = {}  # _moment_totals' sums of those, by moment, base

    def layer_grads(self, which: str) -> float:
        """A layer's gradient bytes, dense and experts: `which` "accumulated" (between micro-batches) or "step" (at
        the optimizer step)."""
        return (getattr(self.states, f"{which}_grads") * self.trained_layer
                + getattr(self.expert_states, f"{which}_grads") * self.trained_expert)

    def _moment_parts(self, name: str) -> tuple:
        """What moment `name` ("loss", "recompute", "step" or "last": `moments`) holds whatever the recompute mode
        (made once for every mode): (its fixed activations and gradients, its micro-batches in flight, a block's
        gradients)."""
        if name not in self._shared:
            states, zeros, m = self.states, self.zeros, self.layout.num_micro_batches
            steady = self.flight < m
            if name in ("recompute", "last"):
                setting, layout = self.setting, self.layout
                released = self.head + probabilities_bytes(setting.model, setting.seq_len, self.tokens, layout.tp,
                                                           self.dtypes, layout.cp)
            # (micro-batches in flight, which gradients, where held, fixed gradients, fixed activations)
            if name == "loss":
                args = (self.flight, "accumulated", steady, 0.0, 0.0)
            elif name == "recompute":
                args = (self.flight, "accumulated", steady, np.where(steady, 0.0, states.step_grads * self.trained_head),
                        -released)
            elif name == "step":
                args = (zeros, "step", 1.0, 0.0, 0.0)
            else:
                args = (1.0 + zeros, "accumulated", 1.0, 0.0, -released)
            micro_batches, which, held, grads_fixed, acts_fixed = args
            self._shared[name] = (micro_batches * (self.ids + self.head) + acts_fixed,
                                  held * getattr(states, f"{which}_grads") * self.trained_ends + grads_fixed,
                                  micro_batches, held * self.layer_grads(which) + zeros)
        return self._shared[name]

    def _moment(self, name: str, base: dict, act: float, temporaries) -> tuple[dict, dict]:
        """Moment `name` of a recompute mode whose moments start from `base`, with `act` bytes of a block's
        activations and these temporaries (`_moment_parts` the rest)."""
        activations, grads, micro_batches, layer_grads = self._moment_parts(name)
        fixed = {**base, "activations": activations, "grads": grads, "temporaries": temporaries + self.zeros}
        return fixed, {**self.per_layer, "activations": micro_batches * act + self.zeros, "grads": layer_grads}

    def _moment_totals_of(self, name: str, line: tuple[dict, dict], kept: bool) -> tuple[np.ndarray, np.ndarray]:
        """`_totals` of `_moment`'s `line` of moment `name` from the base `kept` picks, the sum of its parts that no
        mode changes made once (the same floats, added in the same order)."""
        fixed, per_layer = line
        key = (name, kept)
        if key not in self._partial_totals:
            self._partial_totals[key] = self._bases[kept][1] + fixed["activations"] + fixed["grads"]
        return (self._partial_totals[key] + fixed["temporaries"],
                self._states_total + per_layer["activations"] + per_layer["grads"])

    def _totals(self, line: tuple[dict, dict], base: dict, base_total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """sum(fixed.values()), sum(per_layer.values()) of a moment whose parts start with `base`'s (which sum to
        `base_total`) and the per-layer model states' (`{**base, ...}`): those sums, then the parts the moment adds,
        in the dicts' order (the same floats, without adding the shared parts again)."""
        fixed, per_layer = line
        fixed_total, per_layer_total = base_total, self._states_total
        for key in list(fixed)[len(base):]:
            fixed_total = fixed_total + fixed[key]
        for key in list(per_layer)[len(self.per_layer):]:
            per_layer_total = per_layer_total + per_layer[key]
        return fixed_total, per_layer_total

    def _mode_base(self, mode: str) -> tuple[dict, float, float, bool]:
        """(the fixed parts every moment of `mode` starts from, a block's activations, ZeRO-3's all-gather in flight,
        whether the first block keeps the received input: the base's key)."""
        setting, layout = self.setting, self.layout
        model = setting.model
        act = kept_activations(model, mode, activation_bytes(  # a LoRA base keeps less: plait.cost.trainable
            model, layout.micro_batch, setting.seq_len, layout.tp, layout.sp, mode, self.dtypes, layout.cp,
            layout.context_parallel, layout.ep))
        # ZeRO-3: the next block's all-gather in flight; a reduce-scatter's input. Of the dense unit only: measured
        # with experts as units of their own (ep2 x edp2, benchmarks/memory_accuracy.py), a block's backward held
        # 0.38 MiB of temporaries, less than its dense unit's two buffers alone
        gather = setting.dtype_bytes * self.n_layer if self.states.gathered_units else 0.0
        kept = stage_input_is_kept(model, mode, self.dtypes)  # the first block keeps the received input itself
        if kept not in self._bases:
            base = dict(self.base)
            if kept:
                base["buffers"] = base["buffers"] - self.kept_inputs
            self._bases[kept] = base, sum(base.values())
        return self._bases[kept][0], act, gather, kept

    def loss_line(self, mode: str) -> tuple[dict, dict]:
        """The loss moment of `mode` (moments' first): every in-flight micro-batch's activations, the loss's
        gradients; the earlier micro-batches' gradients where the rank's largest in-flight count recurs after its
        first backward (a steady state), not where every forward comes first (GPipe, one micro-batch, a short 1F1B)."""
        if mode not in self._loss_lines:
            base, act, gather, kept = self._mode_base(mode)
            line = self._moment("loss", base, act, gather + self.loss)
            self._loss_lines[mode] = line, self._moment_totals_of("loss", line, kept)
        return self._loss_lines[mode][0]

    def moments(self, mode: str) -> tuple[list[tuple[dict, dict]], list[np.ndarray]]:
        """(each moment's (fixed, per-layer) parts as arrays over the ranks, where each moment exists)."""
        if mode in self._moments:
            return self._moments[mode]
        setting, layout, states, zeros = self.setting, self.layout, self.states, self.zeros
        model, tp, sp, b, s = setting.model, layout.tp, layout.sp, layout.micro_batch, setting.seq_len
        cp, kind, ep, m = layout.cp, layout.context_parallel, layout.ep, layout.num_micro_batches
        base, act_mode, gather, kept = self._mode_base(mode)
        act_none = act_mode if mode == "none" else kept_activations(model, "none", activation_bytes(
            model, b, s, tp, sp, "none", self.dtypes, cp, kind, ep))
        # every micro-batch's reduce-scatter (Layout.grad_sync) has a unit's unsharded gradients as its input too
        per_micro_batch = layout.grad_sync == "micro_batch" and layout.dp_mode.carrier == "fully_shard"
        scatter = FP32_BYTES * self.trained_layer if states.gathered_units or per_micro_batch else 0.0
        # a block's backward: the youngest micro-batch's head is done, the block rematerializes what its mode dropped
        # (and on the math path swaps its probabilities for their two gradients)
        backward = (gather + scatter + act_none - act_mode
                    + layer_backward_bytes(model, s, self.tokens, tp, sp, self.dtypes, cp, kind, ep))
        steady = self.flight < m
        names = ["loss", "recompute", "step"]
        lines = [self.loss_line(mode),                                   # the loss
                 self._moment("recompute", base, act_mode, backward),   # a block's backward, its temporaries
                 self._moment("step", base, act_mode, 0.0)]             # the optimizer step
        present = [np.ones(len(zeros), dtype=bool)] * 3
        if m > 1:  # the last micro-batch's backward: every micro-batch's gradients, its own activations (GPipe
            # waits on its gradient sends when the step ends: the m - 1 sent before stay held); not where steady
            names.append("last")
            lines.append(self._moment("last", base, act_mode, backward + self.sent))
            present.append(~steady)
        if m == 1:  # the backward of the first block: every gradient but its own and the embedding's; one block's acts
            step_grads = self.layer_grads("step") + zeros
            lines.append(({**base, "activations": self.ids + act_mode, "temporaries": backward + zeros,
                           "grads": states.step_grads * self.trained_head - step_grads},
                          {**self.per_layer, "grads": step_grads, "activations": zeros}))
            present.append(np.ones(len(zeros), dtype=bool))
        totals = [self._loss_lines[mode][1]] + [self._moment_totals_of(name, x, kept) for name, x in zip(names[1:], lines[1:])]
        if len(lines) > len(names):  # the first block's backward (one micro-batch), whose parts are its own
            totals.append(self._totals(lines[-1], base, self._bases[kept][1]))
        self._moments[mode] = (lines, present)
        self._moment_totals[mode] = totals
        return lines, present

    def rank(self, rank: int, mode: str) -> RankMemory:
        lines, present = self.moments(mode)
        return RankMemory(tuple(Line({k: float(v[rank]) for k, v in fixed.items()},
                                     {k: float(v[rank]) for k, v in per_layer.items()})
                                for (fixed, per_layer), here in zip(lines, present) if here[rank]))

    def floor(self) -> tuple[np.ndarray, np.ndarray]:
        """(fixed, per block) bytes of every rank at its loss moment with full recompute: below any moment of any
        recompute mode of a rank holding a block or more (full recompute keeps only each block's input, and the
        received input is that same tensor)."""
        self.loss_line("full")
        return self._loss_lines["full"][1]

    def may_fit(self) -> bool:
        """A necessary condition for some split of the blocks to fit (False: none does): at its `floor`, rank r holds
        at most K_r blocks within its device's memory, so no split fits where a rank cannot hold one block per stage
        or Σ K_r < L. Blocks that differ (measured on meta) do not count in mean blocks: always True for them."""
        setting, layout = self.setting, self.layout
        if block_weights(setting.model, setting.seq_len) is not None:
            return True
        fixed, slope = self.floor()
        room = setting.cluster.memory_bytes - fixed
        with np.errstate(divide="ignore", invalid="ignore"):
            most = np.where(slope > 0, np.floor(room / np.where(slope > 0, slope, 1.0)), np.where(room >= 0, np.inf, -1))
        return bool((most >= layout.interleave).all() and most.sum() >= setting.model.num_layers)

    def coefficients(self, mode: str, layers: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per rank, RankMemory.coefficients: (fixed, per-layer model states, per-layer activations) of the moment
        that is the peak at `layers` blocks."""
        lines, present = self.moments(mode)
        totals = self._moment_totals[mode]
        fixed = np.array([f for f, _ in totals])  # [moment, rank]
        per_layer = np.array([p for _, p in totals])
        acts = np.array([p["activations"] for _, p in lines])
        totals = np.where(np.array(present), fixed + layers * per_layer, -np.inf)
        peak = totals.argmax(axis=0)  # the first of equal moments, as max() picks
        ranks = np.arange(fixed.shape[1])
        return fixed[peak, ranks], per_layer[peak, ranks] - acts[peak, ranks], acts[peak, ranks]


def held_states(setting: Setting, layout: Layout, rank: int) -> tuple[dict[str, float], dict[str, float]]:
    """(fixed, per layer) bytes pipeline rank `rank` holds whatever its micro-batch, recompute and moment: parameters,
    optimizer states and DDP's buckets as the carrier keeps them (ZeRO-3's gathered root unit and block with
    them), the experts held apart, and the allocator's reserve."""
    model, tp, ep = setting.model, layout.tp, layout.ep
    chunks = layout.stages_of(rank)
    first, last = 0 in chunks, layout.num_stages - 1 in chunks
    ends = (first_stage_params(model, tp) if first else 0.0) + (
        last_stage_params(model, tp, shares_embedding_rank=first) if last else 0.0)
    n_expert = expert_params(model, tp, ep)
    return _held(setting, layout, state_bytes(setting, layout), expert_state_bytes(setting, layout), ends,
                 layer_params(model, tp, ep) - n_expert, n_expert)


def _held(setting: Setting, layout: Layout, states: StateBytes, experts: StateBytes, ends, n_layer: float,
          n_expert: float) -> tuple[dict, dict]:
    """held_states' parts for `ends` parameters of the embedding and head (a number, or an array over ranks)."""
    def held(s: StateBytes) -> dict[str, float]:
        return {"params": s.params, "optimizer": s.optimizer, "buffers": s.buckets}

    dense, expert = held(states), held(experts)
    model = setting.model
    # a LoRA run's frozen base holds its parameters alone: moments and buckets are the adapters' (plait.cost.trainable)
    counts = {"params": (ends, n_layer, n_expert)}
    trains = (trained(model, ends), trained_layer_params(model, layout.tp, n_layer), trained(model, n_expert))
    base = {k: v * counts.get(k, trains)[0] for k, v in dense.items()}
    per_layer = {k: v * counts.get(k, trains)[1] + expert[k] * counts.get(k, trains)[2] for k, v in dense.items()}
    if states.gathered_units:  # ZeRO-3: the root unit and one block (with its experts' unit) gathered
        base["params"] += setting.dtype_bytes * (ends + n_layer + (n_expert if experts.gathered_units else 0.0))
    base["reserve"] = RESERVE_FRACTION * setting.cluster.memory_bytes
    return base, per_layer


def states_overflow(setting: Setting, layout: Layout) -> float:
    """Bytes by which the pipeline's devices together miss holding the model states alone (<= 0: they may fit).
    Every rank holds its `held_states`, and the ranks' blocks add up to the model's, so no split of the blocks, no
    micro-batch and no recompute fits where the sum exceeds the ranks' capacity: the search skips such a layout
    unpriced."""
    need = have = 0.0
    held: dict[tuple, float] = {}  # ranks of one device group holding the same ends hold the same
    for r in range(layout.pp):
        at = setting.at(layout, r)
        key = (layout.stage_groups[r] if layout.stage_groups else None, r == 0, r == layout.last_rank)
        if key not in held:
            fixed, per_layer = held_states(at, layout, r)
            held[key] = sum(fixed.values()) + setting.model.num_layers / layout.pp * sum(per_layer.values())
        need += held[key]
        have += at.cluster.memory_bytes
    return need - have


def _pipeline_buffers(setting: Setting, layout: Layout, first: np.ndarray, last: np.ndarray, flight: np.ndarray,
                      dtypes: Dtypes) -> tuple[np.ndarray, np.ndarray]:
    """The executor's pipeline buffers on every rank (`first`, `last`: whether it holds the first and last virtual
    stage; `flight`: its micro-batches in flight): the receive buffers its pool holds at their peak
    (plait.cost.live_set.live_buffers: stage inputs from the receive to the backward, output gradients from the
    receive to the backward that consumes them), each in-flight micro-batch's output until its backward (the logits
    on the last stage). Sends are let go as they complete (plait/execute/buffers.py), but torch's GPipe loop waits
    on its gradient sends when the step ends (priced at the last micro-batch's backward: LayoutMemory.sent).
    Returns (the buffers, the received inputs among them that the first block keeps anyway -- the same tensors,
    to subtract where the recompute mode keeps the block input: activations.stage_input_is_kept)."""
    if layout.pp == 1:
        return np.zeros(1), np.zeros(1)
    model, tokens = setting.model, layout.micro_batch * setting.seq_len / layout.cp
    hidden = _stage_hidden_bytes(setting, layout, dtypes)
    live = live_buffers(layout.schedule, layout.pp, layout.num_micro_batches, layout.interleave)
    inputs = np.array([b.inputs for b in live], dtype=float)
    grads = np.array([b.grads for b in live], dtype=float)
    receiving = layout.interleave - first  # this rank's stages that receive an input (all but the first stage)
    sending = layout.interleave - last  # ... and that send an output (all but the last stage)
    total = (inputs + grads) * hidden  # the pool's receive buffers
    total += sending * flight * hidden  # outputs kept until their backward
    total += last * flight * tokens * model.vocab_size / layout.tp * dtypes.compute  # the logits of the last stage
    return total, np.minimum(receiving * flight, inputs) * hidden


def _stage_hidden_bytes(setting: Setting, layout: Layout, dtypes: Dtypes) -> float:
    """One micro-batch's hidden states between pipeline stages (this context rank's tokens; sharded along the
    sequence under SP)."""
    tokens = layout.micro_batch * setting.seq_len / layout.cp
    return tokens * setting.model.hidden_size / (layout.tp if layout.sp else 1) * dtypes.residual


def memory_table(setting: Setting, layout: Layout, modes: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(fixed [pp, M], per_layer [pp, M]) bytes for every pipeline rank and recompute mode: `rank_memory`'s peak
    moment at an even share of the blocks (RankMemory.coefficients), for the search."""
    fixed, states, acts = memory_table_parts(setting, layout, modes)
    return fixed, states[:, None] + acts


def memory_table_parts(setting: Setting, layout: Layout, modes: tuple[str, ...], memory: LayoutMemory | None = None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fixed [pp, M], per-layer model states [pp], per-layer activations [pp, M]): `memory_table` with a layer's
    parameters and activations apart (blocks that differ weigh them differently). `memory`: this layout's
    LayoutMemory where the caller has it already."""
    pp = layout.pp
    fixed, acts = np.zeros((pp, len(modes))), np.zeros((pp, len(modes)))
    share = -(-setting.model.num_layers // pp)
    mode_states = np.zeros((pp, len(modes)))
    memory = memory or LayoutMemory(setting, layout)
    for i, mode in enumerate(modes):
        fixed[:, i], mode_states[:, i], acts[:, i] = memory.coefficients(mode, share)
    # one per-layer state per rank: where a mode's peak moment holds more (gradients), the rest counts with its
    # activations
    states = mode_states.min(axis=1)
    return fixed, states, acts + mode_states - states[:, None]
