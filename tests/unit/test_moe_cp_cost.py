"""The cost model's context parallelism (both key/value exchanges), mixture-of-experts layers with expert
parallelism and zero-bubble V schedules; the search over them; and the planner's published reproductions."""

from __future__ import annotations

import random
import statistics

import pytest

from plait import Plan, TrainSpec
from plait.cost import predict
from plait.cost.activations import Dtypes, activation_bytes
from plait.cost.comm import Group, all_gather, all_to_all, axis_group, reduce_scatter
from plait.cost.compute import (Slicing, busiest_rank_load, context_exchange, expert_dispatch, expert_weights,
                                layer_flops, sliced_layer_cost)
from plait.cost.layout import Setting
from plait.plan import Layout
from plait.cost.memory import expert_params, layer_params, live_peaks
from plait.cost.schedule import STEADY_WITHIN
from plait.cost.model import closed_form_makespan, pipeline_stage_times
from plait.cost.schedule import simulate
from plait.search import plan_with_stats
from plait.spec import ModelSpec
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.models import MODEL_PRESETS

H100 = CLUSTER_PRESETS["h100-80g"]
FP32 = Dtypes(compute=4, residual=4)
GQA = ModelSpec(arch="llama", num_layers=1, hidden_size=64, num_heads=8, num_kv_heads=2, ffn_hidden_size=96,
                vocab_size=64)
MOE = GQA.replace(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=40)


# ---- what a block keeps, against autograd ------------------------------------------------------------
def _saved_bytes(spec: ModelSpec, batch: int, seq: int, cp: int = 1, kind: str = "all_gather") -> float:
    """Bytes of the distinct storages autograd keeps over one reference block's forward on context rank 0 of `cp`
    (a fake process group: shapes only), parameters and rotary tables left out."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plait.execute.context import ContextParallelAttention
    from plait.models.reference import TransformerBlock, rope_tables

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)
    try:
        torch.manual_seed(0)
        block = TransformerBlock(spec)
        positions = torch.arange(seq)
        if cp > 1:
            core = ContextParallelAttention(init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)), seq, kind)
            block.attention.core, positions = core, core.positions
        x = torch.randn(batch, len(positions), spec.hidden_size, requires_grad=True)
        rope = rope_tables(positions, spec.head_dim, spec.rope_theta)
        shared = {p.untyped_storage().data_ptr() for p in block.parameters()}
        shared |= {t.untyped_storage().data_ptr() for t in rope}
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in shared:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x, rope)
        return float(sum(kept.values()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp,kind", [(2, "all_gather"), (4, "all_gather"), (2, "all_to_all"), (4, "all_to_all")])
def test_context_rank_keeps_what_the_cost_model_counts(cp, kind):
    """plait/execute/context.py's attention on one context rank: the gathered (or swapped) keys and values, the
    mask or the permutations, and the rest at b·s/cp tokens -- byte for byte."""
    assert _saved_bytes(GQA, 2, 48, cp, kind) == activation_bytes(GQA, 2, 48, 1, False, "none", FP32, cp, kind)


def test_moe_block_keeps_what_the_cost_model_counts():
    """plait.models.moe's router, slots and experts; the balance loss's per-sequence scalars aside."""
    measured, counted = _saved_bytes(MOE, 2, 48), activation_bytes(MOE, 2, 48, 1, False, "none", FP32)
    assert counted == pytest.approx(measured, abs=100)  # the aux loss keeps a few sequence-sized tensors
    assert counted > activation_bytes(GQA, 2, 48, 1, False, "none", FP32)


@pytest.mark.parametrize("kind", ["all_gather", "all_to_all"])
def test_context_parallelism_halves_what_attention_does_not_widen(kind):
    """The block input (all full recompute keeps) is per token: cp ranks each keep 1/cp of it. Without recompute the
    MLP and norms halve too; only the attention's keys and values (gathered, or repeated to every query head) and
    the mask or permutations do not."""
    full = [activation_bytes(GQA, 1, 64, 1, False, "full", FP32, cp, kind) for cp in (1, 2, 4)]
    assert full == [full[0], full[0] / 2, full[0] / 4]
    none = [activation_bytes(GQA, 1, 64, 1, False, "none", FP32, cp, kind) for cp in (1, 2)]
    assert none[0] / 2 < none[1] < none[0]


def test_the_all_to_all_exchange_keeps_less_than_the_all_gather():
    for cp in (2, 4, 8):
        gather = activation_bytes(GQA, 1, 256, 1, False, "none", FP32, cp, "all_gather")
        swap = activation_bytes(GQA, 1, 256, 1, False, "none", FP32, cp, "all_to_all")
        assert swap < gather


# ---- collectives ------------------------------------------------------------------------------------
def test_all_to_all_inside_a_node_moves_what_an_all_gather_moves():
    for n in (2, 4, 8):
        assert all_to_all(1e8, Group(n, 1), H100) == pytest.approx(all_gather(1e8, Group(n, 1), H100))


def test_all_to_all_between_nodes_is_bound_by_each_rank_own_adapter():
    """16 ranks over two nodes: each sends 8/16 of its buffer through its own 48 GB/s adapter, the 7/16 for its
    node's ranks over NVLink at the same time."""
    nbytes = 1e9
    t = all_to_all(nbytes, Group(16, 1), H100)
    remote = 8 / 16 * nbytes / H100.inter_node.bandwidth
    assert t == pytest.approx(remote + 7 * H100.intra_node.latency_s + 8 * H100.inter_node.latency_s)
    assert t > all_to_all(nbytes, Group(8, 1), H100)


