"""Cost-model pieces: collectives, FLOPs, activation and ZeRO memory, schedules' memory, predict()."""

import dataclasses

import numpy as np
import pytest

from plait import Plan, TrainSpec
from plait.cost import predict
from plait.cost.comm import Group, all_gather, all_reduce, members_per_node, p2p, reduce_scatter
from plait.cost.activations import Dtypes, activation_bytes
from plait.cost.compute import layer_flops, model_flops_per_step
from plait.cost.layout import Setting
from plait.plan import Layout
from plait.cost.memory import in_flight, model_state_bytes, rank_memory
from published import ZERO_PSI, ZERO_ROWS
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.models import MODEL_PRESETS

A100 = CLUSTER_PRESETS["a100-80g"]
GPT175 = MODEL_PRESETS["gpt3-175b"]


def test_group_inside_a_node_uses_nvlink():
    nbytes = 1e9
    inside = all_reduce(nbytes, Group(8, 1), A100)
    assert inside == pytest.approx(2 * 7 * A100.intra_node.latency_s + 2 * 7 / 8 * nbytes / A100.intra_node.bandwidth)


def test_group_across_nodes_is_slower_and_uses_all_adapters():
    nbytes = 1e9
    inside = all_reduce(nbytes, Group(8, 1), A100)
    full_nodes = all_reduce(nbytes, Group(32, 1), A100)  # 8 members per node: 8 adapters side by side
    one_per_node = all_reduce(nbytes, Group(32, 8), A100)  # stride 8: one member (one adapter) per node
    assert inside < full_nodes < one_per_node
    assert members_per_node(Group(32, 8), 8) == 1 and members_per_node(Group(16, 2), 8) == 4
    # 8 x 24 GB/s = 192 GB/s: the nccl-tests figure between DGX A100 nodes.
    assert full_nodes == pytest.approx(2 * 31 / 32 * nbytes / 192e9, rel=0.05)  # + 62 ring-step latencies


def test_gather_and_scatter_move_half_an_all_reduce():
    g = Group(8, 1)
    assert all_gather(1e9, g, A100) + reduce_scatter(1e9, g, A100) == pytest.approx(all_reduce(1e9, g, A100))
    assert all_reduce(1e9, Group(1), A100) == 0.0
    assert p2p(1e6, True, A100) > p2p(1e6, False, A100)


def test_flops_match_megatron_formula():
    # 72·B·L·s·h²·(1 + s/(6h) + V/(12·h·L)) model FLOPs per iteration (Korthikanti et al.).
    m, b, s = GPT175, 8, 2048
    h, L, V = m.hidden_size, m.num_layers, m.vocab_size
    expected = 72 * b * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert model_flops_per_step(m, b, s) == pytest.approx(expected, rel=1e-3)  # biases aside
    dense, attn = layer_flops(m, s, s)
    assert dense == pytest.approx(24 * s * h * h, rel=1e-3) and attn == 4 * s * s * h


SIXTEEN_BIT = Dtypes(compute=2, residual=2)


@pytest.mark.parametrize("tp,sp,mode,coefficient", [
    (1, False, "none", lambda a, s, h, t: 32 + 2 * a * s / h),
    (8, False, "none", lambda a, s, h, t: 8 + 24 / t + 2 * a * s / (h * t)),
    (8, True, "none", lambda a, s, h, t: 4 + 28 / t + 2 * a * s / (h * t)),
    (8, False, "selective", lambda a, s, h, t: 8 + 24 / t),
    (1, False, "full", lambda a, s, h, t: 2),
])
def test_math_path_keeps_korthikanti_table_without_dropout(tp, sp, mode, coefficient):
    """Korthikanti et al. 2022, Table 2, for plait's executor: no dropout (34 - 2 sbh of masks; 2as²b of
    probabilities instead of 5as²b), LayerNorm statistics in fp32 (16 bytes per token), and under sequence
    parallelism the all-gathered inputs of the column-parallel linears kept whole (torch's SP; Megatron keeps the
    shards: 34/t)."""
    m, b, s = GPT175.replace(attention="math"), 1, 2048
    a, h = m.num_heads, m.hidden_size
    stats = 16 / (tp if sp else 1) if mode != "full" else 0
    expected = s * b * h * coefficient(a, s, h, tp) + s * b * stats
    assert activation_bytes(m, b, s, tp, sp, mode, SIXTEEN_BIT) == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_fused_attention_keeps_activations_linear_in_the_sequence(mode):
    for model in (GPT175, MODEL_PRESETS["llama3-8b"]):
        short = activation_bytes(model, 2, 4096, 1, False, mode, SIXTEEN_BIT)
        assert activation_bytes(model, 2, 8192, 1, False, mode, SIXTEEN_BIT) == pytest.approx(2 * short)
        assert activation_bytes(model, 1, 4096, 1, False, mode, SIXTEEN_BIT) == pytest.approx(short / 2)


