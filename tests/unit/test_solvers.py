"""The solvers (exact, dichotomy, learned) over one space and pricing API, and mixed clusters of device groups."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import numpy as np
import pytest

from plait import legality
from plait.axes import Degrees
from plait.errors import ConfigError
from plait.search import plan_with_stats
from plait.search.explain import balance_note, even_split, stage_rows
from plait.search.solvers import EXACT_UP_TO, choose_solver
from plait.search.space import Pins, Space, distinct_zeros
from plait.spec import ClusterSpec, TrainSpec
from plait.spec.cluster import DeviceGroup, LinkSpec
from plait.spec.load import load_cluster

UNIFORM = [("gpt-7.5b", "a100-40g", 16, 64, 2048), ("llama3-8b", "h100-80g", 64, 256, 8192),
           ("tiny-gpt", "local-cpu", 4, 16, 128)]


def _train(gb: int, seq: int, precision: str = "bf16") -> TrainSpec:
    return TrainSpec(global_batch=gb, seq_len=seq, precision=precision)


@pytest.mark.parametrize("case", UNIFORM, ids=lambda c: c[0])
def test_every_solver_returns_legal_ranked_plans_no_better_than_exact(case):
    model, cluster, n, gb, seq = case
    precision = "fp32" if cluster == "local-cpu" else "bf16"
    best = {}
    for solver in ("exact", "dichotomy", "learned"):
        result = plan_with_stats(model, cluster, _train(gb, seq, precision), num_devices=n, top=3, solver=solver)
        assert result.solver == solver and result.complete and result.plans
        times = [p.predicted.step_time_s for p in result.plans]
        assert times == sorted(times)
        for p in result.plans:
            legality.check(p)  # raises IllegalPlan
            assert p.degrees.world_size == n
            assert max(p.predicted.memory_per_stage) <= p.cluster.memory_bytes
        best[solver] = times[0]
    # the exact solver finds the cost model's optimum; the others may only match it
    assert best["exact"] <= best["dichotomy"] * (1 + 1e-9) and best["exact"] <= best["learned"] * (1 + 1e-9)
    # and on these (held out from the learned solver's training families) they come close
    assert best["dichotomy"] <= best["exact"] * 1.02
    assert best["learned"] <= best["exact"] * 1.05


def test_dichotomy_prices_fewer_micro_batch_sizes_than_exact_enumeration():
    """Without the shortlist's pruning, exact prices every micro-batch of every family; dichotomy O(log B)."""
    train = _train(256, 2048)
    exact = plan_with_stats("gpt-7.5b", "a100-40g", train, num_devices=16, solver="exact")
    dichotomy = plan_with_stats("gpt-7.5b", "a100-40g", train, num_devices=16, solver="dichotomy")
    assert dichotomy.candidates_evaluated < exact.candidates_evaluated / 2
    assert dichotomy.plans[0].predicted.step_time_s <= exact.plans[0].predicted.step_time_s * 1.02


def test_unknown_solver_and_a_time_limit_too_short_are_clear_errors():
    train = _train(64, 2048)
    with pytest.raises(ConfigError, match="exact, dichotomy, learned, auto"):
        plan_with_stats("gpt-7.5b", "a100-40g", train, num_devices=16, solver="genetic")
    with pytest.raises(ConfigError, match="time limit"):
        plan_with_stats("gpt-7.5b", "a100-40g", train, num_devices=16, time_limit_s=1e-9)


def test_a_time_limit_returns_the_best_so_far_and_says_it_is_incomplete():
    cluster = _mixed(8, 8)
    train = _train(64, 2048)
    full = plan_with_stats("gpt-7.5b", cluster, train, top=3)
    assert full.complete
    # a limit just after the first candidates: something to show, not the whole space
    cut = plan_with_stats("gpt-7.5b", cluster, train, top=3, time_limit_s=max(full.seconds / 50, 1e-3))
    if cut.complete:  # this host was fast enough to finish anyway: then it must agree with the full search
        assert cut.plans[0].describe() == full.plans[0].describe()
    else:
        assert cut.plans and cut.candidates_evaluated < full.candidates_evaluated
        assert cut.plans[0].predicted.step_time_s >= full.plans[0].predicted.step_time_s * (1 - 1e-9)


