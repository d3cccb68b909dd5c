"""The live set of a pipeline rank's receive buffers (plait.cost.live_set): counted from the schedule's own order, flat
in the number of micro-batches, close to torch's own lowering, and what the cost model prices."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.cost import predict
from plait.cost.live_set import LiveBuffers, live_buffers, peak_buffers, with_receives
from published import MegatronRow, megatron_plan
from plait.cost.schedule import stage_rank
from plait.plan import Plan
from plait.spec import ModelSpec, TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS

V = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zbv": 2, "dualpipev": 2}


def test_a_split_backward_holds_its_input_until_the_weight_gradient():
    order = [("RF", 1, 0), ("F", 1, 0), ("RF", 1, 1), ("F", 1, 1), ("RB", 1, 0), ("I", 1, 0), ("RB", 1, 1),
             ("W", 1, 0), ("I", 1, 1), ("W", 1, 1)]
    assert peak_buffers(order) == LiveBuffers(inputs=2, grads=1)
    full = [("RF", 1, 0), ("F", 1, 0), ("RB", 1, 0), ("B", 1, 0), ("RF", 1, 1), ("F", 1, 1)]
    assert peak_buffers(full) == LiveBuffers(inputs=1, grads=1)


@pytest.mark.parametrize("pp", [2, 4])
def test_one_f_one_b_receives_what_it_keeps_in_flight(pp):
    for rank, live in enumerate(live_buffers("1f1b", pp, 16)):
        assert live.inputs == (0 if rank == 0 else min(16, pp - rank))  # the first stage receives no input
        assert live.grads == (0 if rank == pp - 1 else 1)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zbv", "dualpipev"])
@pytest.mark.parametrize("pp", [2, 4])
def test_buffers_stay_flat_in_the_micro_batches(schedule, pp):
    v = V[schedule]
    settled = live_buffers(schedule, pp, 4 * pp, v)
    for m in (8 * pp, 16 * pp):
        assert live_buffers(schedule, pp, m, v) == settled
    assert live_buffers("gpipe", pp, 16 * pp)[-1].inputs == 16 * pp  # GPipe keeps every micro-batch: the contrast


def _torch_peaks(schedule: str, pp: int, m: int) -> list[LiveBuffers]:
    """Peaks over torch's own lowering (pipeline_order_with_comms), built on a fake process group."""
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plait.cost.live_set import torch_order
    from plait.execute.pipeline import SCHEDULE_CLASSES

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        num_stages = 2 * pp
        own = [s for s in range(num_stages) if stage_rank(schedule, pp, s) == 0]
        stages = [PipelineStage(nn.Linear(2, 2), s, num_stages, torch.device("cpu")) for s in own]
        order = SCHEDULE_CLASSES[schedule](stages, n_microbatches=m).pipeline_order_with_comms
        return [peak_buffers(torch_order(order[r])) for r in range(pp)]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule,pp,m", [("interleaved", 2, 8), ("interleaved", 4, 16), ("zbv", 2, 8),
                                           ("zbv", 4, 16), ("dualpipev", 2, 8), ("dualpipev", 4, 16)])
def test_the_cost_model_counts_the_order_torch_runs(schedule, pp, m):
    """The executor sizes its pool over torch's order (plait.execute.pipeline.live_buffers_of); the cost model
    lowers plait's steps as torch does, idle steps and overlapped pairs included (plait.cost.schedule.rank_slots):
    the same buffers on every rank, no allowance."""
    assert live_buffers(schedule, pp, m, 2) == tuple(_torch_peaks(schedule, pp, m))


def test_receives_come_right_before_their_compute_in_the_single_stage_loops():
    order = with_receives("gpipe", 2, 3)[1]
    assert order[:2] == (("RF", 1, 0), ("F", 1, 0)) and ("RB", 1, 0) not in order  # the last stage gets no gradient


def _tiny(schedule: str, m: int) -> Plan:
    model = ModelSpec(name="t", arch="llama", num_layers=8, hidden_size=512, num_heads=8, ffn_hidden_size=1376,
                      vocab_size=4096, max_seq_len=256)
    return Plan.of(pp=4, schedule=schedule, interleave=V[schedule], micro_batch=1, num_micro_batches=m, model=model,
                   train=TrainSpec(global_batch=m, seq_len=256, precision="bf16"),
                   cluster=CLUSTER_PRESETS["a100-80g"].with_devices(4))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zbv", "dualpipev"])
def test_the_cost_model_prices_buffers_flat_in_the_micro_batches(schedule):
    at_8, at_64 = (predict(_tiny(schedule, m)).memory_parts["buffers"] for m in (8, 64))
    assert at_8 > 0 and abs(at_64 / at_8 - 1) <= 0.10


def test_korthikanti_gpt3_175b_fits_on_its_a100s():
    """GPT-3 175B as Korthikanti et al. 2022 ran it (64 A100 80GB, t = 8, p = 8, interleaved with 3 chunks, micro-batch 1,
    global batch 64, full recompute, unfused attention): refused at 122.6 GiB (66.6 GiB of torch's receive buffers)
    before the executor held only what is in flight."""
    plan = megatron_plan(MegatronRow(175.0, 96, 12288, 96, 8, 8, 64, 64, 0.0), CLUSTER_PRESETS["a100-80g"])
    assert (plan.tp, plan.pp, plan.interleave, plan.num_micro_batches) == (8, 8, 3, 64)
    prediction = predict(plan)
    assert prediction.peak_memory_bytes < 80 * 2**30
    assert prediction.memory_parts["buffers"] < 0.1 * prediction.peak_memory_bytes


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zbv", "dualpipev"])
def test_more_micro_batches_than_the_steady_state_needs_hold_the_same_buffers(schedule):
    """live_buffers stops at STEADY_WITHIN x pp micro-batches: the full lowering of more gives the same peaks (every
    count the schedule runs just past it, then up to 12p)."""
    from plait import legality
    from plait.cost.schedule import STEADY_WITHIN

    for pp in range(2, 13):
        v = 3 if schedule == "interleaved" else (2 if schedule in ("zbv", "dualpipev") else 1)
        steady = STEADY_WITHIN * pp
        for m in (steady + 1, steady + 2, steady + pp - 1, steady + pp, 5 * pp, 12 * pp):
            if legality.schedule_problems(schedule, pp, m, v):
                continue
            full = tuple(peak_buffers(order) for order in with_receives(schedule, pp, m, v))
            assert live_buffers(schedule, pp, m, v) == full, (schedule, pp, m)
