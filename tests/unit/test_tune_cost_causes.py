"""The causes `plait tune` found on CPU processes, as the cost model now prices them: fixed host time per
layer pass (more under DTensor), no communication/compute overlap on CPU ranks, one collective per FSDP
unit, and plait's ZeRO-1 (DDP + ZeroRedundancyOptimizer) all-reducing in full."""

from __future__ import annotations

import dataclasses

import pytest

from plait.cost import comm, predict
from plait.plan import Plan
from plait.spec import TrainSpec
from plait.spec.cluster import ClusterSpec, Efficiency, LinkSpec
from plait.spec.models import MODEL_PRESETS

MODEL = MODEL_PRESETS["tiny-gpt"]
TRAIN = TrainSpec(global_batch=8, seq_len=128, precision="fp32")
LINK = LinkSpec(latency_s=1e-3, bandwidth=1e9)
CPU = ClusterSpec(name="cpu4", num_devices=4, devices_per_node=4, memory_bytes=4 * 2**30, peak_flops=2e10,
                  efficiency=Efficiency(matmul=1.0, overhead=0.3), intra_node=LINK, inter_node=LINK,
                  device_type="cpu", backend="gloo")


def plan(cluster: ClusterSpec = CPU, **fields) -> Plan:
    fields = {"dp": 4, "tp": 1, "pp": 1, "micro_batch": 1, "num_micro_batches": 2, **fields}
    return Plan.of(model=MODEL, train=TRAIN, cluster=cluster, **fields)


def with_host(**changes) -> ClusterSpec:
    return CPU.replace(host=dataclasses.replace(CPU.host, **changes))


def step(p: Plan) -> float:
    return predict(p).step_time_s


@pytest.mark.parametrize("dp,tp,pp,mb,count", [(4, 1, 1, 1, 2), (4, 1, 1, 2, 1), (1, 4, 1, 1, 8), (1, 1, 4, 1, 8)])
def test_layer_overhead_costs_three_passes_per_layer_and_micro_batch(dp, tp, pp, mb, count):
    base = plan(dp=dp, tp=tp, pp=pp, micro_batch=mb, num_micro_batches=count)
    slow = base.replace(cluster=with_host(layer_overhead_s=1e-3))
    added = step(slow) - step(base)
    per_rank_passes = 3 * MODEL.num_layers * count  # forward once, backward twice
    if pp == 1:
        assert added == pytest.approx(per_rank_passes * 1e-3, rel=1e-6)
    else:  # the bottleneck stage holds num_layers / pp, and the fill and drain add some more
        assert per_rank_passes * 1e-3 / pp < added < per_rank_passes * 1e-3


def test_tp_layer_overhead_touches_only_tensor_parallel_plans():
    cluster = with_host(tp_layer_overhead_s=2e-3)
    assert step(plan(cluster=cluster)) == step(plan())
    tp = plan(dp=1, tp=4, num_micro_batches=8)
    added = step(tp.replace(cluster=cluster)) - step(tp)
    # three per layer pass (forward 1, backward 2), and one for the vocabulary-parallel loss, per micro-batch
    assert added == pytest.approx((3 * MODEL.num_layers + 1) * 8 * 2e-3, rel=1e-6)


def test_cpu_ranks_do_not_overlap_data_parallel_communication():
    cpu = plan(zero=3)
    gpu = cpu.replace(cluster=CPU.replace(device_type="cuda", backend="nccl"))
    assert predict(cpu).step_time_parts["dp_comm"] > predict(gpu).step_time_parts["dp_comm"]
    full = comm.all_reduce(params_bytes(cpu), comm.Group(4, 1), CPU)
    assert predict(plan()).step_time_parts["dp_comm"] == pytest.approx(full, rel=1e-6)


def params_bytes(p: Plan) -> float:
    return MODEL.num_params * TRAIN.param_bytes


def test_fsdp_pays_latency_per_unit():
    """ZeRO-3 gathers each layer separately: more layers, more latency, at the same volume."""
    cheap = CPU.replace(intra_node=LinkSpec(latency_s=1e-6, bandwidth=1e9))
    cheap = cheap.replace(inter_node=cheap.intra_node)
    slow_latency = step(plan(zero=3)) - step(plan(zero=3, cluster=cheap))
    # per unit: a gather for each of the 2 micro-batches' forward and backward, one reduce-scatter at the end
    calls = (2 * 2 + 1) * (MODEL.num_layers + 1)
    per_call = (4 - 1) * (1e-3 - 1e-6)  # ring steps x latency
    assert slow_latency == pytest.approx(calls * per_call, rel=0.02)


def test_plait_zero1_on_ddp_all_reduces_in_full():
    zero0, zero1 = predict(plan(zero=0)), predict(plan(zero=1))
    gather = comm.all_gather(params_bytes(plan()), comm.Group(4, 1), CPU)
    assert zero1.step_time_parts["dp_comm"] == pytest.approx(zero0.step_time_parts["dp_comm"] + gather, rel=1e-6)


