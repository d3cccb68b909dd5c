"""The pipeline simulator against the closed forms, and its extrapolation against full simulation."""

from collections import Counter
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.cost.schedule import bubble_closed_form, makespan, rank_actions, simulate, stage_rank


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12), (8, 8), (8, 32)])
def test_uniform_bubble_matches_closed_form(schedule, v, pp, m):
    stages = pp * v
    timeline = simulate([1.0 / v] * stages, [2.0 / v] * stages, pp, m, schedule)
    assert timeline.bubble_fraction == pytest.approx(bubble_closed_form(pp, m, v), rel=1e-9)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 3)])
def test_every_action_once_and_in_order(schedule, v):
    pp, m = 4, 8
    actions = rank_actions(schedule, pp, m, v)
    for r, acts in enumerate(actions):
        assert all(stage % pp == r for _, stage, _ in acts)
        counts = Counter(acts)
        assert len(counts) == 2 * m * v and set(counts.values()) == {1}
        for _, stage, mb in acts:  # a backward never precedes its own forward on the rank
            assert acts.index(("F", stage, mb)) < acts.index(("B", stage, mb))


def test_one_f_one_b_holds_at_most_p_minus_rank_in_flight():
    pp, m = 4, 12
    for r, acts in enumerate(rank_actions("1f1b", pp, m)):
        live = peak = 0
        for kind, _, _ in acts:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(m, pp - r)


def test_transfers_lengthen_the_pipeline():
    fwd, bwd = [1.0] * 4, [2.0] * 4
    assert simulate(fwd, bwd, 4, 8, "1f1b", p2p=0.1).makespan > simulate(fwd, bwd, 4, 8, "1f1b").makespan


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(2, 1, "1f1b"), (4, 1, "1f1b"), (3, 1, "gpipe"), (2, 2, "interleaved"), (4, 2, "interleaved")]),
       st.integers(5, 10), st.lists(st.floats(0.5, 2.0), min_size=8, max_size=8), st.floats(0, 0.3))
def test_extrapolated_makespan_matches_full_simulation(shape, k, times, p2p):
    pp, v, schedule = shape
    stages = pp * v
    fwd, bwd = times[:stages], [2 * t for t in times[-stages:]]
    full = simulate(fwd, bwd, pp, k * pp, schedule, p2p).makespan
    assert makespan(fwd, bwd, pp, k * pp, schedule, p2p, exact_up_to=4) == pytest.approx(full, rel=0.02)


@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 4, 1, 1), ("gpipe", 4, 4, 1), ("1f1b", 4, 8, 1),
                                             ("1f1b", 2, 4, 1), ("interleaved", 2, 4, 2)])
@pytest.mark.parametrize("o", [1.0, 1.5, 2.0, 4.0])
def test_shared_cores_simulation_lies_between_the_node_work_and_the_unshared_schedule(schedule, pp, m, v, o):
    from plait.cost.schedule import simulate_shared

    fwd = [1.0 + 0.3 * k for k in range(pp * v)]
    bwd = [2.0 * f for f in fwd]
    alone = simulate(fwd, bwd, pp, m, schedule, p2p=0.1).makespan
    shared = simulate_shared(fwd, bwd, pp, m, schedule, p2p=0.1, oversubscription=o).makespan
    node_work = m * sum(f + b for f, b in zip(fwd, bwd)) / pp  # the node's cores do everyone's work
    busiest = max(m * sum(fwd[r::pp]) + m * sum(bwd[r::pp]) for r in range(pp))
    assert max(node_work, busiest / o) <= shared * (1 + 1e-9)
    assert shared <= alone * (1 + 1e-9)
    if o == 1.0:
        assert shared == pytest.approx(alone)


