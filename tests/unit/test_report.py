"""plait.report: table cells, the plans table, and that every plot writes a readable PNG."""

from __future__ import annotations

import functools
import itertools
import json

import pytest
from rich.console import Console

from plait.errors import ConfigError
from plait.plan import Plan, Prediction
from plait.report import (
    Candidate, TimelineEvent, plans_table, plot_candidates, plot_loss_curve, plot_memory_per_stage,
    plot_predicted_vs_measured, plot_timeline, search_stats_line,
)
from plait.report.curves import as_predicted_measured, read_metrics
from plait.report.tables import human_count, layers_cell, recompute_cell, run_length, schedule_cell, seconds_cell
from plait.spec import TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.models import MODEL_PRESETS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _plan(**changes) -> Plan:
    fields = dict(
        dp=2, tp=2, pp=2, zero=1, micro_batch=1, num_micro_batches=4, schedule="interleaved", interleave=2,
        recompute=("full", "none"), layers_per_stage=(1, 1, 1, 1),
        model=MODEL_PRESETS["tiny-gpt"], train=TrainSpec(global_batch=8, seq_len=64),
        cluster=CLUSTER_PRESETS["local-cpu"],
        predicted=Prediction(step_time_s=0.25, peak_memory_bytes=1.5 * 2**30, tokens_per_s=2048.0,
                             model_tflops_per_device=0.0123, mfu=0.31, bubble_fraction=0.125),
    )
    fields.update(changes)
    return Plan.of(**fields)


def _render(table) -> str:
    console = Console(width=220, record=True)
    console.print(table)
    return console.export_text()


def test_run_length_compresses_long_runs_only():
    assert run_length([12, 12, 12, 11]) == "12×3|11"
    assert run_length([3, 3, 2]) == "3|3|2"
    assert run_length([]) == ""


def test_cells():
    plan = _plan()
    assert layers_cell(plan) == "[1]×4"
    assert layers_cell(_plan(layers_per_stage=(0, 2, 1, 1))) == "[0] [2] [1] [1]"
    assert layers_cell(_plan(model=MODEL_PRESETS["gpt3-175b"], layers_per_stage=(3,) * 15 + (4,) * 6 + (3,) * 9,
                             pp=2, interleave=15)) == "[3]×15 [4]×6 [3]×9"
    assert recompute_cell(plan) == "full,none"
    assert recompute_cell(plan.replace(recompute=("full", "full"))) == "full"
    assert schedule_cell(plan) == "interleaved v2"
    assert schedule_cell(_plan(pp=1, dp=4, interleave=1, schedule="1f1b", recompute=("none",),
                               layers_per_stage=(), num_micro_batches=2)) == "-"
    assert human_count(1_234_567) == "1.23M" and human_count(12) == "12"
    assert seconds_cell(0.25) == "250 ms" and seconds_cell(12.34) == "12.3 s"


def test_plans_table_holds_every_column_and_row():
    plans = [_plan(), _plan(zero=3)]
    text = _render(plans_table(plans, title="two plans"))
    for header in ("dp×tp×pp", "ZeRO", "recompute", "mb×n", "schedule", "layers/stage", "step", "tokens/s",
                   "TFLOP/s/dev", "MFU", "bubble", "peak GiB"):
        assert header in text
    assert "2×2×2" in text and "[1]×4" in text and "250 ms" in text and "31.0%" in text and "12.5%" in text
    assert "1.5" in text and "two plans" in text


def test_search_stats_line():
    assert search_stats_line(12345, 0.4321, 17) == "searched 12,345 candidates, 17 feasible in 0.43 s"


def _is_png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


