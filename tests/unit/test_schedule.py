"""The pipeline simulator against the closed forms, and its extrapolation against full simulation."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.cost.schedule import bubble_closed_form, makespan, rank_actions, simulate


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