def test_fused_attention_keeps_the_logsumexp_instead_of_the_probabilities():
    m, b, s = GPT175, 1, 2048
    math = activation_bytes(m.replace(attention="math"), b, s, 1, False, "none", SIXTEEN_BIT)
    fused = activation_bytes(m, b, s, 1, False, "none", SIXTEEN_BIT)
    assert math - fused == pytest.approx(b * s * m.num_heads * (2 * s - 4))


def test_selective_keeps_what_torchtitans_op_policy_saves():
    """Llama 3 8B: block input, the 1st, 3rd, 5th and 7th GEMM outputs (q, v, gate, down), the attention output
    and its logsumexp."""
    m = MODEL_PRESETS["llama3-8b"]
    h, q, kv, f, a = m.hidden_size, m.q_size, m.kv_size, m.ffn_hidden_size, m.num_heads
    per_token = 2 * (h + q + kv + f + h + q) + 4 * a
    assert activation_bytes(m, 2, 8192, 1, False, "selective", SIXTEEN_BIT) == pytest.approx(2 * 8192 * per_token)


@pytest.mark.parametrize("nd", sorted(ZERO_ROWS))
def test_zero_model_states_match_the_paper(nd):
    train = TrainSpec(global_batch=8, seq_len=8)
    for stage, published in zip((1, 2, 3), ZERO_ROWS[nd]):
        gb = sum(model_state_bytes(ZERO_PSI, nd, stage, train).values()) / 1e9
        decimals = len(str(published).split(".")[1])  # exact to the digits the paper prints (41.25 -> 41.3)
        assert abs(gb - published) <= 0.5 * 10**-decimals + 1e-12
    assert sum(model_state_bytes(ZERO_PSI, nd, 0, train).values()) == 16 * ZERO_PSI


def test_in_flight_per_schedule():
    base = dict(dp=1, tp=1, sequence_parallel=False, zero=0, micro_batch=1)
    one = Layout.make(pp=4, num_micro_batches=8, schedule="1f1b", interleave=1, **base)
    assert [in_flight(one, r) for r in range(4)] == [4, 3, 2, 1]
    gpipe = Layout.make(pp=4, num_micro_batches=8, schedule="gpipe", interleave=1, **base)
    assert in_flight(gpipe, 3) == 8
    inter = Layout.make(pp=4, num_micro_batches=8, schedule="interleaved", interleave=2, **base)
    assert in_flight(inter, 0) == pytest.approx(4 * (1 + 3 / 8))  # Korthikanti: p·(1 + (p-1)/(p·v))


def test_memory_falls_with_more_recompute():
    setting = Setting(GPT175, A100, TrainSpec(global_batch=64, seq_len=2048))
    layout = Layout.make(dp=1, tp=8, pp=8, sequence_parallel=True, zero=0, micro_batch=1, num_micro_batches=64, schedule="1f1b",
                    interleave=1)
    totals = [rank_memory(setting, layout, 0, mode).total(12) for mode in ("none", "selective", "full")]
    assert totals[0] > totals[1] > totals[2]


def _plan(**kw):
    base = dict(dp=2, tp=8, pp=8, sequence_parallel=True, zero=1, recompute=("selective",), micro_batch=1,
                num_micro_batches=32, schedule="1f1b", model=GPT175, train=TrainSpec(global_batch=64, seq_len=2048),
                cluster=A100.with_devices(128))
    base.update(kw)
    return Plan.of(**base)