def test_plan_plots_write_pngs(tmp_path):
    events = [TimelineEvent(rank=r, kind=k, micro_batch=i, chunk=i % 2, start_s=t, end_s=t + 0.01)
              for r in range(2) for i in range(3) for k, t in (("F", 0.01 * (i + r)), ("B", 0.1 + 0.02 * i))]
    assert _is_png(plot_timeline(events, tmp_path / "t.png", title="x"))
    parts = [{"params": 1e9, "optimizer": 2e9, "activations": 3e9}, {"params": 1e9, "optimizer": 2e9}]
    assert _is_png(plot_memory_per_stage(parts, tmp_path / "m.png", memory_limit_bytes=8 * 2**30))
    points = [Candidate(step_time_s=0.1 * (i + 1), peak_memory_bytes=i * 2**30, group=f"g{i % 2}") for i in range(30)]
    assert _is_png(plot_candidates(points, tmp_path / "c.png", best=points[0], memory_limit_bytes=40 * 2**30))


def test_loss_curve_from_metrics_jsonl(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": 5.0 / (s + 1), "lr": 1e-3} for s in range(20)] + [{"step": 19, "val_loss": 0.4}]
    metrics.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert len(read_metrics(metrics)) == 21
    assert _is_png(plot_loss_curve(metrics, tmp_path / "sub" / "loss.png"))


def test_loss_curve_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        plot_loss_curve(tmp_path / "none.jsonl", tmp_path / "x.png")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "loss": 1}\n{oops\n')
    with pytest.raises(ConfigError, match="line 2"):
        plot_loss_curve(bad, tmp_path / "x.png")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="no records"):
        plot_loss_curve(empty, tmp_path / "x.png")


def test_predicted_vs_measured_accepts_rows_in_several_shapes(tmp_path):
    rows = [("dp2", 0.5, 0.55), {"label": "tp2", "predicted_s": 0.8, "measured_s": 0.7}, (0.6, 0.62)]
    assert [as_predicted_measured(r).measured for r in rows] == [0.55, 0.7, 0.62]
    assert _is_png(plot_predicted_vs_measured(rows, tmp_path / "pvm.png", best_label="dp2"))
    with pytest.raises(ConfigError):
        plot_predicted_vs_measured([], tmp_path / "none.png")


# ---- the --report trio, from the cost model -------------------------------------------------
def _predicted(plan: Plan) -> Plan:
    from plait.cost import predict

    return plan.replace(predicted=predict(plan))


def test_timeline_events_cover_every_forward_and_backward():
    from plait.report.plan_report import timeline_events

    plan = _predicted(_plan(predicted=None))  # pp2 x v2, 4 micro-batches
    events, shown = timeline_events(plan)
    assert shown == 4
    assert len(events) == 2 * plan.num_stages * shown
    for rank in range(plan.pp):
        mine = sorted((e for e in events if e.rank == rank), key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))  # a rank runs one thing at a time
        assert {e.chunk for e in mine} == {0, 1}


@pytest.mark.parametrize("changes", [
    dict(),                                                                   # pp2 x v2 interleaved, fully_shard
    dict(dp=1, num_micro_batches=8, interleave=1, schedule="1f1b", layers_per_stage=(2, 2)),  # 1F1B, no DP
    dict(pp=1, dp=4, num_micro_batches=2, interleave=1, schedule="1f1b", recompute=("none",),
         layers_per_stage=()),                                                # gradient accumulation
    dict(oversubscription=2.0),                                               # CPU ranks sharing cores
])
def test_timeline_makespan_is_the_predicted_pipeline_part(changes):
    """The drawn boxes are the cost model's own: with host time per layer pass, per stage pass and fully_shard's
    hooks, and cores shared among busy ranks, the last box ends at the predicted step time's pipeline part."""
    import dataclasses

    from plait.cost.model import pipeline_part
    from plait.report.plan_report import timeline_events

    cluster = CLUSTER_PRESETS["local-cpu"]
    cluster = cluster.replace(host=dataclasses.replace(cluster.host, layer_overhead_s=2e-3, pipeline_overhead_s=5e-3,
                                                       fsdp_layer_overhead_s=1e-3, step_overhead_s=4e-3),
                              oversubscription=changes.pop("oversubscription", 1.0))
    plan = _predicted(_plan(predicted=None, cluster=cluster, **changes))
    events, shown = timeline_events(plan)
    assert shown == plan.num_micro_batches
    drawn = max(e.end_s for e in events)
    assert drawn == pytest.approx(pipeline_part(plan.predicted.step_time_parts), rel=1e-9)
    assert drawn + plan.predicted.step_time_parts["dp_comm"] + plan.predicted.step_time_parts["optimizer"] == \
        pytest.approx(plan.predicted.step_time_s, rel=1e-9)