def test_mesh_groups_lie_where_the_executor_puts_them():
    from plait.axes import Degrees

    d = Degrees(pp=2, dp=8, ep=4, cp=2, tp=2)
    assert axis_group(d, "tp") == Group(2, 1)
    assert axis_group(d, "cp") == Group(2, 2)
    assert axis_group(d, "ep") == Group(4, 4)  # the nearest data-parallel ranks, above cp x tp
    assert axis_group(d, "dp_cp") == Group(16, 2)  # fully_shard's reduction over dp x cp
    assert axis_group(d, "pp") == Group(2, 32)


def test_context_exchange_volumes():
    """all_gather: K and V of the whole sequence (kv heads of a tensor rank) gathered forward and reduce-scattered
    backward; all_to_all: q, k, v (repeated to the query heads) and the output, b·s/cp tokens at the query width,
    four all-to-alls each way."""
    model, tokens, c = MODEL_PRESETS["llama3-8b"], 32768.0, 2
    gather = Slicing(tp=2, cp=4, cp_kind="all_gather")
    fwd, bwd = context_exchange(model, H100, tokens, gather, c)
    volume = tokens * 4 * model.kv_size / 2 * c
    assert fwd == pytest.approx(2 * all_gather(volume, Group(4, 2), H100))
    assert bwd == pytest.approx(2 * reduce_scatter(volume, Group(4, 2), H100))
    swap = Slicing(tp=2, cp=4, cp_kind="all_to_all")
    fwd, bwd = context_exchange(model, H100, tokens, swap, c)
    assert fwd == bwd == pytest.approx(4 * all_to_all(tokens * model.q_size / 2 * c, Group(4, 2), H100))
    assert context_exchange(model, H100, tokens, Slicing(tp=2), c) == (0.0, 0.0)


# ---- compute ------------------------------------------------------------------------------------------
def test_moe_flops_scale_with_top_k_not_with_the_experts():
    few, many = MOE.replace(num_experts=8), MOE.replace(num_experts=64)
    tokens = 1000
    router = 2 * tokens * MOE.hidden_size * (64 - 8)
    assert layer_flops(many, tokens, 32)[0] - layer_flops(few, tokens, 32)[0] == router
    two, four = few, few.replace(experts_per_token=4)
    assert layer_flops(four, tokens, 32)[0] - layer_flops(two, tokens, 32)[0] == 2 * tokens * 2 * expert_weights(few)


def test_mixtral_active_parameters_are_the_published_12_9b():
    mixtral = MODEL_PRESETS["mixtral-8x7b"]
    assert mixtral.num_params == pytest.approx(46.7e9, rel=0.01)
    active = (mixtral.num_params - mixtral.num_layers * (mixtral.num_experts - mixtral.experts_per_token)
              * expert_weights(mixtral))
    assert active == pytest.approx(12.9e9, rel=0.01)


def test_context_parallelism_divides_the_attention_as_its_kernels_run():
    """Per rank, the attention core computes 1/cp of the model's: Ulysses with the causal kernel (half the square),
    the all-gather kind through a mask (the whole s/cp x s rectangle: twice that)."""
    model = MODEL_PRESETS["llama3-8b"].replace(num_layers=1)
    s, b = 32768, 1
    base = sliced_layer_cost(model, H100, s, b, Slicing())
    swap = sliced_layer_cost(model, H100, s, b, Slicing(cp=4, cp_kind="all_to_all"))
    gather = sliced_layer_cost(model, H100, s, b, Slicing(cp=4, cp_kind="all_gather"))
    assert swap.fwd == pytest.approx(base.fwd / 4)
    dense, attn = layer_flops(model, b * s / 4, s)
    rate = H100.peak_flops * base.gemm_fraction / (1 + H100.efficiency.overhead)
    assert gather.fwd - swap.fwd == pytest.approx(0.5 * attn / rate)
    assert swap.cp_fwd > 0 and gather.cp_bwd > 0 and base.cp_fwd == 0


