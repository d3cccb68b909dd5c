"""The loss beyond the head: under tensor parallelism torch's loss_parallel all-reduces three per-token statistics and
dispatches its ops through DTensor; the cost model prices both, and `plait train` measures the loss as waiting."""

from __future__ import annotations


import pytest

from plait.cost import predict
from plait.cost.comm import Group, all_reduce
from plait.cost.compute import LOSS_PARALLEL_ALL_REDUCES
from plait.cost.layout import Setting
from plait.cost.model import pipeline_stage_times
from plait.plan import Plan
from plait.spec import TrainSpec
from plait.spec.cluster import ClusterSpec, Efficiency, HostOverheads, LinkSpec
from plait.spec.models import MODEL_PRESETS
from plait.train.measure import Parts

MODEL = MODEL_PRESETS["tiny-llama"]
TRAIN = TrainSpec(global_batch=8, seq_len=128, precision="fp32")
LINK = LinkSpec(latency_s=200e-6, bandwidth=1e9)
CLUSTER = ClusterSpec(name="cpu2", num_devices=2, devices_per_node=2, memory_bytes=4 * 2**30, peak_flops=2e10,
                      efficiency=Efficiency(matmul=1.0, matmul_half_dim=64.0, overhead=0.3),
                      intra_node=LINK, inter_node=LINK, device_type="cpu", backend="gloo",
                      host=HostOverheads(tp_layer_overhead_s=4e-3))


def priced(**degrees) -> Plan:
    plan = Plan.of(model=MODEL, train=TRAIN, cluster=CLUSTER, **degrees)
    return plan.replace(predicted=predict(plan))


def test_the_vocabulary_parallel_loss_costs_its_all_reduces_and_a_tp_pass_of_host_time_per_micro_batch():
    for micro_batch, count in ((1, 8), (4, 2)):
        plan = priced(dp=1, tp=2, pp=1, micro_batch=micro_batch, num_micro_batches=count)
        tokens = micro_batch * TRAIN.seq_len
        statistics = LOSS_PARALLEL_ALL_REDUCES * all_reduce(tokens * 4.0, Group(2, 1), CLUSTER)
        expected = count * (statistics + CLUSTER.host.tp_layer_overhead_s)
        assert plan.predicted.step_time_parts["loss"] == pytest.approx(expected, rel=1e-9)
        assert plan.predicted.step_time_s == pytest.approx(sum(plan.predicted.step_time_parts.values()), rel=1e-9)


def test_without_tensor_parallelism_the_loss_is_the_heads_own():
    plan = priced(dp=2, tp=1, pp=1, micro_batch=1, num_micro_batches=4)
    assert plan.predicted.step_time_parts["loss"] == 0.0


def test_the_loss_counts_as_waiting_where_the_run_measures_it():
    plan = priced(dp=1, tp=2, pp=1, micro_batch=1, num_micro_batches=8)
    parts = plan.predicted.step_time_parts
    grouped = Parts.of_prediction(plan.predicted.step_time_s, parts)
    assert grouped.waiting == pytest.approx(parts["loss"] + parts["bubble"] + parts["pp_comm"] + parts["dp_comm"])
    assert grouped.compute + grouped.waiting + grouped.optimizer == pytest.approx(plan.predicted.step_time_s)


def test_a_pipeline_pays_the_loss_on_its_last_stage_only():
    """The loss lengthens the last stage's passes, and only its."""
    plan = priced(dp=1, tp=2, pp=2, micro_batch=1, num_micro_batches=8, schedule="1f1b")
    setting, layout = Setting(plan.model, plan.cluster, plan.train), plan.layout
    st, _ = pipeline_stage_times(setting, layout, plan.layers_per_stage, plan.recompute)
    assert st.loss[0] == 0.0 < st.loss[1]
    quiet = CLUSTER.replace(host=HostOverheads())
    st_quiet, _ = pipeline_stage_times(Setting(plan.model, quiet, plan.train), layout, plan.layers_per_stage,
                                       plan.recompute)
    # the host time of the loss's dispatch, on the last stage's passes; its all-reduces remain without it
    assert st.fwd[1] + st.bwd[1] - st_quiet.fwd[1] - st_quiet.bwd[1] > CLUSTER.host.tp_layer_overhead_s
    assert st_quiet.loss[1] > 0


@pytest.mark.parametrize("model, degrees", [
    ("tiny-moe", dict(dp=2, tp=1, pp=1, ep=2, micro_batch=1, num_micro_batches=4)),
    ("tiny-llama", dict(dp=1, tp=1, pp=1, cp=2, micro_batch=1, num_micro_batches=8)),
])
def test_every_part_of_a_prediction_is_grouped_as_the_run_measures_it(model, degrees):
    """Expert dispatch and the context exchange run inside the layers: they count as compute, and nothing the cost
    model prices falls outside the three measured parts."""
    plan = Plan.of(model=MODEL_PRESETS[model], train=TRAIN, cluster=CLUSTER, **degrees)
    predicted = predict(plan)
    exchange = predicted.step_time_parts["ep_comm"] + predicted.step_time_parts["cp_comm"]
    assert exchange > 0
    grouped = Parts.of_prediction(predicted.step_time_s, predicted.step_time_parts)
    assert grouped.compute + grouped.waiting + grouped.optimizer == pytest.approx(predicted.step_time_s)
    assert grouped.compute >= exchange + predicted.step_time_parts["compute"]
