"""Run the planner's top plans on this machine, compare predicted and measured step time, and
correct the cost model's terms from what was measured: GEMM efficiency, host time per layer pass
(and what DTensor adds to it under tensor parallelism), link latency and bandwidth.

examples:
  plait profile --nproc 2 --out cluster.yaml
  plait tune --model tiny-gpt --cluster cluster.yaml --top 4 --out cluster.tuned.yaml --plot tune.png
  plait plan --model tiny-gpt --cluster cluster.tuned.yaml --global-batch 8 --seq-len 128

All candidates run in one launch of N local ranks (or under torchrun: `torchrun --nproc-per-node N -m
plait tune ...`), each for --warmup untimed and --steps timed steps; a step's time is the slowest
rank's, a plan's the median over its steps. The corrected cluster file is written atomically.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from plait.errors import ConfigError, Interrupted, PlaitError
from plait.commands import positive_int
from plait.outputs import output_file

DEFAULT_CLUSTER = "local-cpu"
LAUNCH_SECONDS = 120.0
"""Allowance for starting the ranks and building each plan, on top of the steps themselves."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="M", help="model preset (e.g. tiny-gpt) or model file")
    parser.add_argument("--cluster", default=None, metavar="C",
                        help=f"cluster file from `plait profile` (or a preset; default: {DEFAULT_CLUSTER})")
    parser.add_argument("--nproc", type=positive_int, default=None, metavar="N",
                        help="local ranks (default: the cluster file's num_devices, else 2)")
    parser.add_argument("--top", type=positive_int, default=3, metavar="K",
                        help="plans to run: the best of each (dp, tp, pp) layout first, then of each micro-batch "
                             "count, then the next best (default: 3)")
    parser.add_argument("--global-batch", type=positive_int, default=8, metavar="B",
                        help="sequences per step (default: 8)")
    parser.add_argument("--seq-len", type=positive_int, default=128, metavar="S",
                        help="tokens per sequence (default: 128)")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per plan (default: 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: 2)")
    parser.add_argument("--out", default="cluster.tuned.yaml",
                        help="corrected cluster file (default: cluster.tuned.yaml)")
    parser.add_argument("--plot", default=None, metavar="FILE",
                        help="predicted-vs-measured plot (default: next to --out, as <out>.png)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before a hung run is stopped (default: scaled with --top and --steps)")


def main(args: argparse.Namespace) -> int:
    from plait.launch import in_torchrun

    if args.warmup < 0:
        raise ConfigError(f"--warmup {args.warmup}: must be 0 or more")
    out = output_file(args.out, "--out", "cluster.tuned.yaml")
    plot = output_file(args.plot, "--plot", "tune.png") if args.plot else output_file(out.with_suffix(".png"), "--plot")
    if in_torchrun():
        return _torchrun_main(args, out, plot)
    nproc = args.nproc or _cluster_file_devices(args.cluster) or 2
    cluster = resolve_cluster(args.cluster, nproc)
    plans = candidate_plans(args, cluster, nproc)
    results = _time_on_local_ranks(plans, args, nproc)
    return report_and_write(plans, results, cluster, out, plot)


# ---- inputs -------------------------------------------------------------------------------------


def _is_file_arg(name: str | None) -> bool:
    return name is not None and (os.sep in name or name.endswith((".yaml", ".yml", ".json")) or Path(name).exists())


def _cluster_file_devices(name: str | None) -> int | None:
    if not _is_file_arg(name):
        return None
    from plait.profile.clusterfile import read_cluster_file

    return read_cluster_file(name).num_devices


