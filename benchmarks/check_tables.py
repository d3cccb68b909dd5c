"""Keep the figure tables of the pages in step with the commands that made them.

Every table in benchmarks/README.md is preceded by a marker naming its command and the saved results it comes from:

  <!-- table id="gpu-h100" command="python benchmarks/gpu_check.py --reprice DIR" results="benchmarks/results/gpu/" -->

(`results="none"`: timings of a run that was not saved; run the command to measure again). A marker may stand before
a table on any page (README.md, docs/*.md). For the tables this script can make cheaply, by pure pricing or from a
saved artefact repriced by the tree as it is (RENDERERS), it renders the rows again and compares them with the page:

    python benchmarks/check_tables.py            # list what is out of step (exit 1), or say all is well
    python benchmarks/check_tables.py --write    # rewrite the rendered rows in place

A renderer owns the rows it returns, matched by their first cells; a table may keep other rows (history, figures of
earlier code), which are not checked, and a renderer leaves a cell unchecked by giving None for it (timings).
tests/unit/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!--\s*table\s+(.*?)\s*-->")
FIELD = re.compile(r'(\w+)="([^"]*)"')
BENCHMARKS_PAGE = Path("benchmarks/README.md")


# ---- the pages ------------------------------------------------------------------------------------

def pages(root: Path = ROOT) -> list[Path]:
    """The pages whose tables may carry markers: the README, the benchmark page and the docs."""
    found = [root / "README.md", root / BENCHMARKS_PAGE, *sorted((root / "docs").glob("**/*.md"))]
    return [p for p in found if p.is_file()]


def tables(lines: list[str]) -> list[tuple[int, int]]:
    """(first, end) line indices of each markdown table: a run of lines starting with '|' whose second is |---."""
    spans, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|\s*:?-", lines[i + 1]):
            end = i
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            spans.append((i, end))
            i = end
        else:
            i += 1
    return spans


def marker_before(lines: list[str], first: int) -> dict | None:
    """The marker fields of the table starting at `first`: the closest non-blank line above it, if a marker."""
    i = first - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    match = MARKER.search(lines[i]) if i >= 0 else None
    return dict(FIELD.findall(match.group(1))) if match else None


def cells(row: str) -> list[str]:
    """A markdown row's cells (escaped pipes stay inside their cell)."""
    parts = re.split(r"(?<!\\)\|", row.strip())
    return [p.strip() for p in parts[1:-1]]


def row_text(values: list[str]) -> str:
    return "| " + " | ".join(values) + " |"


# ---- renderers: the rows a command gives today ---------------------------------------------------

