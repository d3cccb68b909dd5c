"""Dynamic load balancing's decisions (plait/train/adapt.py), from synthetic timings: who is a straggler, the
clusters it re-plans on, the plan it picks, and when a switch pays. The switch itself runs in
tests/dist/test_adapt_run.py."""

from __future__ import annotations

import dataclasses

import pytest

from plait.cost import predict
from plait.cost.compute import layer_cost
from plait.plan import Plan
from plait.spec import ModelSpec, TrainSpec
from plait.spec.cluster import HostOverheads
from plait.spec.clusters import CLUSTER_PRESETS
from plait.train.adapt import (
    ADAPT_MARGIN, Adaptation, current_on_speeds, rank_speeds, replan, slowed_peak, speed_view,
)
from plait.train.config import Config, PlanConfig
from plait.train.measure import RankRecord, predicted_segment

MODEL = ModelSpec(name="adapt-gpt", arch="gpt", num_layers=8, hidden_size=128, num_heads=4, vocab_size=256,
                  max_seq_len=128)
TRAIN = TrainSpec(global_batch=16, seq_len=64, precision="fp32")
CLUSTER = CLUSTER_PRESETS["local-cpu"].replace(num_devices=4, devices_per_node=4,
                                               host=HostOverheads(layer_overhead_s=5e-4, step_overhead_s=5e-3))
EVEN = Plan.of(dp=4, tp=1, pp=1, micro_batch=2, num_micro_batches=2, model=MODEL, train=TRAIN, cluster=CLUSTER)
SLOW = [1.0, 1.0, 1.0, 3.0]


def measured_segment(plan: Plan, speeds: list[float], steps: int = 8, step_s: float | None = None):
    """A segment of `plan` whose ranks computed their predictions times their speed (the slowest rank of a
    pipeline rank's block sets everyone's step)."""
    segment = predicted_segment(plan)
    block = plan.dp * plan.cp * plan.tp
    step = step_s or segment.predicted.step * max(speeds)
    for rank in range(plan.num_devices):
        pp_rank = rank // block if not plan.stage_groups else _pp_rank(plan, rank)
        compute = segment.predicted_rank_compute[pp_rank] * speeds[rank]
        record = RankRecord(rank=rank, pp_rank=pp_rank)
        for k in range(steps):
            record.add(k + 1, step, step - 0.001, compute * (1 + 0.01 * (k % 3 - 1)), 0.001)
        segment.ranks.append(record)
    return segment


def _pp_rank(plan: Plan, rank: int) -> int:
    from plait.execute.mesh import rank_order

    block = plan.dp * plan.cp * plan.tp
    return rank_order(plan).index(rank) // block


def adaptation(plan: Plan = EVEN, build_s: float = 0.0) -> Adaptation:
    config = Config(plan=PlanConfig(adapt=True))
    return Adaptation(config, plan, "/nonexistent", build_s, rank=1)  # rank 1 writes nothing


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("tp", [1, 2])
def test_slowed_peak_makes_one_layer_pass_factor_times_slower(device_type, tp):
    """Host time does not scale with peak_flops, yet a slow rank is slow at all of its block: the peak is lowered
    further, so the whole pass takes the factor. How kernels and host time add up is the cost model's
    (plait.cost.compute.pass_time: summed on CPU processes, overlapped on a GPU, where the host-bound pass here
    only slows once its kernels outgrow the host time): the factor holds under both rules, and with the extra host
    time of a tensor-parallel pass."""
    host = HostOverheads(layer_overhead_s=5e-4, tp_layer_overhead_s=2e-3, step_overhead_s=5e-3)
    cluster = CLUSTER.replace(device_type=device_type, host=host)
    plan = Plan.of(dp=4 // tp, tp=tp, pp=1, micro_batch=2, num_micro_batches=2 * tp, model=MODEL, train=TRAIN,
                   cluster=cluster)

    def layer(c):
        lc = layer_cost(MODEL, c, TRAIN.seq_len, 2, tp, plan.sequence_parallel, 4)
        return lc.fwd + lc.bwd

    for factor in (1.5, 3.0, 40.0):
        slow = cluster.replace(peak_flops=slowed_peak(cluster, plan, factor))
        assert layer(slow) == pytest.approx(factor * layer(cluster), rel=1e-9)
    assert slowed_peak(cluster, plan, 1.0) == cluster.peak_flops