def resolve_cluster(name: str | None, nproc: int) -> Any:
    """The ClusterSpec to start from: a cluster file must have been made for `nproc` ranks and hold
    every field (refused naming which otherwise); a preset is narrowed to `nproc` devices on one node."""
    from plait.profile.clusterfile import validate_cluster_for_world
    from plait.spec.load import load_cluster

    if _is_file_arg(name):
        return validate_cluster_for_world(name, nproc)
    cluster = load_cluster(name or DEFAULT_CLUSTER)
    local = min(cluster.devices_per_node, nproc) if nproc % min(cluster.devices_per_node, nproc) == 0 else nproc
    return cluster.replace(num_devices=nproc, devices_per_node=local)


def train_spec(args: argparse.Namespace, cluster: Any) -> Any:
    """CPU ranks compute in fp32 (the executor's choice there), so the cost model must price fp32 too."""
    from plait.spec.load import load_train

    precision = "fp32" if cluster.device_type == "cpu" else "bf16"
    return load_train(global_batch=args.global_batch, seq_len=args.seq_len, precision=precision)


def candidate_plans(args: argparse.Namespace, cluster: Any, nproc: int) -> list[Any]:
    """--top plans for this model on `nproc` devices of `cluster`: the planner's ranking, but the best
    plan of each (dp, tp, pp) layout first. Plans that differ only in ZeRO stage or micro-batching
    exercise the same terms, so the top K alone often tell compute from nothing else; one per layout
    lets the fit separate compute, latency and bandwidth, and shows whether the planner's layout
    really wins here."""
    from plait.errors import NoFeasiblePlan
    from plait.search import plan as search_plans
    from plait.spec.load import load_model

    model = load_model(args.model)
    plans = list(search_plans(model, cluster, train_spec(args, cluster), num_devices=nproc))
    if not plans:
        raise NoFeasiblePlan(f"no plan of {model.name} fits {nproc} x {cluster.name}; try a smaller --global-batch "
                             "or --seq-len")
    from plait.profile.tune import layouts_first

    return layouts_first(plans)[:args.top]


# ---- measuring ----------------------------------------------------------------------------------

def _timeout(args: argparse.Namespace, count: int) -> float:
    return args.timeout or LAUNCH_SECONDS + count * (30.0 + 10.0 * (args.steps + args.warmup))


def _round_robin(cluster: Any) -> int:
    """Plans stepped in turn (plait.profile.tune.time_plans): all of them on CPU, where load from
    elsewhere is the noise to beat; one at a time on GPUs, so each plan's memory peak is its own."""
    return 1 if cluster.device_type == "cuda" else 64


def _time_on_local_ranks(plans: list[Any], args: argparse.Namespace, nproc: int) -> list[Any]:
    from plait.launch import run_local
    from plait.profile.tune import read_results, write_plans

    print(f"tune: timing {len(plans)} plan(s) on {nproc} local ranks, {args.warmup} warm-up + {args.steps} timed "
          "steps each", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="plait-tune-") as folder:
        plans_file, results_file = Path(folder, "plans.json"), Path(folder, "results.json")
        write_plans(plans, plans_file)
        timeout = _timeout(args, len(plans))
        argv = [str(plans_file), str(results_file), "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--batch", str(_round_robin(plans[0].cluster)), "--timeout", str(timeout)]
        try:
            code = run_local(nproc, argv, timeout_s=timeout, module="plait.profile.tune")
        except KeyboardInterrupt:
            raise Interrupted("nothing was written") from None
        if code != 0 or not results_file.exists():
            raise PlaitError(f"timing the plans on {nproc} ranks failed (exit code {code}); nothing was written")
        return read_results(results_file)


def _torchrun_main(args: argparse.Namespace, out: Path, plot: Path) -> int:
    """Every rank plans (the search is deterministic), all time the plans together, rank 0 reports."""
    import torch.distributed as dist

    from plait.launch import init_distributed
    from plait.profile.tune import TimingOptions, time_plans

    rank, world = init_distributed(timeout_s=_timeout(args, args.top))
    try:
        cluster = resolve_cluster(args.cluster, world)
        plans = candidate_plans(args, cluster, world)
        options = TimingOptions(steps=args.steps, warmup=args.warmup, batch=_round_robin(cluster))
        results = time_plans(plans, options)
        if rank == 0:
            report_and_write(plans, results, cluster, out, plot)
    finally:
        dist.destroy_process_group()
    return 0


