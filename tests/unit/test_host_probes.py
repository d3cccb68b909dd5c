"""The quick profile's host probes read against each other within their rounds (plait.profile.host
.steady_probe_times): a burst of other work that slows whole rounds, or one step, does not move the probes'
differences, which the host fit reads."""

from __future__ import annotations

import random
import statistics

import pytest

from plait.profile.host import steady_probe_times

PROBES = [0.012, 0.031, 0.015, 0.044, 0.050, 0.160, 0.040, 0.095]
"""Undisturbed step seconds of eight probes (the shape of the quick profile's: DDP, fully_shard, tp, pp)."""


def rounds_table(slowdowns: list[float], probes: list[float] = PROBES) -> list[list[float]]:
    return [[t * s for s in slowdowns] for t in probes]


def test_a_shared_slowdown_of_whole_rounds_leaves_each_probe_at_the_median_round():
    slowdowns = [1.0, 1.0, 2.5, 2.5, 2.5, 1.1, 1.0, 3.0, 1.05]  # bursts over consecutive rounds
    steady = steady_probe_times(rounds_table(slowdowns))
    median_round = statistics.median(slowdowns)
    assert steady == pytest.approx([t * median_round for t in PROBES], rel=1e-9)


def test_one_step_that_met_a_burst_alone_moves_no_probe():
    table = rounds_table([1.0] * 9)
    table[3][4] *= 6.0  # one probe's step in one round
    table[6][1] *= 4.0
    assert steady_probe_times(table) == pytest.approx(PROBES, rel=1e-9)


def test_differences_hold_where_each_probes_own_median_does_not():
    """Rounds slowed at random, every step with 3% noise of its own: the probes' ratios to the first, which the
    host fit's differences rest on, stay within 5% read within rounds; each probe's own median over rounds lands on
    different rounds and misses by more."""
    rng = random.Random(0)
    worst_steady, worst_median = 0.0, 0.0
    for _ in range(20):
        slowdowns = [rng.choice([1.0, 1.0, 1.6, 2.4]) for _ in range(9)]
        table = [[t * s * rng.uniform(0.97, 1.03) for s in slowdowns] for t in PROBES]
        for read, worst in ((steady_probe_times(table), "steady"), ([statistics.median(r) for r in table], "median")):
            error = max(abs(r / read[0] / (t / PROBES[0]) - 1.0) for r, t in zip(read, PROBES))
            if worst == "steady":
                worst_steady = max(worst_steady, error)
            else:
                worst_median = max(worst_median, error)
    assert worst_steady < 0.05
    assert worst_median > worst_steady


def test_probes_with_uneven_rounds_are_read_on_the_rounds_they_share():
    table = rounds_table([1.0, 2.0, 1.0])
    table[0].append(50.0)  # a step past the others' last round is not read
    assert steady_probe_times(table) == pytest.approx(PROBES, rel=1e-9)
    with pytest.raises(ValueError, match="at least one timed step"):
        steady_probe_times([[0.1], []])