@cache
def _script(name: str):  # noqa: ANN202
    """A benchmark script as a module (benchmarks/ is not a package), loaded once."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _plain(cell: str) -> str:
    from rich.text import Text

    return Text.from_markup(cell).plain


def _column(table, header: str, index: int = 0) -> list[str]:  # noqa: ANN001
    """The plain cells of the index-th column of a rich Table headed `header`."""
    found = [c for c in table.columns if c.header == header]
    return [_plain(str(cell)) for cell in found[index].cells]


def _pct(value: str) -> float:
    """"+4.9%" -> 0.049."""
    return float(value.rstrip("%")) / 100


def _span(errors: list[float]) -> str:
    return f"{min(errors):+.1%} … {max(errors):+.1%}"


def _worst(errors: list[float]) -> str:
    return f"{max(errors, key=abs):+.1%}"


def render_cost_accuracy() -> list[list[str]]:
    """benchmarks/cost_accuracy.py's tables, summarised per check: the range of its signed errors."""
    from plait.spec.clusters import CLUSTER_PRESETS

    ca = _script("cost_accuracy")
    a100, h100, h100_500w = (CLUSTER_PRESETS[n] for n in ("a100-80g", "h100-80g", "h100-96g-500w"))
    tol = {name: f"±{value:.0%}" for name, value in ca.TOLERANCES.items()}
    megatron = [_pct(e) for e in _column(ca.megatron_table(a100)[0], "error")]
    layer_table = ca.layer_table(a100)[0]
    layer = [_pct(e) for i in range(3) for e in _column(layer_table, "err", i)]
    zero = ca.zero_table()
    zero_exact = all(_zero_cell_exact(cell) for col in zero.columns[1:] for cell in col.cells)
    h100_rows = [_pct(e) for e in _column(ca.megatron_h100_table(h100)[0], "error")]
    titan_a100 = ca.torchtitan_table(ca.TORCHTITAN_A100_ROWS, a100, "", ca.TOLERANCES["torchtitan_a100"])[0]
    titan_h100 = ca.torchtitan_table(ca.TORCHTITAN_H100_ROWS, h100_500w, "", ca.TOLERANCES["torchtitan_h100"])[0]
    a100_tokens = [_pct(e) for e in _column(titan_a100, "error", 0)]
    h100_tokens = [_pct(e) for e in _column(titan_h100, "error", 0)]
    h100_memory = zip(_column(titan_h100, "predicted GiB"), _column(titan_h100, "error", 1))
    return [
        ["Megatron-LM Table 1 (Narayanan et al. 2021), TFLOP/s per GPU, 10 rows from 1.7B on 32 GPUs to 1T on 3,072",
         "a100-80g", _span(megatron), tol["megatron"]],
        ["One 22B layer, forward / backward / combined, 5 settings (Korthikanti et al. 2022)", "a100-80g",
         f"worst {_worst(layer)}", tol["layer_22b"]],
        ["ZeRO model-state memory, 7.5B parameters, N_d = 1/4/16/64, stages 1/2/3", "-",
         "exact" if zero_exact else "not exact", "exact"],
        [("Megatron-LM H100 weak scaling (README, r0.8.0), TFLOP/s per GPU, 5 rows from 1.7B on 48 GPUs to 462B on "
          "6,144"), "h100-80g", _span(h100_rows), tol["megatron_h100"]],
        ["torchtitan FSDP2 on 64 A100: Llama 3 8B / 70B, Llama 2 13B / 70B, tokens/s per GPU", "a100-80g",
         _span(a100_tokens), tol["torchtitan_a100"]],
        ["torchtitan FSDP2 on 8 and 128 H100 96GB, Llama 3.1 8B, s = 8192, b = 2, selective: tokens/s per GPU",
         "h100-96g-500w", ", ".join(f"{e:+.1%}" for e in h100_tokens) + " (fitted on)", tol["torchtitan_h100"]],
        ["the same two runs: peak memory (published: maximum reserved, 82.4 and 67.0 GiB)", "h100-96g-500w",
         ", ".join(f"{gib} GiB ({err})" for gib, err in h100_memory), tol["torchtitan_h100_memory"]],
    ]


def render_mixtral_router() -> list[list[str]]:
    """benchmarks/cost_accuracy.py's Mixtral table, cell for cell."""
    from plait.spec.clusters import CLUSTER_PRESETS

    table = _script("cost_accuracy").mixtral_table(CLUSTER_PRESETS["h100-80g"])
    columns = [[_plain(str(cell)) for cell in column.cells] for column in table.columns]
    return [list(row) for row in zip(*columns)]


def _zero_cell_exact(cell: str) -> bool:
    """A ZeRO cell "published / plait" agrees to the published figure's last digit."""
    published, predicted = (part.strip() for part in str(cell).split("/"))
    digits = len(published.partition(".")[2])
    return abs(float(published) - float(predicted)) <= 0.5 * 10 ** -digits + 1e-9


MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "temporaries", "buffers", "reserve")


def _memory_row(label: str, plan) -> list[str]:  # noqa: ANN001
    """A memory table's row: the plan's predicted parts and peak, GiB per device."""
    from plait.cost import predict

    p = predict(plan)
    return [label, *(f"{p.memory_parts[k] / 2**30:.1f}" for k in MEMORY_PARTS), f"{p.peak_memory_bytes / 2**30:.1f}"]


def render_gpt3_memory() -> list[list[str]]:
    """GPT-3 175B as Korthikanti et al. ran it, priced by the tree: the "now" row of its memory table."""
    from published import MegatronRow, megatron_plan
    from plait.spec.clusters import CLUSTER_PRESETS

    plan = megatron_plan(MegatronRow(175.0, 96, 12288, 96, 8, 8, 64, 64, 0.0), CLUSTER_PRESETS["a100-80g"])
    return [_memory_row("now (autocast's 16-bit weight copies priced, as measured on a GPU)", plan)]