# ---- report, fit, write -------------------------------------------------------------------------

def report_and_write(plans: list[Any], results: list[Any], cluster: Any, out: Path, plot: Path) -> int:
    from plait.profile.calibrate import Observation, fit_terms
    from plait.profile.clusterfile import write_cluster_file

    timed = [(p, r) for p, r in zip(plans, results) if r.median_s is not None]
    for plan, result in zip(plans, results):
        if result.error:
            print(f"tune: not timed: {plan.describe()}: {result.error}", file=sys.stderr)
    if not timed:
        raise PlaitError("no plan could be timed; nothing was written")
    fit = fit_terms([Observation(plan=p, measured_s=r.median_s) for p, r in timed], cluster)
    tuned = fit.cluster.replace(name=_tuned_name(cluster.name))
    _print_table(timed, cluster, tuned)
    _print_fit(fit, cluster, tuned)
    if fit.explains_nothing:
        raise PlaitError(
            f"the fit predicts these {len(timed)} plan(s) no better than {cluster.name} already does (median error "
            f"{statistics.median(fit.errors_before):.1%} -> {statistics.median(fit.errors_after):.1%}): the timings "
            f"are noise to the cost model, so {out} was not written; time more steps (--steps "
            f"{max(10, 2 * len(timed[0][1].step_times_s))}) and more plans (--top {max(6, 2 * len(timed))}), on an "
            f"otherwise idle machine")
    path = write_cluster_file(out, tuned, file_comments(timed, cluster, fit))
    print(f"wrote {path}  (use: plait plan --cluster {path} ...)")
    print(f"wrote {_plot(timed, cluster, fit, plot)}")
    return 0


def _tuned_name(name: str) -> str:
    return name if name.endswith("-tuned") else f"{name}-tuned"


def _predicted(plan: Any, cluster: Any) -> Any:
    from plait.cost import predict

    return predict(plan.replace(cluster=cluster, predicted=None))


def _print_table(timed: list[tuple[Any, Any]], cluster: Any, tuned: Any) -> None:
    from rich.table import Table

    from plait.report.console import output_console

    console = output_console()
    best = min(range(len(timed)), key=lambda i: timed[i][1].median_s)
    memory = any(r.peak_memory_bytes is not None for _, r in timed)
    table = Table(title=f"predicted vs measured step time ({cluster.name} -> {tuned.name})", title_justify="left")
    for name in ("#", "plan", "predicted s", "measured s", "error", "tuned s", "tuned error"):
        table.add_column(name, justify="left" if name == "plan" else "right")
    if memory:
        table.add_column("pred. memory", justify="right")
        table.add_column("meas. memory", justify="right")
    for i, (plan, result) in enumerate(timed):
        before, after = _predicted(plan, cluster), _predicted(plan, tuned)
        row = [str(i + 1), plan.describe() + ("  [bold green]<- measured best[/]" if i == best else ""),
               f"{before.step_time_s:.3f}", f"{result.median_s:.3f}", _signed(before.step_time_s, result.median_s),
               f"{after.step_time_s:.3f}", _signed(after.step_time_s, result.median_s)]
        if memory:
            measured = result.peak_memory_bytes
            row += [f"{before.peak_memory_bytes / 2**30:.2f} GiB",
                    "-" if measured is None else f"{measured / 2**30:.2f} GiB"]
        table.add_row(*row)
    console.print(table)


def _signed(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}"


def _print_fit(fit: Any, cluster: Any, tuned: Any) -> None:
    before, after = statistics.median(fit.errors_before), statistics.median(fit.errors_after)
    print(f"median error {before:.1%} -> {after:.1%} after tuning (worst {max(fit.errors_before):.1%} -> "
          f"{max(fit.errors_after):.1%}; in-sample, {len(fit.errors_after)} plans)")
    for line in factor_lines(fit, cluster, tuned):
        print("  " + line)
    for note in fit.notes:
        print(f"tune: note: {note}", file=sys.stderr)