# ---- the space -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("counts", [{"a": 2, "b": 2}, {"a": 3, "b": 1, "c": 2}, {"a": 4}])
def test_orderings_are_every_distinct_assignment_of_groups_to_pipeline_ranks(counts):
    groups = tuple((name, c) for name, c in counts.items())
    space = Space(Pins(), [], 8, 8, groups)
    d = Degrees(pp=sum(counts.values()), dp=1)
    got = list(space.iter_orderings(d))
    want = sorted(set(itertools.permutations([g for g, c in counts.items() for _ in range(c)])))
    assert got == want  # each once, in lexicographic order
    assert space.count_orderings(d) == len(want) == math.factorial(d.pp) // math.prod(
        math.factorial(c) for c in counts.values())


def test_only_zero_stages_that_run_differently_are_searched():
    # one replica of plain tensors without a pipeline: DDP (0), ZeroRedundancyOptimizer (1), fully_shard (2, 3)
    assert distinct_zeros(Degrees(dp=4)) == [0, 1, 2, 3]
    # under a pipeline or tensor parallelism ZeRO 0/1 ride on fully_shard, sharded as ZeRO-2 is: one plan
    assert distinct_zeros(Degrees(dp=2, pp=2)) == [2]
    assert distinct_zeros(Degrees(dp=2, tp=2)) == [2, 3]
    assert distinct_zeros(Degrees(dp=1, tp=2)) == [0]
    for d in (Degrees(dp=2, pp=2), Degrees(dp=2, tp=2), Degrees(dp=4)):
        modes = {legality.data_parallel_mode(d, z) for z in distinct_zeros(d)}
        assert len(modes) == len(distinct_zeros(d))


# ---- mixed clusters ------------------------------------------------------------------------------------------
def _mixed(fast: int, slow: int, slow_peak: float = 156e12, memory: float = 40 * 2**30) -> ClusterSpec:
    link = LinkSpec(latency_s=5e-6, bandwidth=200e9)
    groups = (DeviceGroup(name="h100", num_devices=fast, devices_per_node=8, memory_bytes=80 * 2**30,
                          peak_flops=989e12, intra_node=LinkSpec(latency_s=5e-6, bandwidth=400e9)),
              DeviceGroup(name="a100", num_devices=slow, devices_per_node=8, memory_bytes=memory,
                          peak_flops=slow_peak, intra_node=link))
    return ClusterSpec(name="mixed", num_devices=fast + slow, devices_per_node=8, memory_bytes=80 * 2**30,
                       peak_flops=989e12, intra_node=link, inter_node=LinkSpec(latency_s=1e-5, bandwidth=25e9),
                       groups=groups, between_groups=LinkSpec(latency_s=2e-5, bandwidth=12.5e9))


def _ranks_per_group(plan) -> dict[str, int]:
    block = plan.degrees.world_size // plan.pp
    out: dict[str, int] = {}
    for group in plan.stage_groups:
        out[group] = out.get(group, 0) + block
    return out


def test_a_mixed_plan_puts_every_device_of_every_group_to_work_and_balances_its_layers():
    cluster = _mixed(8, 8)
    result = plan_with_stats("gpt-7.5b", cluster, _train(64, 2048), top=5)
    for plan in result.plans:
        assert len(plan.stage_groups) == plan.pp > 1  # a group of its own per pipeline rank
        assert _ranks_per_group(plan) == {"h100": 8, "a100": 8}
        legality.check(plan)
        for row, cap in zip(stage_rows(plan), [g.memory_bytes for g in cluster.groups]):
            assert row.memory_bytes <= cluster.group(row.group).memory_bytes
    best = result.plans[0]
    rows = stage_rows(best)
    fast = [r.layers for r in rows if r.group == "h100"]
    slow = [r.layers for r in rows if r.group == "a100"]
    assert min(fast) > max(slow)  # the faster devices hold more layers
    # ... and that is why it beats the even split of the same plan, which the note prices
    even = even_split(sum(best.layers_per_stage), best.num_stages)
    assert even != best.layers_per_stage
    note = balance_note(best)
    assert "even split" in note and "%" in note and note.split("(")[-1].startswith("+")