def render_llama2_13b_memory() -> list[list[str]]:
    """torchtitan's Llama 2 13B FSDP row on 64 A100s, priced by the tree."""
    from published_2024 import TORCHTITAN_A100_ROWS, torchtitan_plan
    from plait.spec.clusters import CLUSTER_PRESETS

    row = next(r for r in TORCHTITAN_A100_ROWS if r.model == "llama2-13b")
    return [_memory_row("torchtitan's Llama 2 13B row, priced", torchtitan_plan(row, CLUSTER_PRESETS["a100-80g"]))]


SCHEDULE_NAMES = {"1f1b": "1F1B", "gpipe": "GPipe", "zbv": "ZB-V", "dualpipev": "DualPipeV"}


def short_plan(description: str) -> str:
    """A plan's description as the page writes it: `dp16 tp2 pp16 cp2 (all-to-all) SP ZeRO-2 DualPipeV`."""
    words = []
    for word in description.split(" mb")[0].split():
        if word.startswith("context="):
            words.append("(" + word.removeprefix("context=").replace("_", "-") + ")")
        elif word == "sp":
            words.append("SP")
        elif word.startswith("zero"):
            words.append("ZeRO-" + word.removeprefix("zero"))
        else:  # a schedule by its name (dropping its "(v=2)"), any other word as it is
            words.append(SCHEDULE_NAMES.get(word.partition("(")[0], word))
    return " ".join(words)


def render_planner_speed() -> list[list[str | None]]:
    """benchmarks/planner_speed.py's rows: what the search answers (priced, pruned, best plan, MFU); the seconds
    are timings, left as the page has them (None)."""
    speed = _script("planner_speed")
    labels = {("gpt3-175b", 64): "GPT-3 175B, B 1536, s 2048", ("llama3-405b", 16384): "Llama 3 405B, B 2048, s 8192"}
    rows = []
    for index, (model, cluster, devices, _, _, top) in enumerate(speed.ROWS):
        top = top or 10  # the script's default --top
        found = speed.run_row(index, top, 1)
        rows.append([labels.get((model, devices), "GPT-3 175B" if model == "gpt3-175b" else model), cluster,
                     f"{devices:,}", str(top), f"{found['priced']:,}", f"{found['pruned']:,}", None, None,
                     short_plan(found["best"]), f"{found['mfu']:.1%}"])
    return rows


GPU_RESULTS = ROOT / "benchmarks" / "results" / "gpu"


@cache
def _repriced(run: str) -> list[dict]:
    """Every row of a saved gpu_check run, priced by this tree against the run's preset."""
    from plait.spec.clusters import CLUSTER_PRESETS

    gpu = _script("gpu_check")
    header = json.loads((GPU_RESULTS / run / "gpu_check.json").read_text())
    return gpu.reprice(header["grid"]["rows"], CLUSTER_PRESETS[header["preset"]])


def _measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["status"] == "measured"]


def _median_abs(rows: list[dict], key: str) -> float:
    return statistics.median(abs(r[key]) for r in rows if r.get(key) is not None)


def render_gpu_h200_summary() -> list[list[str]]:
    rows = _measured(_repriced("h200-2026-11-26"))
    by_mode = ", ".join(f"{mode} {_median_abs([r for r in rows if r['recompute'] == mode], 'step_time_error'):.1%}"
                        for mode in ("none", "selective", "full"))
    worst = max((r["allocated_error"] for r in rows), key=abs)
    n = f"{len(rows)} measured"
    return [["step time", f"**{_median_abs(rows, 'step_time_error'):.1%}** ({by_mode})", "10%", n],
            ["peak memory (max allocated)", f"**{_median_abs(rows, 'allocated_error'):.1%}** (worst {worst:+.1%})",
             "5%", n],
            ["max reserved, the default allocator",
             f"{_median_abs(rows, 'reserved_error'):.1%} against the prediction with its reserve", "-", n]]


def _status(row: dict) -> str:
    if row["status"].startswith("failed: out of memory"):
        return "out of memory"
    if row["status"].startswith("skipped: does not fit"):
        return "does not fit (memory model)"
    return row["status"]