def test_speed_views_group_consecutive_ranks_at_their_slowest():
    per_rank = speed_view(CLUSTER, EVEN, SLOW, [(r, 1) for r in range(4)])
    assert [(g.name, g.num_devices) for g in per_rank.groups] == [("ranks0-2", 3), ("rank3", 1)]
    assert per_rank.groups[1].peak_flops < per_rank.groups[0].peak_flops == CLUSTER.peak_flops
    pairs = speed_view(CLUSTER, EVEN, SLOW, [(0, 2), (2, 2)])
    assert [(g.name, g.num_devices) for g in pairs.groups] == [("ranks0-1", 2), ("ranks2-3", 2)]
    whole = speed_view(CLUSTER, EVEN, SLOW, [(0, 4)])
    assert not whole.groups and whole.peak_flops == per_rank.groups[1].peak_flops
    assert speed_view(CLUSTER, EVEN, [1.0] * 4, [(r, 1) for r in range(4)]) == CLUSTER


def test_replan_gives_the_slow_rank_less_work_and_beats_the_even_plan():
    new = replan(EVEN, CLUSTER, SLOW, {})
    assert new.stage_groups, new.describe()  # a plan over groups of ranks at their own speed
    offsets = new.cluster.group_offsets()
    slow_group = next(name for name, first in offsets.items() if first + new.cluster.group(name).num_devices - 1 == 3)
    layers = [sum(new.layers_per_stage[k] for k in new.stages_of_rank(r)) for r in range(new.pp)]
    slow_layers = [n for n, g in zip(layers, new.stage_groups) if g == slow_group]
    assert max(slow_layers) < max(layers)
    even_there = predict(current_on_speeds(EVEN, CLUSTER, SLOW)).step_time_s
    assert new.predicted.step_time_s < 0.8 * even_there


def test_a_straggler_is_found_and_the_switch_made_when_it_pays():
    decision, speeds, _ = adaptation().decide(measured_segment(EVEN, SLOW), step=8, total=200)
    assert decision.action == "switch", decision.reason
    assert "rank 3 computes 3.00x the median rank" in decision.reason
    assert speeds == SLOW
    assert decision.figures["new_expected_step_s"] < decision.figures["measured_step_s"]
    assert Plan.from_dict(decision.plan).stage_groups


def test_no_switch_when_the_steps_left_do_not_pay_for_it(monkeypatch):
    monkeypatch.delenv("PLAIT_ADAPT_SWITCH_S", raising=False)
    decision, _, _ = adaptation(build_s=30.0).decide(measured_segment(EVEN, SLOW), step=8, total=12)
    assert decision.action == "stay" and "the switch costs" in decision.reason
    assert decision.figures["saved_s"] < decision.figures["switch_cost_s"]


def test_ranks_within_the_margin_keep_the_plan():
    close = [1.0, 1.0 + ADAPT_MARGIN / 2, 1.0, 1.0 - ADAPT_MARGIN / 3]
    segment = measured_segment(EVEN, close, step_s=predicted_segment(EVEN).predicted.step)
    decision, speeds, _ = adaptation().decide(segment, step=8, total=200)
    assert decision.action == "keep" and speeds == [1.0] * 4


def test_after_a_switch_each_rank_is_expected_at_its_own_speed():
    """In the switched-to plan rank 2 shares a pipeline rank with slow rank 3: the prediction prices both at rank
    3's speed, and rank 2 computing at its own speed is no straggler the other way."""
    pairs = speed_view(CLUSTER, EVEN, SLOW, [(0, 2), (2, 2)])
    plan = Plan.of(dp=2, tp=1, pp=2, micro_batch=2, num_micro_batches=4, layers_per_stage=(6, 2),
                   stage_groups=("ranks0-1", "ranks2-3"), model=MODEL, train=TRAIN, cluster=pairs)
    segment = measured_segment(plan, [1.0, 1.0, 1.0 / 3.0, 1.0])  # rank 2: 3x faster than its block's pace
    relative, _ = rank_speeds(segment, SLOW)
    assert relative == pytest.approx([1.0] * 4, rel=0.02)


def test_decisions_are_logged_with_their_figures():
    decision, _, _ = adaptation().decide(measured_segment(EVEN, SLOW), step=8, total=200)
    record = dataclasses.asdict(decision)
    for key in ("measured_step_s", "predicted_step_s", "rank_compute_vs_median", "speeds", "new_plan",
                "new_expected_step_s", "saved_s", "switch_cost_s"):
        assert key in record["figures"]
    assert decision.line().startswith("plait: adapt at step 8: switch: ")