def test_a_slower_group_gets_fewer_layers_and_a_uniform_one_an_even_split():
    train = _train(64, 2048)
    same = plan_with_stats("gpt-7.5b", _mixed(8, 8, slow_peak=989e12, memory=80 * 2**30), train, top=1, pp=2)
    layers = same.plans[0].layers_per_stage
    assert max(layers) - min(layers) <= 2  # only the embedding and head make the ends differ
    slower = plan_with_stats("gpt-7.5b", _mixed(8, 8, slow_peak=100e12), train, top=1, pp=2)
    by_group = dict(zip(slower.plans[0].stage_groups, slower.plans[0].layers_per_stage))
    assert by_group["a100"] < by_group["h100"]


def test_learned_and_exact_agree_on_a_small_mixed_cluster_and_auto_chooses_by_size():
    cluster = _mixed(8, 8)
    train = _train(64, 2048)
    exact = plan_with_stats("gpt-7.5b", cluster, train, top=3, solver="exact")
    learned = plan_with_stats("gpt-7.5b", cluster, train, top=3, solver="learned")
    assert learned.plans[0].predicted.step_time_s <= exact.plans[0].predicted.step_time_s * 1.05
    for plan in learned.plans:
        assert _ranks_per_group(plan) == {"h100": 8, "a100": 8}
    small = Space(Pins(), [Degrees(pp=2, dp=8)], 64, 32, (("h100", 8), ("a100", 8)))
    assert choose_solver(small) == "exact"
    many = [Degrees(pp=pp, dp=256 // pp) for pp in (16, 32)]
    big = Space(Pins(), many, 512, 64, (("h100", 128), ("a100", 64), ("v100", 64)))
    assert sum(sum(1 for _ in big.base_layouts(d)) * big.count_orderings(d) for d in many) > EXACT_UP_TO
    assert choose_solver(big) == "learned"


def test_a_mixed_cluster_file_is_checked_and_planned_whole(tmp_path):
    with pytest.raises(ValueError, match="must differ"):
        ClusterSpec(name="x", num_devices=4, memory_bytes=1e9, peak_flops=1e12, intra_node=LinkSpec(1e-6, 1e9),
                    inter_node=LinkSpec(1e-6, 1e9), groups=(_mixed(2, 2).groups[0], _mixed(2, 2).groups[0]))
    with pytest.raises(ValueError, match="must equal the groups"):
        ClusterSpec(name="x", num_devices=5, memory_bytes=1e9, peak_flops=1e12, intra_node=LinkSpec(1e-6, 1e9),
                    inter_node=LinkSpec(1e-6, 1e9), groups=_mixed(2, 2).groups)
    with pytest.raises(ValueError, match="slowdown"):
        DeviceGroup(name="g", num_devices=2, memory_bytes=1e9, peak_flops=1e12, intra_node=LinkSpec(1e-6, 1e9),
                    slowdown=0.5)
    with pytest.raises(ValueError, match="planned whole"):
        _mixed(8, 8).with_devices(8)
    local = load_cluster("examples/clusters/mixed-local.yaml")
    assert local.mixed and local.num_devices == 4 and local.group("slow").slowdown == 2.0
    assert local.view("slow").peak_flops == local.group("slow").peak_flops and not local.view("slow").groups


def test_plan_cli_shows_each_stage_group_and_why_the_split():
    env = {"OMP_NUM_THREADS": "1", "COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "plait", "plan", "--cluster", "examples/clusters/mixed-local.yaml",
                          "--model", "tiny-gpt", "--global-batch", "16", "--seq-len", "128", "--top", "2"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "slow[" in out.stdout and "fast[" in out.stdout
    assert "stages of #1" in out.stdout and "why this split" in out.stdout and "even split" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "plait", "plan", "--cluster", "examples/clusters/mixed-local.yaml",
                          "--model", "tiny-gpt", "--global-batch", "16", "--seq-len", "128", "--solver", "x"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "exact" in bad.stderr and "Traceback" not in bad.stderr


def test_solver_training_is_seeded_and_learns():
    """A few epochs of the contrastive training on a handful of problems: the same seed gives the same weights,
    and the trained scorer's proposals are no worse than the untrained network's."""
    from plait.search.training import make_problems, proposal_gap, train

    a = train(seed=3, problems=6, epochs=3, samples=8, log=lambda *_: None)
    b = train(seed=3, problems=6, epochs=3, samples=8, log=lambda *_: None)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    held_out = make_problems(seed=99, count=6, family="test")
    assert np.all(np.isfinite(proposal_gap(a, held_out)))
    assert np.all(proposal_gap(a, held_out) >= 0)
