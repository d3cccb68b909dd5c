"""A run's timings on file (plait/train/measure.py): the CPU seconds of each step travel with the wall-clock ones,
are cut by the same warm-up, and files written before they were recorded still read."""

from __future__ import annotations

import json

import pytest

from plait.train.measure import Parts, RankRecord, Segment, read_measured, write_measured


def record(rank: int, steps: int = 6) -> RankRecord:
    out = RankRecord(rank=rank, pp_rank=0, dp_rank=rank)
    for k in range(steps):
        out.add(k + 1, 0.2 + 0.01 * k, 0.15, 0.12, 0.03, cpu_s=0.1 + 0.01 * k + rank)
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
    assert window[0].step_s[0] == 0.22  # cut at the same step


def test_files_without_cpu_seconds_still_read(tmp_path):
    path = write_measured(tmp_path, [segment()])
    data = json.loads(path.read_text())
    for rank in data["segments"][0]["ranks"]:
        del rank["cpu_s"]
    path.write_text(json.dumps(data))
    [read] = read_measured(tmp_path)
    assert all(r.cpu_s == [] for r in read.ranks) and read.measured().step == pytest.approx(0.235)