def test_long_schedules_are_cut_to_whole_rounds():
    from plait.report.plan_report import timeline_events

    plan = _predicted(_plan(dp=1, num_micro_batches=8, predicted=None))
    events, shown = timeline_events(plan, max_events_per_rank=12)
    assert shown == 2 and len(events) == 2 * plan.num_stages * 2  # a multiple of pp, at least pp


def test_memory_by_rank_matches_the_prediction():
    from plait.report.plan_report import memory_by_rank

    plan = _predicted(_plan(predicted=None))
    ranks = memory_by_rank(plan)
    totals = [sum(parts.values()) for parts in ranks]
    assert totals == pytest.approx(list(plan.predicted.memory_per_stage))
    peak = max(range(len(ranks)), key=lambda r: totals[r])
    assert ranks[peak] == pytest.approx(plan.predicted.memory_parts)


def test_write_plan_report_with_search_points(tmp_path):
    from plait.report.plan_report import write_plan_report

    plans = [_predicted(_plan(predicted=None)), _predicted(_plan(zero=3, predicted=None))]
    points = [(0.1 * i, 2**28 * i) for i in range(1, 50)]
    paths = write_plan_report(plans, tmp_path / "report", points=points)
    assert [p.name for p in paths] == ["timeline.png", "memory.png", "candidates.png"]
    assert all(_is_png(p) for p in paths)


@functools.lru_cache(maxsize=None)  # one search per case, for both widths
def _search_plans(model: str, cluster: str, devices: int, batch: int, seq: int) -> tuple[Plan, ...]:
    from plait.search import plan as search
    from plait.spec.load import load_cluster, load_model

    train = TrainSpec(global_batch=batch, seq_len=seq, precision="bf16")
    return tuple(search(load_model(model), load_cluster(cluster), train, num_devices=devices))[:5]


@pytest.mark.parametrize("case", [("gpt3-175b", "a100-80g", 128, 256, 2048),
                                  ("llama3-70b", "h100-80g", 32, 128, 4096),
                                  ("tiny-gpt", "local-cpu", 4, 8, 128)])
@pytest.mark.parametrize("width", [80, 120])
def test_plans_table_is_whole_at_the_width_of_a_terminal(case, width):
    """Rendered at 80 (and 120) columns, every header and every cell of every plan is there whole: nothing cut
    ('19.…'), nothing left blank, no line wider than the terminal."""
    from plait.report.tables import COLUMN_NAMES, plan_row

    plans = _search_plans(*case)
    console = Console(width=width, record=True)
    console.print(plans_table(plans, title="top plans", width=width))
    text = console.export_text()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    lines = text.splitlines()
    for header in COLUMN_NAMES:
        assert any(header in line.split() or f" {header} " in f" {line} " for line in lines), header
    for rank, plan in enumerate(plans, start=1):
        cells = plan_row(rank, plan)
        # its row in each (folded) table, with the lines a wrapped stage list continues on
        rows = []
        for i, line in enumerate(lines):
            if line.split()[:1] == [str(rank)]:
                rows.append(line)
                rows += itertools.takewhile(lambda x: x.strip() and not x.split()[0].isdigit(), lines[i + 1:])
        assert rows, f"no row for plan #{rank}"
        words = "  ".join(rows).split()
        for cell in cells:  # whole: its words in order (a stage list may wrap between stages, never inside one)
            it = iter(words)
            assert all(any(w == x for x in it) for w in cell.split()), f"cell {cell!r} of plan #{rank} is not whole in:\n{text}"