def test_expert_parallelism_waits_for_the_busiest_rank_and_dispatches_twice_each_way():
    model = MODEL_PRESETS["mixtral-8x7b"].replace(num_layers=1)
    s = 4096
    alone, split = sliced_layer_cost(model, H100, s, 1, Slicing()), sliced_layer_cost(model, H100, s, 1, Slicing(ep=8))
    experts = 2.0 * s * model.experts_per_token * expert_weights(model)
    rate = H100.peak_flops * alone.gemm_fraction / (1 + H100.efficiency.overhead)
    assert split.fwd - alone.fwd == pytest.approx((model.router_imbalance - 1) * experts / rate)
    slots = s * model.experts_per_token * model.hidden_size * 2 * model.router_imbalance
    counts = all_to_all(8.0 * model.num_experts, Group(8, 1), H100)
    assert expert_dispatch(model, H100, s, Slicing(ep=8), 2) == pytest.approx(
        counts + 2 * all_to_all(slots, Group(8, 1), H100))
    assert split.ep_fwd == split.ep_bwd > 0 and alone.ep_fwd == 0


def test_a_measured_router_imbalance_replaces_the_assumed_one():
    model = MODEL_PRESETS["mixtral-8x7b"].replace(num_layers=1)
    balanced = model.replace(router_imbalance=1.0)
    s = 4096
    assumed = sliced_layer_cost(model, H100, s, 1, Slicing(ep=8))
    measured = sliced_layer_cost(balanced, H100, s, 1, Slicing(ep=8))
    alone = sliced_layer_cost(balanced, H100, s, 1, Slicing())
    assert measured.fwd == pytest.approx(alone.fwd)  # a balanced router: ep moves no FLOPs, adds none
    assert measured.fwd < assumed.fwd and measured.ep_fwd < assumed.ep_fwd
    # the busiest rank receives at most the whole group's slots
    assert busiest_rank_load(model.replace(router_imbalance=3.0), 2) == 2.0
    assert busiest_rank_load(model.replace(router_imbalance=3.0), 1) == 1.0
    for bad in (0.9, "1.2", True, float("nan")):
        with pytest.raises(ValueError, match="router_imbalance"):
            model.replace(router_imbalance=bad)


# ---- memory ---------------------------------------------------------------------------------------------
def test_expert_parallelism_divides_the_experts_each_rank_holds():
    model = MODEL_PRESETS["mixtral-8x7b"]
    experts = model.num_experts * expert_weights(model)
    for ep in (1, 2, 8):
        assert layer_params(model, 1, 1) - layer_params(model, 1, ep) == pytest.approx(experts - experts / ep)
    assert expert_params(model, 1, 1) == 0  # plain parameters: fully_shard shards them like the rest
    assert expert_params(model, 1, 8) == experts / 8 and expert_params(model, 2, 1) == experts / 2


def _moe_plan(**kw) -> Plan:
    base = dict(dp=8, pp=4, zero=2, micro_batch=1, num_micro_batches=8, schedule="1f1b", model=MODEL_PRESETS[
        "mixtral-8x7b"], train=TrainSpec(global_batch=64, seq_len=4096), cluster=H100.with_devices(32))
    return Plan.of(**{**base, **kw})


def test_expert_parallelism_holds_fewer_experts_and_pays_for_the_dispatch():
    dense, split = predict(_moe_plan()), predict(_moe_plan(ep=8))
    assert split.memory_parts["params"] < dense.memory_parts["params"]
    assert split.step_time_parts["ep_comm"] > 0 == dense.step_time_parts["ep_comm"]
    assert sum(split.step_time_parts.values()) == pytest.approx(split.step_time_s)


