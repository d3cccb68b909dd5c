"""A run's timings on file (plait/train/measure.py): the CPU seconds of each step travel with the wall-clock ones,
are cut by the same warm-up, and files written before they were recorded still read."""

from __future__ import annotations

import json

import pytest

from plait.train.measure import Parts, RankRecord, Segment, read_measured, write_measured


def record(rank: int, steps: int = 6) -> RankRecord:
    out = RankRecord(rank=rank, pp_rank=0, dp_rank=rank)
    for k in range(steps):
        out.add(k + 1, 0.2 + 0.01 * k, 0.15, 0.12, 0.03, cpu_s=0.1 + 0.01 * k + rank, queued_s=0.001 * k)
    return out


def segment() -> Segment:
    return Segment(plan={}, predicted=Parts(step=0.2, compute=0.12, waiting=0.03, optimizer=0.03),
                   predicted_rank_compute=[0.12], ranks=[record(0), record(1)])


def test_cpu_seconds_round_trip_and_share_the_warm_up_cut(tmp_path):
    write_measured(tmp_path, [segment()])
    [read] = read_measured(tmp_path)
    assert [r.cpu_s for r in read.ranks] == [r.cpu_s for r in segment().ranks]
    window = read.measured_window(warmup=2)
    assert [len(r.cpu_s) for r in window] == [4, 4] and window[1].cpu_s[0] == 1.12
    assert window[0].step_s[0] == 0.22 and window[0].queued_s == [0.002, 0.003, 0.004, 0.005]  # the same steps


def test_files_without_cpu_seconds_still_read(tmp_path):
    path = write_measured(tmp_path, [segment()])
    data = json.loads(path.read_text())
    for rank in data["segments"][0]["ranks"]:
        del rank["cpu_s"], rank["queued_s"]
    path.write_text(json.dumps(data))
    [read] = read_measured(tmp_path)
    assert all(r.cpu_s == [] and r.queued_s == [] for r in read.ranks) and read.measured().step == pytest.approx(0.235)


def test_the_run_queue_delay_grows_while_another_thread_holds_the_only_core():
    """Linux's run-queue delay, read per thread: pinned to one core beside a busy thread, this thread waits."""
    import os
    import sys
    import threading
    import time

    from plait.train.measure import queued_seconds

    if not sys.platform.startswith("linux"):
        pytest.skip("the run-queue delay is Linux's")
    assert queued_seconds() is not None
    core = min(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    stop = time.perf_counter() + 0.4

    def spin() -> None:
        os.sched_setaffinity(0, {core})
        while time.perf_counter() < stop:
            pass

    os.sched_setaffinity(0, {core})
    try:
        before, began = queued_seconds(), time.perf_counter()
        other = threading.Thread(target=spin)
        other.start()
        while time.perf_counter() < stop:
            sum(range(1000))
        other.join()
        waited, elapsed = queued_seconds() - before, time.perf_counter() - began
    finally:
        os.sched_setaffinity(0, saved)
    assert 0.02 < waited <= elapsed


def test_the_share_of_a_step_spent_waiting_for_a_core():
    """Per step the rank that waited longest, over the median step; None for a run that did not record it."""
    seg = segment()
    for rank in seg.ranks:
        rank.queued_s = [0.05 * (rank.rank + 1)] * 6  # rank 1 waits 0.1 s a step
    assert seg.queued_share() == pytest.approx(0.1 / 0.235)
    from plait.train.measure import shared_cores_line

    assert "43% of the median step" in shared_cores_line(seg.queued_share())
    seg.ranks[0].queued_s = []
    assert seg.queued_share() is None
