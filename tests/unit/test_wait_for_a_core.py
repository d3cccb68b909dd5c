"""A run's timings less the time its ranks sat ready to run without a core (plait/train/measure.py, `_parts_of`):
what the end table, the end note and `plait tune --from-run` read. Other work on a shared machine stretches the wall
clock, and no cost model sees it; the run-queue delay each rank recorded says how much. On an idle machine (no
delay) nothing changes."""

from __future__ import annotations

import io
import re
import shlex

import pytest
from rich.console import Console

from plait.profile.tuning import run_observations
from plait.plan import Plan
from plait.profile.terms import fit_terms, predicted_time, refusal, term_value, with_term_value
from plait.spec import TrainSpec
from plait.spec.cluster import ClusterSpec, Efficiency, LinkSpec
from plait.spec.models import MODEL_PRESETS
from plait.train.measure import (
    RankRecord, Segment, calibration_advice, predicted_segment, print_comparison, read_measured,
    write_measured,
)

LINK = LinkSpec(latency_s=100e-6, bandwidth=1e9)
PROFILED = ClusterSpec(name="profiled", num_devices=2, devices_per_node=2, memory_bytes=4 * 2**30, peak_flops=2e10,
                       efficiency=Efficiency(matmul=1.0, matmul_half_dim=64.0, overhead=0.3),
                       intra_node=LINK, inter_node=LINK, device_type="cpu", backend="gloo")
REAL = with_term_value(PROFILED, "layer_overhead", 4e-3)
"""The machine: what the profile measured, and 4 ms of host time per layer pass it did not."""
PLAN = Plan.of(dp=2, tp=1, pp=1, micro_batch=1, num_micro_batches=4, model=MODEL_PRESETS["tiny-llama"],
               train=TrainSpec(global_batch=8, seq_len=128, precision="fp32"), cluster=PROFILED)


def two_ranks(compute: float, waiting: float, optimizer: float, load: float, steps: int = 12) -> list[RankRecord]:
    """A dp2 run whose work takes `compute`, `waiting`, `optimizer` seconds a step on an idle machine, while other
    work holds rank 1's core for `load` of its compute (rank 1 sat ready without a core that long; rank 0 waits as
    long for it at the gradients' all-reduce, its waiting part) and rank 0's for `load` of its optimizer step."""
    held, held_opt = load * compute, load * optimizer
    ranks = [RankRecord(rank=0, pp_rank=0, dp_rank=0), RankRecord(rank=1, pp_rank=0, dp_rank=1)]
    for k in range(steps):
        jitter = 1 + 0.01 * (k % 3 - 1)
        c, w, o = compute * jitter, waiting * jitter, optimizer * jitter
        train = c + held + w
        ranks[0].add(k + 1, train + o + held_opt, train, c, o + held_opt, queued_s=held_opt, queued_train_s=0.0,
                     queued_compute_s=0.0)
        ranks[1].add(k + 1, train + o, train, c + held, o, queued_s=held, queued_train_s=held, queued_compute_s=held)
    return ranks


def segment(ranks: list[RankRecord], plan: Plan = PLAN) -> Segment:
    out = predicted_segment(plan)
    out.ranks = ranks
    return out


def truth(part: str) -> float:
    return predicted_time(PLAN, REAL, part)


def test_an_idle_machine_reads_as_the_wall_clock():
    """No wait for a core: every part, the step, the chunks the fit reads and the end table are the wall clock's."""
    idle = segment(two_ranks(truth("compute"), truth("waiting"), truth("optimizer"), load=0.0))
    assert all(r.queued_compute_s and r.queued_train_s for r in idle.ranks)  # recorded, and all 0
    assert idle.measured() == idle.measured(wall_clock=True)
    assert idle.measured_chunks(2) == idle.measured_chunks(2, wall_clock=True)
    assert idle.measured().compute == pytest.approx(truth("compute"))
    table = io.StringIO()
    print_comparison([idle], Console(file=table, width=250))
    assert "wall clock" not in table.getvalue() and "other work shared the cores" not in table.getvalue()