def test_predict_parts_add_up_and_recompute_costs_time():
    sel, full = predict(_plan()), predict(_plan(recompute=("full",)))
    assert sum(sel.step_time_parts.values()) == pytest.approx(sel.step_time_s)
    assert sum(sel.memory_parts.values()) == pytest.approx(sel.peak_memory_bytes)
    assert full.step_time_s > sel.step_time_s and full.peak_memory_bytes < sel.peak_memory_bytes
    assert len(sel.memory_per_stage) == 8 and max(sel.memory_per_stage) == sel.peak_memory_bytes
    assert sel.memory_per_stage[0] > sel.memory_per_stage[4]  # 1F1B: the first rank holds the most
    assert 0 < sel.mfu < 1 and sel.bubble_fraction == pytest.approx(7 / (32 + 7), rel=0.15)


def test_more_micro_batches_shrink_the_bubble():
    few, many = predict(_plan(num_micro_batches=8, dp=8, cluster=A100.with_devices(512))), predict(_plan())
    assert few.bubble_fraction > many.bubble_fraction


def test_zero_three_saves_memory_and_costs_communication():
    # under a pipeline plait keeps ZeRO-3's parameters gathered through the schedule: one gather per step,
    # as ZeRO-1 on fully_shard, and ZeRO-2's memory
    z1, z2, z3 = predict(_plan(zero=1)), predict(_plan(zero=2)), predict(_plan(zero=3))
    assert z3.step_time_parts["dp_comm"] == pytest.approx(z1.step_time_parts["dp_comm"])
    assert z3.memory_parts["params"] == z2.memory_parts["params"] == z1.memory_parts["params"]
    # without one it shards them, and re-gathers them for every micro-batch's forward and backward
    flat = dict(dp=16, pp=1, layers_per_stage=(), num_micro_batches=4, train=TrainSpec(global_batch=64, seq_len=2048))
    z1, z3 = predict(_plan(zero=1, **flat)), predict(_plan(zero=3, **flat))
    assert z3.memory_parts["params"] < z1.memory_parts["params"]
    assert z3.step_time_parts["dp_comm"] > z1.step_time_parts["dp_comm"]


@pytest.mark.parametrize("layout", [
    Layout.make(dp=16, tp=8, pp=8, sequence_parallel=True, zero=1, micro_batch=1, num_micro_batches=12, schedule="1f1b", interleave=1),
    Layout.make(dp=16, tp=8, pp=8, sequence_parallel=False, zero=3, micro_batch=2, num_micro_batches=6, schedule="interleaved",
           interleave=3),
    Layout.make(dp=128, tp=8, pp=1, sequence_parallel=False, zero=0, micro_batch=1, num_micro_batches=12, schedule="1f1b", interleave=1),
])
def test_search_memory_table_equals_rank_memory_at_an_even_share(layout):
    """The search's table is rank_memory's peak moment at an even share of GPT-3's 96 layers (the plans it keeps
    are priced exactly again)."""
    from plait.cost.memory import memory_table

    setting = Setting(GPT175, A100, TrainSpec(global_batch=1536, seq_len=2048))
    modes = ("none", "selective", "full")
    fixed, per_layer = memory_table(setting, layout, modes)
    share = GPT175.num_layers // layout.pp
    for r in range(layout.pp):
        for i, mode in enumerate(modes):
            exact = rank_memory(setting, layout, r, mode).total(share)
            assert fixed[r, i] + share * per_layer[r, i] == pytest.approx(exact)


def test_closed_form_estimate_is_exact_on_uniform_stages_without_transfers():
    from plait.cost.model import predict_layout

    setting = Setting(GPT175, A100.replace(intra_node=A100.intra_node, inter_node=A100.inter_node),
                      TrainSpec(global_batch=64, seq_len=2048))
    layout = Layout.make(dp=1, tp=8, pp=4, sequence_parallel=True, zero=0, micro_batch=1, num_micro_batches=64, schedule="interleaved",
                    interleave=2)
    layers = (12,) * 8
    exact = predict_layout(setting, layout, layers, ("full",) * 4).step_time_s
    estimate = predict_layout(setting, layout, layers, ("full",) * 4, exact=False).step_time_s
    assert estimate == pytest.approx(exact, rel=0.01)  # the ends and transfers differ a little


# a Hugging Face Llama: its first block keeps the received input itself under full and selective recompute, not
# without (plait.cost.activations.stage_input_is_kept): those modes' moments start from another base
HF_LLAMA70 = dataclasses.replace(MODEL_PRESETS["llama3-70b"], source="hf:llama")