@pytest.mark.parametrize("zero", [2, 3])
def test_experts_shard_over_their_copies_as_the_dense_weights_over_dp(zero):
    """Under fully_shard every parameter is sharded over the dp ranks that hold it: the dense weights over all 64,
    an ep8 model's experts (1/8 of them per rank) over their 8 copies -- so ep8 x edp8 holds the same optimizer
    bytes as dp64 alone, fewer parameter bytes (it gathers 1/8 of the experts), and its gradient reduction moves
    1/8 of the experts' bytes."""
    plain, split = (predict(_moe_plan(dp=64, pp=1, zero=zero, schedule="1f1b", cluster=H100.with_devices(64), ep=ep,
                                      num_micro_batches=1)) for ep in (1, 8))
    assert split.memory_parts["optimizer"] == pytest.approx(plain.memory_parts["optimizer"], rel=1e-9)
    assert split.memory_parts["params"] < plain.memory_parts["params"]
    assert split.step_time_parts["dp_comm"] < plain.step_time_parts["dp_comm"]


def test_context_parallel_plan_splits_the_sequence_memory():
    model, train = MODEL_PRESETS["llama3-8b"], TrainSpec(global_batch=4, seq_len=32768)
    two, eight = (predict(Plan.of(dp=8 // cp, cp=cp, zero=3, micro_batch=1, num_micro_batches=cp // 2,
                                  context_parallel="all_to_all", recompute=("full",), model=model, train=train,
                                  cluster=H100.with_devices(8))) for cp in (2, 8))
    assert eight.memory_parts["activations"] < two.memory_parts["activations"] / 3
    assert eight.step_time_parts["cp_comm"] > two.step_time_parts["cp_comm"] / 4 > 0