def test_the_wait_for_a_core_is_taken_off_each_part_and_the_step():
    compute, waiting, optimizer = 0.15, 0.02, 0.03
    loaded = segment(two_ranks(compute, waiting, optimizer, load=0.5))
    wall, less = loaded.measured(wall_clock=True), loaded.measured()
    # the wall clock: rank 1 computed 1.5x as long, and every step waited as long as it did
    assert wall.compute == pytest.approx(1.5 * compute)
    assert wall.step == pytest.approx(1.5 * compute + waiting + optimizer + 0.5 * optimizer)
    # less the wait: the work itself, whichever rank is read (rank 0 waited for rank 1 in its waiting part)
    assert less.compute == pytest.approx(compute) and less.waiting == pytest.approx(waiting)
    assert less.optimizer == pytest.approx(optimizer)
    # per step, the longest delay any rank had (rank 1's, 0.075 s) comes off the slowest rank's step; rank 0's own
    # delay in its optimizer, at another moment, stays: the rule takes off no more than one rank's wait
    assert less.step == pytest.approx(wall.step - 0.5 * compute)
    table = io.StringIO()
    print_comparison([loaded], Console(file=table, width=250))
    text = " ".join(table.getvalue().split())
    assert "wall clock s" in text and f"{wall.step:.4f}" in text and f"{less.step:.4f}" in text
    assert "other work shared the cores" in text


def test_the_end_note_reads_the_step_less_the_wait_and_gives_the_wall_clock_too():
    parts = [truth(p) for p in ("compute", "waiting", "optimizer")]
    # priced on the machine it ran on, its ranks waiting for a core as long as they compute: the wall clock reads
    # about 2x the prediction, the step less the wait about 1x: no calibration to ask for
    calibrated = PLAN.replace(cluster=REAL)
    assert segment(two_ranks(*parts, load=1.0), calibrated).measured(wall_clock=True).step > 1.6 * truth("step")
    assert calibration_advice([segment(two_ranks(*parts, load=1.0), calibrated)], "runs/x", 2) is None
    # three times slower than priced, under the same load: the note gives the step less the wait, and the wall clock's
    loaded = segment(two_ranks(*(3 * p for p in parts), load=1.0), calibrated)
    wall, less = loaded.measured(wall_clock=True), loaded.measured()
    note = calibration_advice([loaded], "runs/x", 2)
    ratio = less.step / loaded.predicted.step
    assert 2.5 < ratio < 3.5 and f"{ratio:.1f}x slower" in note and "(less the wait for a core)" in note
    assert f"{wall.step:.4g} s a step, {wall.step / loaded.predicted.step:.1f}x the prediction" in note
    # every command the note quotes runs as written (benchmarks/calibration.py runs them)
    from plait.cli import build_parser

    commands = re.findall(r"`(plait [^`]+)`", note)
    assert len(commands) == 3
    for command in commands:
        build_parser().parse_args(shlex.split(command)[1:])


def test_files_without_the_delay_by_part_read_as_before(tmp_path):
    """Older run files recorded the step's delay only: the step is read less it, the parts as the wall clock read
    them; older files, without any delay, as before."""
    loaded = segment(two_ranks(0.15, 0.02, 0.03, load=0.5))
    for record in loaded.ranks:
        record.queued_train_s, record.queued_compute_s = [], []
    write_measured(tmp_path, [loaded])
    [read] = read_measured(tmp_path)
    wall, less = read.measured(wall_clock=True), read.measured()
    assert (less.compute, less.waiting, less.optimizer) == (wall.compute, wall.waiting, wall.optimizer)
    assert less.step == pytest.approx(wall.step - 0.075)
    for record in read.ranks:
        record.queued_s = []
    assert read.measured() == read.measured(wall_clock=True)