def render_gpu_h200_grid() -> list[list[str]]:
    """The H200 grid, row by row: predicted step and memory by this tree, measured as saved."""
    out = []
    for r in _repriced("h200-2026-11-26"):
        head = [str(r["micro_batch"]), str(r["seq_len"]), r["recompute"], f"{r['predicted_step_time_s'] * 1e3:.0f}"]
        allocated = f"{r['predicted_allocated_bytes'] / 2**30:.1f}"
        if r["status"] != "measured":
            out.append([*head, _status(r), "", allocated, "", "", ""])
            continue
        out.append([*head, f"{r['step_time_s'] * 1e3:.0f}", f"{r['step_time_error']:+.1%}", allocated,
                    f"{r['allocated_bytes'] / 2**30:.1f}", f"{r['allocated_error']:+.1%}",
                    f"{r['reserved_bytes'] / 2**30:.1f}"])
    return out


def render_gpu_h100() -> list[list[str]]:
    runs = [_measured(_repriced(f"h100-2026-11-26-{x}")) for x in ("a", "b")]
    rows = []
    for label, key in (("step time", "step_time_error"), ("peak memory (max allocated)", "allocated_error"),
                       ("max reserved (expandable segments)", "reserved_error")):
        a, b = (f"{_median_abs(run, key):.1%}" for run in runs)
        rows.append([label, a, f"**{b}**" if key != "reserved_error" else b])
    return rows


CALIBRATION = ROOT / "benchmarks" / "results" / "calibration"
CASES = ("llama-dp2", "llama-tp2", "finetune", "mixtral")


def _ratios(files: list[Path], stage: str, clock: str = "measured_s") -> list[str]:
    """measured / predicted of each case's run at `stage`, in CASES order ("-" where the case did not run)."""
    runs = {case["case"]: case for f in files for case in json.loads(f.read_text())}
    out = []
    for name in CASES:
        steps = runs.get(name, {}).get(stage) or []
        out.append(f"{steps[0][clock] / steps[0]['predicted_s']:.2f}" if steps else "-")
    return out


def render_calibration() -> list[list[str]]:
    """The calibration table from the saved runs: measured / predicted per case and stage."""
    rows = []
    for label, files in (("this 2-core machine, r1", [CALIBRATION / "two-core-2026-11-26" / "cal-r1.json"]),
                         ("this 2-core machine, r2", [CALIBRATION / "two-core-2026-11-26" / "cal-r2.json"])):
        rows += [[label, "`local-cpu` preset", *_ratios(files, "preset")],
                 ["", "the run's quick profile", *_ratios(files, "quick profile")],
                 ["", "**after the calibration the run asked for**",
                  *(f"**{v}**" for v in _ratios(files, "after"))],
                 ["", "(the same, by the wall clock)", *_ratios(files, "after", "wall_clock_s")]]
    idle = sorted((CALIBRATION / "idle-16core-2026-11-26").glob("*.json"))
    rows += [["16 idle cores of a GPU machine, CUDA hidden (torch 2.11, transformers 5.17)", "`local-cpu` preset",
              *_ratios(idle, "preset")],
             ["", "the run's quick profile", *_ratios(idle, "quick profile")],
             ["", "**after the calibration**", *(v if v == "-" else f"**{v}**" for v in _ratios(idle, "after"))]]
    return rows


# Each renderer: (the rows it owns, whether it owns the whole table). Rows are matched by their first cells
# (the first two for tables whose first cell repeats, as the calibration's and the grid's do).
RENDERERS: dict[str, tuple[Callable[[], list[list[str]]], bool, int]] = {
    "cost-accuracy": (render_cost_accuracy, True, 1),
    "mixtral-router": (render_mixtral_router, True, 0),
    "gpt3-175b-memory": (render_gpt3_memory, False, 1),
    "llama2-13b-memory": (render_llama2_13b_memory, True, 1),
    "planner-speed": (render_planner_speed, True, 3),
    "gpu-h200-summary": (render_gpu_h200_summary, True, 1),
    "gpu-h200-grid": (render_gpu_h200_grid, True, 3),
    "gpu-h100": (render_gpu_h100, True, 1),
    "calibration": (render_calibration, True, 0),
}
"""id -> (renderer, whole table, key cells). Key cells 0: the rows are compared in order, whole."""


