"""The exact stage split against brute force, and its use by the search."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.search.partition import min_max_split, min_max_split_reference


@st.composite
def problems(draw):
    stages = draw(st.integers(1, 4))
    layers = draw(st.integers(stages, 10))
    modes = draw(st.integers(1, 3))
    floats = lambda lo, hi: st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    fixed_time = [draw(floats(0, 3)) for _ in range(stages)]
    layer_time = [[draw(floats(0.1, 2)) for _ in range(modes)] for _ in range(stages)]
    fixed_mem = [[draw(floats(0, 5)) for _ in range(modes)] for _ in range(stages)]
    # Per-layer memory is 0 (nothing kept) or a real amount: denormals would test float absorption, not the split.
    layer_mem = [[draw(st.one_of(st.just(0.0), floats(0.01, 3))) for _ in range(modes)] for _ in range(stages)]
    capacity = [draw(floats(1, 30)) for _ in range(stages)]
    return layers, fixed_time, layer_time, fixed_mem, layer_mem, capacity


@settings(max_examples=300, deadline=None)
@given(problems())
def test_split_is_optimal_and_feasible(problem):
    layers, fixed_time, layer_time, fixed_mem, layer_mem, capacity = problem
    fast = min_max_split(*problem)
    slow = min_max_split_reference(*problem)
    assert (fast is None) == (slow is None)
    if fast is None:
        return
    assert fast.bottleneck == np.float64(slow) or abs(fast.bottleneck - slow) <= 1e-9 * max(1.0, slow)
    assert sum(fast.layers) == layers and min(fast.layers) >= 1
    for j, (k, i) in enumerate(zip(fast.layers, fast.modes)):
        assert fixed_mem[j][i] + k * layer_mem[j][i] <= capacity[j] + 1e-9
        assert fixed_time[j] + k * layer_time[j][i] <= fast.bottleneck + 1e-9


def test_heavy_ends_get_fewer_layers():
    # Embedding on stage 0 and a big output layer on the last: the middle takes the slack.
    split = min_max_split(12, [0.0, 0.0, 0.0, 5.0], [[1.0]] * 4, [[0.0]] * 4, [[0.0]] * 4, [1e9] * 4)
    assert split.bottleneck == 6.0  # the last stage needs one layer: 1 + 5
    assert split.layers[-1] < max(split.layers[:-1])


def test_memory_forces_recompute_only_where_needed():
    # Mode 0 fast but memory hungry, mode 1 slow but frugal; stage 0 has less room (more micro-batches in flight).
    split = min_max_split(8, [0.0, 0.0], [[1.0, 1.5], [1.0, 1.5]], [[0.0, 0.0], [0.0, 0.0]],
                          [[4.0, 1.0], [1.0, 0.5]], [8.0, 100.0])
    assert split.modes[1] == 0
    assert split.bottleneck == min_max_split_reference(8, [0.0, 0.0], [[1.0, 1.5], [1.0, 1.5]], [[0.0, 0.0], [0.0, 0.0]],
                                                       [[4.0, 1.0], [1.0, 0.5]], [8.0, 100.0])


def test_no_split_when_nothing_fits():
    assert min_max_split(4, [0.0, 0.0], [[1.0], [1.0]], [[0.0], [0.0]], [[5.0], [5.0]], [4.0, 4.0]) is None
    assert min_max_split(1, [0.0, 0.0], [[1.0], [1.0]], [[0.0], [0.0]], [[0.0], [0.0]], [1.0, 1.0]) is None