def test_shared_cores_one_busy_stage_runs_at_its_threads_speed():
    """GPipe with one micro-batch keeps one stage of four busy at a time: it runs min(o, 4) times faster."""
    from plait.cost.schedule import simulate_shared

    fwd, bwd = [1.0] * 4, [2.0] * 4
    for o in (1.5, 2.0, 4.0, 8.0):
        shared = simulate_shared(fwd, bwd, 4, 1, "gpipe", oversubscription=o).makespan
        assert shared == pytest.approx(12.0 / min(o, 4.0))


# ---- zero-bubble schedules -------------------------------------------------------------------
@pytest.mark.parametrize("schedule,pp,m", [("zbv", 2, 4), ("zbv", 3, 5), ("zbv", 4, 12), ("zbv", 4, 3),
                                           ("dualpipev", 2, 4), ("dualpipev", 3, 7), ("dualpipev", 4, 8)])
def test_zero_bubble_orders_are_torchs(schedule, pp, m):
    """The planner's pure copy of each zero-bubble order equals what torch.distributed.pipelining runs."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def flat(actions):
        out = []
        for a in actions:
            if a is None:
                continue
            if a.sub_actions:  # DualPipeV's overlapped forward + backward: run in that order here
                out += flat(a.sub_actions)
                continue
            kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
            out.append((kind[a.computation_type.name], a.stage_index, a.microbatch_index))
        return out

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        stages = [PipelineStage(nn.Linear(2, 2), s, 2 * pp, torch.device("cpu")) for s in (0, 2 * pp - 1)]
        cls = ScheduleZBVZeroBubble if schedule == "zbv" else ScheduleDualPipeV
        torch_order = cls(stages, n_microbatches=m).pipeline_order
        ours = rank_actions(schedule, pp, m, 2)
        for rank in range(pp):
            assert flat(torch_order[rank]) == list(ours[rank])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 16)])
def test_zero_bubble_beats_interleaved_beats_1f1b(pp, m):
    def bubble(schedule, v):
        stages = pp * v
        return simulate([1.0 / v] * stages, [2.0 / v] * stages, pp, m, schedule).bubble_fraction

    assert bubble("zbv", 2) < bubble("interleaved", 2) < bubble("1f1b", 1)
    assert bubble("dualpipev", 2) < bubble("interleaved", 2)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_zero_bubble_actions_cover_every_pass_once_in_dependency_order(schedule):
    pp, m = 3, 7
    seen = {}
    for rank, actions in enumerate(rank_actions(schedule, pp, m, 2)):
        for kind, stage, mb in actions:
            assert stage_rank(schedule, pp, stage) == rank  # a V: rank r holds stages r and 2p-1-r
            seen.setdefault((stage, mb), []).append(kind)
    assert len(seen) == 2 * pp * m
    for kinds in seen.values():
        assert kinds[0] == "F" and (kinds[1:] == ["B"] or kinds[1:] == ["I", "W"])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zbv", "dualpipev"])
def test_compiled_simulation_equals_the_traced_one(schedule):
    """`simulate` runs the schedule as index arithmetic; with keep_events it runs the readable form. Every
    makespan and busy time is the same float, for uneven stages and a point-to-point time."""
    rng = random.Random(7)
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    checked = 0
    for pp in (2, 3, 4):
        for m in (pp, 2 * pp, 3 * pp + (0 if schedule == "interleaved" else 1)):
            fwd = [rng.uniform(0.5, 2.0) for _ in range(pp * v)]
            bwd = [rng.uniform(1.0, 4.0) for _ in range(pp * v)]
            try:
                traced = simulate(fwd, bwd, pp, m, schedule, p2p=0.1, keep_events=True)
            except (ValueError, IndexError):
                with pytest.raises(ValueError):
                    simulate(fwd, bwd, pp, m, schedule, p2p=0.1)
                continue
            fast = simulate(fwd, bwd, pp, m, schedule, p2p=0.1)
            assert (fast.makespan, fast.busy) == (traced.makespan, traced.busy)
            checked += 1
    assert checked >= 6