# ---- zero-bubble V schedules ---------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_closed_form_is_exact_on_uniform_stages_and_never_above_the_simulation(schedule):
    for p, m in ((2, 8), (4, 8), (4, 16), (8, 32)):
        fwd, bwd = [1.0] * (2 * p), [2.0] * (2 * p)
        layout = Layout.make(pp=p, sequence_parallel=False, zero=0, micro_batch=1, num_micro_batches=m, schedule=schedule,
                             interleave=2)
        from plait.cost.model import StageTimes

        st = StageTimes(tuple(fwd), tuple(bwd), (), (), ())
        assert closed_form_makespan(st, layout, 0.0) == simulate(fwd, bwd, p, m, schedule).makespan
    rng = random.Random(0)
    errors = []
    for _ in range(60):
        p = rng.choice([2, 4, 8])
        m = rng.choice([2 * p, 4 * p])
        fwd = [rng.uniform(0.5, 1.5) for _ in range(2 * p)]
        bwd = [f * rng.uniform(1.5, 2.5) for f in fwd]
        layout = Layout.make(pp=p, sequence_parallel=False, zero=0, micro_batch=1, num_micro_batches=m, schedule=schedule,
                             interleave=2)
        estimate = closed_form_makespan(StageTimes(tuple(fwd), tuple(bwd), (), (), ()), layout, 0.0)
        exact = simulate(fwd, bwd, p, m, schedule).makespan
        assert estimate <= exact * (1 + 1e-12)
        errors.append((exact - estimate) / exact)
    assert statistics.median(errors) < 0.01


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_peak_within_steady_within_pipelines_of_micro_batches(schedule):
    for p in (2, 3, 4, 8):
        steady = live_peaks(schedule, p, STEADY_WITHIN * p, 2)
        for m in range(STEADY_WITHIN * p, 16 * p + 1, p):
            assert live_peaks(schedule, p, m, 2) == steady


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 16), (8, 32)])
def test_zero_bubble_v_bubble_is_below_one_f_one_b_priced_on_real_stage_times(pp, m):
    model = MODEL_PRESETS["llama3-8b"]
    setting = Setting(model, H100, TrainSpec(global_batch=m, seq_len=8192))

    def bubble(schedule: str, v: int) -> float:
        layout = Layout.make(pp=pp, sequence_parallel=False, zero=0, micro_batch=1, num_micro_batches=m, schedule=schedule,
                             interleave=v)
        layers = (model.num_layers // (pp * v),) * (pp * v)
        st, _ = pipeline_stage_times(setting, layout, layers, ("none",) * pp)
        return simulate(st.fwd, st.bwd, pp, m, schedule).bubble_fraction

    one = bubble("1f1b", 1)
    assert bubble("zbv", 2) < one / 2 and bubble("dualpipev", 2) < one / 2


# ---- search ---------------------------------------------------------------------------------------------------
def test_pins_fix_context_and_expert_parallelism():
    train = TrainSpec(global_batch=8, seq_len=64)
    for p in plan_with_stats("tiny-moe", "local-cpu", train, num_devices=8, ep=2, cp=2,
                             context_parallel="all_to_all").plans:
        assert (p.ep, p.cp, p.context_parallel) == (2, 2, "all_to_all")
    from plait import ConfigError

    with pytest.raises(ConfigError, match="ep=3"):
        plan_with_stats("tiny-moe", "local-cpu", train, num_devices=8, ep=3)
    with pytest.raises(ConfigError, match="cp=3"):
        plan_with_stats("tiny-llama", "local-cpu", train, num_devices=6, cp=3)
    with pytest.raises(ConfigError, match="context_parallel"):
        plan_with_stats("tiny-llama", "local-cpu", train, num_devices=4, context_parallel="ring")


def test_every_searched_plan_is_legal_and_the_space_holds_the_new_dimensions():
    from plait import legality

    from plait.spec.clusters import CLUSTER_PRESETS

    train = TrainSpec(global_batch=8, seq_len=64, precision="fp32")
    gpus = CLUSTER_PRESETS["local-cpu"].replace(name="local-gpu", device_type="cuda", backend="nccl")
    result = plan_with_stats("tiny-moe", gpus, train, num_devices=8)
    seen = {(p.cp > 1, p.ep > 1, p.schedule) for p in result.plans}
    assert any(cp for cp, _, _ in seen) and any(ep for _, ep, _ in seen)
    assert {"zbv", "dualpipev"} <= {schedule for _, _, schedule in seen}
    for p in result.plans:
        legality.check(p, 8)
    # on CPU processes the V schedules are searched only when pinned (plait.search.space.searched_v_schedules)
    cpu = plan_with_stats("tiny-moe", "local-cpu", train, num_devices=8).plans
    assert not {p.schedule for p in cpu} & {"zbv", "dualpipev"}
    pinned = plan_with_stats("tiny-moe", "local-cpu", train, num_devices=8, schedule="zbv").plans
    # a pinned schedule holds wherever there is a pipeline; without one a plan has no schedule to run (its layout's
    # canonical form says 1f1b)
    assert pinned and {p.schedule for p in pinned if p.pp > 1} == {"zbv"}
    assert {p.schedule for p in pinned if p.pp == 1} <= {"1f1b"}


@pytest.mark.parametrize("model,cluster,devices,batch,seq", [
    ("tiny-moe", "local-cpu", 8, 16, 128),
    ("llama3-8b", "h100-80g", 16, 16, 32768),
])
def test_pruned_search_equals_the_full_one_over_cp_ep_and_v_schedules(model, cluster, devices, batch, seq):
    train = TrainSpec(global_batch=batch, seq_len=seq)
    full = plan_with_stats(model, cluster, train, num_devices=devices)
    top = plan_with_stats(model, cluster, train, num_devices=devices, top=3)
    assert top.candidates_pruned > 0
    assert [p.describe() for p in top.plans] == [p.describe() for p in full.plans[:3]]


@pytest.mark.parametrize("solver", ["learned", "dichotomy"])
def test_the_other_solvers_propose_legal_plans_in_the_new_space(solver):
    from plait import legality

    result = plan_with_stats("tiny-moe", "local-cpu", TrainSpec(global_batch=8, seq_len=64), num_devices=8, top=3,
                             solver=solver)
    assert result.plans
    for p in result.plans:
        legality.check(p, 8)


# ---- published choices the planner was not fitted on ---------------------------------------------------------
@pytest.mark.parametrize("global_batch", [2, 8])
def test_llama3_8b_at_128k_tokens_on_8_h100_chooses_context_parallelism(global_batch):
    """torchtitan trained Llama 3 8B at s = 131,072 on 8 H100s with FSDP 2 x CP 4 (one sequence per FSDP rank:
    global batch 2). Without it the 131,072 x 128,256 logits alone overflow a device. With ZeRO-3's gradients
    reduced every micro-batch (Plan.grad_sync, torchtitan's default too) two half-batches fit on CP 8 with
    selective instead of full recompute, which plait prices faster; torchtitan's mapping comes next."""
    result = plan_with_stats("llama3-8b", "h100-80g", TrainSpec(global_batch=global_batch, seq_len=131072),
                             num_devices=8, top=3)
    best = result.plans[0]
    assert best.cp > 1
    if global_batch == 2:
        assert (best.dp, best.cp, best.num_micro_batches, best.grad_sync) == (1, 8, 2, "micro_batch")
        assert (result.plans[1].dp, result.plans[1].cp) == (2, 4)  # torchtitan's FSDP 2 x CP 4