def test_the_fit_does_not_read_the_load_as_slower_host_time(capsys):
    """`plait tune --from-run` of a run whose rank waited for a core half as long as it computed. Read by the wall
    clock (a file without the delays by part: the old rule) the fit puts the load into the host time per layer pass
    and predicts the plan 1.3x slower than the machine runs it; read less the wait it finds the machine."""
    parts = {p: truth(p) for p in ("compute", "waiting", "optimizer")}
    loaded = segment(two_ranks(parts["compute"], parts["waiting"], parts["optimizer"], load=0.5))
    new = fit_terms(run_observations([("runs/loaded", loaded)], PROFILED), PROFILED)
    assert "runs/loaded: its ranks waited for a core held by other work for" in capsys.readouterr().out
    old_rule = segment(two_ranks(parts["compute"], parts["waiting"], parts["optimizer"], load=0.5))
    for record in old_rule.ranks:
        record.queued_s, record.queued_train_s, record.queued_compute_s = [], [], []
    old = fit_terms(run_observations([("runs/loaded", old_rule)], PROFILED), PROFILED)
    assert refusal(new) is None and refusal(old) is None
    assert "layer_overhead" in new.fitted and "layer_overhead" in old.fitted
    assert term_value(new.cluster, "layer_overhead") == pytest.approx(4e-3, rel=0.05)
    assert term_value(old.cluster, "layer_overhead") > 1.5 * 4e-3
    step = predicted_time(PLAN, REAL)
    assert predicted_time(PLAN, new.cluster) == pytest.approx(step, rel=0.05)
    assert predicted_time(PLAN, old.cluster) > 1.3 * step
    assert new.cluster.efficiency.matmul == old.cluster.efficiency.matmul == PROFILED.efficiency.matmul


def test_parts_are_recorded_with_the_delay_inside_them():
    """RankRecord keeps the delay by part only when the step's is known, and a window cuts them alike."""
    record = RankRecord(rank=0, pp_rank=0)
    for k in range(5):
        record.add(k + 1, 1.0, 0.8, 0.6, 0.2, queued_s=0.3, queued_train_s=0.2 + k, queued_compute_s=0.1)
    record.add(6, 1.0, 0.8, 0.6, 0.2, queued_s=None, queued_train_s=0.2, queued_compute_s=0.1)
    assert len(record.queued_s) == len(record.queued_train_s) == len(record.queued_compute_s) == 5
    assert record.window(3).queued_train_s == [3.2, 4.2] and record.window(3).queued_compute_s == [0.1, 0.1]


def test_adapting_does_not_re_plan_for_the_load():
    """`plait train --adapt`: every rank at the speed the plan was priced for, their wall-clock steps twice the
    prediction because each waited for a core half the step. Read less the wait the step is as predicted: keep the
    plan (the wall clock alone would call for a refit and a re-plan)."""
    from plait.train.adapt import Adaptation
    from plait.train.config import Config, PlanConfig

    calibrated = PLAN.replace(cluster=REAL)
    loaded = segment([], calibrated)
    step, compute = loaded.predicted.step, loaded.predicted_rank_compute[0]
    for rank in range(2):
        record = RankRecord(rank=rank, pp_rank=0, dp_rank=rank)
        for k in range(8):
            record.add(k + 1, 2 * step, 2 * (step - 0.001), 2 * compute, 0.001, queued_s=step,
                       queued_train_s=step - 0.001, queued_compute_s=compute)
        loaded.ranks.append(record)
    decision, speeds, _ = Adaptation(Config(plan=PlanConfig(adapt=True)), calibrated, "/nonexistent", 0.0,
                                     rank=1).decide(loaded, step=8, total=200)
    assert decision.action == "keep", decision.reason
    assert decision.figures["measured_step_s"] == pytest.approx(2 * step, rel=1e-3)
    assert decision.figures["measured_step_less_wait_s"] == pytest.approx(step, rel=1e-3)


def test_the_ranks_compute_is_read_less_each_ranks_own_wait():
    """The per-rank table: rank 1 waited for a core half as long as it computed; less that wait it is no
    straggler."""
    loaded = segment(two_ranks(0.15, 0.02, 0.03, load=0.5))
    assert [round(m, 6) for _, _, m in loaded.rank_compute()] == [0.15, 0.15]
    for record in loaded.ranks:
        record.queued_compute_s = []
    assert [round(m, 6) for _, _, m in loaded.rank_compute()] == [0.15, 0.225]
