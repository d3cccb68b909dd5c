"""When data-parallel gradients are reduced under accumulation (Plan.grad_sync): the plan says, legality bounds it,
the cost model prices each way (memory and communication)."""

from __future__ import annotations

import json

import pytest

from plait import legality
from plait.cost import predict
from plait.plan import Plan
from plait.spec import TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.models import MODEL_PRESETS


def _plan(grad_sync: str = "step", zero: int = 3, **fields) -> Plan:
    fields.setdefault("dp", 8)
    m = fields.pop("num_micro_batches", 4)
    return Plan.of(zero=zero, micro_batch=1, num_micro_batches=m, grad_sync=grad_sync, recompute=("full",),
                   model=MODEL_PRESETS["llama2-13b"], train=TrainSpec(global_batch=fields["dp"] * m, seq_len=4096,
                                                                     precision="bf16"),
                   cluster=CLUSTER_PRESETS["a100-80g"].with_devices(8), **fields)


def test_a_plan_without_the_field_reduces_once_a_step_as_before():
    data = json.loads(_plan("micro_batch").to_json())
    assert Plan.from_dict(data).grad_sync == "micro_batch"
    del data["grad_sync"]
    assert Plan.from_dict(data).grad_sync == "step"


def test_an_unknown_value_and_a_pipeline_are_refused_with_what_works():
    with pytest.raises(ValueError, match="grad_sync='sometimes' is not one of step, micro_batch"):
        _plan("sometimes")
    problems = legality.plan_problems(_plan("micro_batch", dp=4, pp=2))
    assert [p.rule for p in problems] == ["grad-sync-under-pipeline"]
    assert "use grad_sync='step'" in problems[0].message


def test_zero3_holds_sharded_gradients_when_reduced_every_micro_batch():
    step, every = predict(_plan("step")), predict(_plan("micro_batch"))
    whole = MODEL_PRESETS["llama2-13b"].num_params * 4  # fp32 gradients of the whole model
    assert step.memory_parts["grads"] == pytest.approx(whole, rel=0.02)
    assert every.memory_parts["grads"] == pytest.approx(whole / 8, rel=0.02)  # a shard of 8
    assert every.step_time_s > step.step_time_s  # three more reduce-scatters a step


def test_ddp_pays_an_all_reduce_per_micro_batch_for_nothing():
    step, every = predict(_plan("step", zero=0, dp=2)), predict(_plan("micro_batch", zero=0, dp=2))
    assert every.memory_parts["grads"] == step.memory_parts["grads"]
    assert every.step_time_s > step.step_time_s


def test_one_micro_batch_has_nothing_to_choose():
    one = predict(_plan("micro_batch", num_micro_batches=1))
    assert one.step_time_s == predict(_plan("step", num_micro_batches=1)).step_time_s