# ---- the check ------------------------------------------------------------------------------------

def _compare(rid: str, page: Path, table: list[str], rendered: list[list[str]], whole: bool, key: int
             ) -> tuple[list[str], list[str]]:
    """(problems, the table's lines with the rendered rows in place)."""
    header, rule, rows = table[0], table[1], table[2:]
    new_rows, problems = list(rows), []
    if key == 0:
        if [cells(r) for r in rows] != rendered:
            problems.append(f"{page}: table {rid!r} differs from what its command gives now")
        return problems, [header, rule, *(row_text(r) for r in rendered)]
    index = {tuple(cells(r)[:key]): i for i, r in enumerate(rows)}
    seen = set()
    for values in rendered:
        k = tuple(values[:key])
        seen.add(k)
        if k not in index:
            filled = ["?" if v is None else v for v in values]
            problems.append(f"{page}: table {rid!r} lacks the row {row_text(filled)}")
            new_rows.append(row_text(filled))
        else:
            page_values = cells(rows[index[k]])
            values = [mine if mine is not None else theirs for mine, theirs in zip(values, page_values)]
            if page_values != values:
                problems.append(f"{page}: table {rid!r}, row {' / '.join(k)}: the page says {rows[index[k]]}, "
                                f"the command gives {row_text(values)}")
                new_rows[index[k]] = row_text(values)
    if whole:
        extra = [r for r in rows if tuple(cells(r)[:key]) not in seen]
        problems += [f"{page}: table {rid!r} has a row its command no longer gives: {r}" for r in extra]
        new_rows = [r for r in new_rows if tuple(cells(r)[:key]) in seen]
    return problems, [header, rule, *new_rows]


def check(root: Path = ROOT, write: bool = False, render: bool = True) -> list[str]:
    """Every problem with the pages' tables, one line each; with `write`, the rendered rows put in place."""
    problems, ids = [], {}
    for page in pages(root):
        lines = page.read_text().split("\n")
        rel = page.relative_to(root)
        changed = False
        for first, end in reversed(tables(lines)):
            fields = marker_before(lines, first)
            if fields is None:
                if rel == BENCHMARKS_PAGE:
                    problems.append(f"{rel}: the table at line {first + 1} has no marker naming its command")
                continue
            rid = fields.get("id", "")
            problems += _marker_problems(root, rel, first, fields, ids)
            ids[rid] = rel
            if render and rid in RENDERERS:
                fn, whole, key = RENDERERS[rid]
                try:
                    rendered = fn()
                except Exception as error:  # a renamed function or a moved result: say which table, not a traceback
                    problems.append(f"{rel}: table {rid!r} could not be rendered: {type(error).__name__}: {error}")
                    continue
                found, new = _compare(rid, rel, lines[first:end], rendered, whole, key)
                problems += found
                if write and found:
                    lines[first:end] = new
                    changed = True
        if changed:
            page.write_text("\n".join(lines))
    problems += [f"check_tables.py renders {rid!r}, which no page marks" for rid in RENDERERS if rid not in ids]
    return problems


def _marker_problems(root: Path, page: Path, first: int, fields: dict, ids: dict) -> list[str]:
    where = f"{page}:{first + 1}"
    out = [f"{where}: a table marker lacks {name}=\"...\"" for name in ("id", "command", "results")
           if not fields.get(name)]
    if fields.get("id") in ids:
        out.append(f"{where}: table id {fields['id']!r} is also used in {ids[fields['id']]}")
    for script in re.findall(r"benchmarks/[\w/]+\.py", fields.get("command", "")):
        if not (root / script).is_file():
            out.append(f"{where}: the command names {script}, which does not exist")
    results = fields.get("results", "none")
    if results != "none":
        out += [f"{where}: results {path} does not exist" for path in results.split() if not (root / path).exists()]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the rendered rows on the pages")
    args = parser.parse_args(argv)
    problems = check(write=args.write)
    for line in problems:
        print(line)
    if not problems:
        print(f"every table marker holds; {len(RENDERERS)} tables re-rendered and in step")
        return 0
    print(f"{len(problems)} problem(s)" + (" (the rendered rows were written)" if args.write else
                                           "; `python benchmarks/check_tables.py --write` puts the rendered rows in"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