@pytest.mark.parametrize("model, layout", [
    (GPT175, Layout.make(dp=16, tp=8, pp=8, sequence_parallel=True, zero=1, micro_batch=1, num_micro_batches=12, schedule="1f1b",
                         interleave=1)),
    (GPT175, Layout.make(dp=16, tp=8, pp=8, sequence_parallel=False, zero=3, micro_batch=2, num_micro_batches=6,
                         schedule="interleaved", interleave=3)),
    (GPT175, Layout.make(dp=16, tp=8, pp=8, sequence_parallel=True, zero=2, micro_batch=1, num_micro_batches=16, schedule="zbv",
                         interleave=2)),
    (GPT175, Layout.make(dp=128, tp=8, pp=1, sequence_parallel=False, zero=3, micro_batch=1, num_micro_batches=1, schedule="1f1b",
                         interleave=1)),
    (HF_LLAMA70, Layout.make(dp=4, tp=8, pp=8, sequence_parallel=True, zero=1, micro_batch=1, num_micro_batches=16,
                             schedule="interleaved", interleave=2)),
])
def test_memory_moments_are_the_same_whichever_mode_is_asked_first(model, layout):
    """LayoutMemory makes the parts of a moment that no recompute mode changes once, for every mode: each mode's
    moments, their totals and its table column are the very floats a LayoutMemory asked for that mode alone gives,
    in whatever order the modes are asked (a mode whose first block keeps its input starts from another base)."""
    from plait.cost.memory import LayoutMemory

    setting = Setting(model, A100, TrainSpec(global_batch=1536, seq_len=2048))
    modes = ("none", "selective", "full")
    share = -(-model.num_layers // layout.pp)
    alone = {}
    for mode in modes:
        memory = LayoutMemory(setting, layout)
        alone[mode] = (memory.moments(mode), memory.coefficients(mode, share), memory._moment_totals[mode])
    for order in (modes, modes[::-1], ("selective", "full", "none")):
        memory = LayoutMemory(setting, layout)
        memory.floor()  # the search asks for full recompute's loss moment first
        for mode in order:
            (lines, present), coefficients, totals = alone[mode]
            got_lines, got_present = memory.moments(mode)
            assert [np.array_equal(a, b) for a, b in zip(got_present, present)] == [True] * len(present)
            for (fixed, per_layer), (want_fixed, want_per_layer) in zip(got_lines, lines):
                assert list(fixed) == list(want_fixed) and list(per_layer) == list(want_per_layer)
                assert all(np.array_equal(fixed[k], want_fixed[k]) for k in fixed), mode
                assert all(np.array_equal(per_layer[k], want_per_layer[k]) for k in per_layer), mode
            for got, want in zip(memory._moment_totals[mode], totals):
                assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), mode
            for got, want in zip(memory.coefficients(mode, share), coefficients):
                assert np.array_equal(got, want), mode


@pytest.mark.parametrize("layout", [
    Layout.make(dp=2, tp=8, pp=8, sequence_parallel=True, zero=1, micro_batch=1, num_micro_batches=12, schedule="1f1b", interleave=1),
    Layout.make(dp=2, tp=8, pp=8, sequence_parallel=True, zero=2, micro_batch=1, num_micro_batches=16, schedule="dualpipev",
                interleave=2),
    Layout.make(dp=1, tp=8, pp=1, sequence_parallel=True, zero=0, micro_batch=1, num_micro_batches=4, schedule="1f1b", interleave=1),
])
def test_states_overflow_is_every_ranks_held_states_against_its_memory(layout):
    """states_overflow adds up each pipeline rank's held states (ranks holding the same ends computed once) less the
    devices' memory: the sum over the ranks, one by one, to the float."""
    from plait.cost.memory import held_states, states_overflow

    setting = Setting(GPT175, A100, TrainSpec(global_batch=1536, seq_len=2048))
    need = have = 0.0
    for r in range(layout.pp):
        fixed, per_layer = held_states(setting, layout, r)
        need += sum(fixed.values()) + GPT175.num_layers / layout.pp * sum(per_layer.values())
        have += A100.memory_bytes
    assert states_overflow(setting, layout) == need - have
    assert need > 0 and have > 0