def factor_lines(fit: Any, cluster: Any, tuned: Any) -> list[str]:
    """One line per fitted term: the ClusterSpec field it changed, and by how much."""
    lines = [_field_change(term, cluster, tuned) for term in fit.fitted]
    unchanged = [term for term in fit.before if term not in fit.fitted]
    if unchanged:
        lines.append(f"unchanged: {', '.join(unchanged)} (no timed plan spends 1% of its step on them)")
    return lines


def _field_change(term: str, cluster: Any, tuned: Any) -> str:
    old, new = cluster.efficiency, tuned.efficiency
    if term == "compute":
        ratio = (cluster.peak_flops * old.matmul) / (tuned.peak_flops * new.matmul)
        peak = (f", peak_flops {cluster.peak_flops / 1e9:.4g} -> {tuned.peak_flops / 1e9:.4g} GFLOP/s"
                if tuned.peak_flops != cluster.peak_flops else "")
        return f"compute: efficiency.matmul {old.matmul:.4g} -> {new.matmul:.4g}{peak} (GEMM time x{ratio:.3g})"
    from plait.profile.calibrate import HOST_TERMS

    if term in HOST_TERMS:
        field = f"{term}_s"
        old, new = cluster.host, tuned.host
        return (f"{term}: host.{field} {getattr(old, field) * 1e6:.0f} -> {getattr(new, field) * 1e6:.0f} us "
                f"{HOST_TERMS[term]}")
    level, _, quantity = term.partition("_")
    attr = {"intra": "intra_node", "inter": "inter_node"}[level]
    before, after = getattr(cluster, attr), getattr(tuned, attr)
    if quantity == "latency":
        return f"{term}: {attr}.latency_s {before.latency_s * 1e6:.1f} -> {after.latency_s * 1e6:.1f} us"
    return f"{term}: {attr}.bandwidth {before.bandwidth / 1e9:.3f} -> {after.bandwidth / 1e9:.3f} GB/s"


def file_comments(timed: list[tuple[Any, Any]], cluster: Any, fit: Any) -> list[str]:
    lines = [f"Written by `plait tune`: {cluster.name} corrected from the measured steps of {len(timed)} plan(s) "
             f"on {cluster.num_devices} rank(s).",
             f"median step-time error {statistics.median(fit.errors_before):.1%} before, "
             f"{statistics.median(fit.errors_after):.1%} after (in-sample)."]
    lines += factor_lines(fit, cluster, fit.cluster)
    lines += [f"note: {note}" for note in fit.notes]
    lines += [f"measured {r.median_s:.4f} s: {p.describe()}" for p, r in timed]
    return lines


def _plot(timed: list[tuple[Any, Any]], cluster: Any, fit: Any, path: Path) -> Path:
    """Measured against the tuned cluster's predictions (what the written file will predict), the untuned
    ones as hollow marks: the title's two errors name the two kinds of point."""
    from plait.report import plot_predicted_vs_measured

    rows = [(f"#{i + 1}", _predicted(p, fit.cluster).step_time_s, r.median_s) for i, (p, r) in enumerate(timed)]
    before = [_predicted(p, cluster).step_time_s for p, _ in timed]
    best = min(range(len(timed)), key=lambda i: timed[i][1].median_s)
    title = (f"{len(rows)} plans: tuned ({_tuned_name(cluster.name)}) median error "
             f"{statistics.median(fit.errors_after):.0%}; untuned ({cluster.name}, hollow) "
             f"{statistics.median(fit.errors_before):.0%}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return plot_predicted_vs_measured(rows, path, title=title, best_label=f"#{best + 1}", before=before)
