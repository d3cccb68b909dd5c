"""`plait tune --from-run` fits one run: one plan's parts. Its fit must hold for the plan the planner picks next
(another micro-batch count): the time the run's layers take beyond the profile goes where a second plan says it
belongs, the host time per layer pass, not the GEMM efficiency the profile measured."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from plait.plan import Plan
from plait.profile.terms import Observation, fit_terms, predicted_time, refusal, separable_terms, with_term_value
from plait.spec import TrainSpec
from plait.spec.cluster import ClusterSpec, Efficiency, LinkSpec
from plait.spec.models import MODEL_PRESETS

MODEL = MODEL_PRESETS["tiny-llama"]
TRAIN = TrainSpec(global_batch=8, seq_len=128, precision="fp32")
LINK = LinkSpec(latency_s=100e-6, bandwidth=1e9)
PROFILED = ClusterSpec(name="profiled", num_devices=2, devices_per_node=2, memory_bytes=4 * 2**30, peak_flops=2e10,
                       efficiency=Efficiency(matmul=1.0, matmul_half_dim=64.0, overhead=0.3),
                       intra_node=LINK, inter_node=LINK, device_type="cpu", backend="gloo")
"""What a profile measured: the GEMM rate right, the model's own host time per layer pass not (its probes run
another model)."""
REAL = with_term_value(PROFILED, "layer_overhead", 4e-3)
"""The machine: a Hugging Face layer's Python costs 4 ms a pass."""


def plan(micro_batch: int) -> Plan:
    return Plan.of(dp=2, tp=1, pp=1, micro_batch=micro_batch, num_micro_batches=4 // micro_batch, model=MODEL,
                   train=TRAIN, cluster=PROFILED)


def run_parts(p: Plan, noise: float = 0.02, seed: int = 0) -> list[Observation]:
    """What `plait tune --from-run` reads from one run: its parts, for two halves of its steps."""
    rng = np.random.default_rng(seed)
    return [Observation(plan=p, part=part, measured_s=predicted_time(p, REAL, part) * (1 + noise * rng.uniform(-1, 1)))
            for _ in range(2) for part in ("compute", "waiting", "optimizer")]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_fit_of_one_run_predicts_the_next_plan(seed):
    """Fitted on a run of 4 micro-batches of 1, the fit predicts one micro-batch of 4 (as many FLOPs, a quarter of
    the layer passes) within 10%; a fit that put the same time into the GEMM efficiency misses it by over 30%."""
    fit = fit_terms(run_parts(plan(1), seed=seed), PROFILED)
    assert refusal(fit) is None and "layer_overhead" in fit.fitted and "compute" not in fit.fitted
    other = plan(4)
    truth = predicted_time(other, REAL)
    assert predicted_time(other, fit.cluster) == pytest.approx(truth, rel=0.10)
    as_gemms = fit_terms(run_parts(plan(1), seed=seed), PROFILED, only=("compute",))
    assert abs(predicted_time(other, as_gemms.cluster) / truth - 1) > 0.30


def test_timings_of_several_plans_may_fit_the_gemm_efficiency():
    one, two = plan(1), plan(4)
    terms = ("compute", "layer_overhead", "step_overhead")
    assert separable_terms(run_parts(one), terms) == ("layer_overhead", "step_overhead")
    assert separable_terms(run_parts(one) + run_parts(two), terms) == terms  # timed in one launch
    apart = [dataclasses.replace(o, launch="runs/a") for o in run_parts(one)] + \
        [dataclasses.replace(o, launch="runs/b") for o in run_parts(two)]
    assert separable_terms(apart, terms) == ("layer_overhead", "step_overhead")  # two runs: their load differs too


def test_two_plans_of_two_runs_do_not_read_the_load_between_them_as_the_gemm_rate():
    """The second run of another plan ran under more load (1.5x): fitting compute from the difference of the plans
    would read that load as GEMM time; the host terms take it, and the GEMM rate stays the profile's."""
    one, two = plan(1), plan(4)
    first = [dataclasses.replace(o, launch="runs/a") for o in run_parts(one)]
    second = [dataclasses.replace(o, launch="runs/b", measured_s=1.5 * o.measured_s) for o in run_parts(two, seed=1)]
    fit = fit_terms(first + second, PROFILED)
    assert "compute" not in fit.fitted and fit.cluster.efficiency.matmul == PROFILED.efficiency.matmul


def test_two_runs_of_one_plan_under_other_loads_fit_between_them():
    """On a machine shared with other work the same plan runs slower in one minute than the next: a fit of one run
    reproduces that run's load, a fit of two (`--from-run A --from-run B`) lies between them."""
    p = plan(1)
    quiet = run_parts(p, seed=0)
    busy = [Observation(plan=o.plan, part=o.part, measured_s=1.6 * o.measured_s) for o in run_parts(p, seed=1)]
    quiet_s, busy_s = predicted_time(p, REAL), 1.6 * predicted_time(p, REAL)
    alone = fit_terms(busy, PROFILED)
    assert predicted_time(p, alone.cluster) == pytest.approx(busy_s, rel=0.05)
    both = fit_terms(quiet + busy, PROFILED)
    assert refusal(both) is None and "compute" not in both.fitted  # still one plan: the GEMM rate is the profile's
    predicted = predicted_time(p, both.cluster)
    assert quiet_s * 1.1 < predicted < busy_s / 1.1
    # relative errors weigh the faster run's timings more: the fit leans to the less disturbed run
    assert predicted < (quiet_s * busy_s) ** 0.5