def test_idle_pipeline_stages_lend_their_cores():
    """4 ranks on 2 cores (oversubscription 2): with one micro-batch, GPipe keeps one stage busy at a time,
    which then runs twice as fast as when all compute; plans without a pipeline keep every rank busy."""
    shared = CPU.replace(oversubscription=2.0)
    serial = plan(dp=1, pp=4, micro_batch=8, num_micro_batches=1, schedule="gpipe")
    assert step(serial.replace(cluster=shared)) == pytest.approx(step(serial) / 2, rel=0.05)
    flat = plan()
    assert step(flat.replace(cluster=shared)) == step(flat)
    # with 8 micro-batches the stages idle only in the fill and drain: the node's work bounds the gain
    full = plan(dp=1, pp=4, micro_batch=1, num_micro_batches=8, schedule="1f1b")
    busy = predict(full).step_time_parts
    work = busy["compute"] + busy["recompute"] + busy["tp_comm"]  # the busiest rank's share, at the shared rate
    assert step(full) / 2 < step(full.replace(cluster=shared)) < step(full) - 0.5 * busy["bubble"]
    assert step(full.replace(cluster=shared)) > 0.8 * work
    with pytest.raises(ValueError, match="oversubscription"):
        CPU.replace(oversubscription=0.5)


def test_dtensor_parameters_cost_host_time_per_tensor():
    cluster = with_host(dtensor_param_overhead_s=1e-3)
    tensors = 16 * MODEL.num_layers + 5  # plait's GPT: 16 per layer; embeddings, final norm, head
    for sharded in (plan(zero=2), plan(zero=3), plan(dp=1, tp=4, num_micro_batches=8)):
        added = step(sharded.replace(cluster=cluster)) - step(sharded)
        assert added == pytest.approx(tensors * 1e-3, rel=1e-6)
    for plain in (plan(zero=0), plan(zero=1)):  # DDP: plain tensors
        assert step(plain.replace(cluster=cluster)) == step(plain)


def test_tensor_parallel_parameters_cost_more_per_tensor():
    cluster = with_host(tp_param_overhead_s=1e-3)
    tensors = 16 * MODEL.num_layers + 5
    tp = plan(dp=1, tp=4, num_micro_batches=8)
    assert step(tp.replace(cluster=cluster)) - step(tp) == pytest.approx(tensors * 1e-3, rel=1e-6)
    for other in (plan(zero=0), plan(zero=2), plan(zero=3)):  # fully_shard's DTensors are all sharded alike
        assert step(other.replace(cluster=cluster)) == step(other)


@pytest.mark.parametrize("fields,sharded", [
    ({"zero": 2}, True), ({"zero": 3}, True), ({"dp": 2, "tp": 2, "zero": 0, "num_micro_batches": 4}, True),
    ({"dp": 2, "pp": 2, "zero": 1, "num_micro_batches": 4, "schedule": "1f1b"}, True),
    ({"zero": 0}, False), ({"zero": 1}, False), ({"dp": 1, "tp": 4, "num_micro_batches": 8}, False)])
def test_fsdp_hooks_cost_host_time_per_layer_pass_only_on_fully_shard(fields, sharded):
    base = plan(**fields)
    added = step(base.replace(cluster=with_host(fsdp_layer_overhead_s=1e-3))) - step(base)
    if not sharded:  # DDP, or no data parallelism: no fully_shard hooks
        assert added == 0
    elif base.pp == 1:
        assert added == pytest.approx(3 * MODEL.num_layers * base.num_micro_batches * 1e-3, rel=1e-6)
    else:  # the bottleneck stage's share, plus some of the fill and drain
        passes = 3 * MODEL.num_layers * base.num_micro_batches
        assert passes * 1e-3 / base.pp < added < passes * 1e-3


@pytest.mark.parametrize("fields", [{}, {"zero": 3}, {"dp": 1, "tp": 4, "num_micro_batches": 8},
                                    {"dp": 1, "pp": 4, "num_micro_batches": 8, "schedule": "1f1b"}])
def test_step_overhead_is_paid_once_per_step_whatever_the_plan(fields):
    base = plan(**fields)
    slow = base.replace(cluster=with_host(step_overhead_s=5e-3))
    assert step(slow) - step(base) == pytest.approx(5e-3, rel=1e-6)
    assert predict(slow).step_time_parts["optimizer"] - predict(base).step_time_parts["optimizer"] == \
        pytest.approx(5e-3, rel=1e-6)


@pytest.mark.parametrize("pp,schedule,interleave", [(4, "gpipe", 1), (4, "1f1b", 1), (2, "interleaved", 2)])
def test_pipeline_overhead_is_paid_per_stage_pass_and_only_under_a_pipeline(pp, schedule, interleave):
    cluster = with_host(pipeline_overhead_s=2e-3)
    flat = plan()
    assert step(flat.replace(cluster=cluster)) == step(flat)
    added = {}
    for m in (pp, 2 * pp):
        p = plan(dp=4 // pp, pp=pp, num_micro_batches=m, micro_batch=8 * pp // 4 // m, schedule=schedule,
                 interleave=interleave)
        added[m] = step(p.replace(cluster=cluster)) - step(p)
    # each micro-batch passes every virtual stage forward and backward: at least the bottleneck rank's share
    for m, seconds in added.items():
        assert seconds >= 2 * m * interleave * 2e-3 * (1 - 1e-9)
    assert added[2 * pp] > added[pp]
