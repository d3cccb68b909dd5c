"""What `plait tune` does (plait/commands/tune.py parses its arguments): time candidate plans on local ranks, or
read what training runs measured, fit the cost model's constants the timings identify, and write the corrected
cluster file with a report and a predicted-vs-measured plot.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from plait.errors import ConfigError, Interrupted, PlaitError

DEFAULT_CLUSTER = "local-cpu"
LAUNCH_SECONDS = 120.0
"""Allowance for starting the ranks and building each plan, on top of the steps themselves."""


# ---- inputs -------------------------------------------------------------------------------------


def _is_file_arg(name: str | None) -> bool:
    return name is not None and (os.sep in name or name.endswith((".yaml", ".yml", ".json")) or Path(name).exists())


def cluster_file_devices(name: str | None) -> int | None:
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


CANDIDATES_PER_PLAN = 4
"""Plans considered per plan timed: the top --top x this of the planner's ranking (one per layout first)."""


def candidate_plans(args: argparse.Namespace, cluster: Any, nproc: int) -> list[Any]:
    """--top plans for this model on `nproc` devices of `cluster`: the planner's best, then, among the next best
    (one per (dp, tp, pp) layout first), those whose steps the constants move most differently
    (plait.profile.terms.informative_plans). Plans that differ only in ZeRO stage or micro-batching move the
    same constants alike, so the top K alone often tell compute from nothing else."""
    from plait.errors import NoFeasiblePlan
    from plait.search import plan as search_plans
    from plait.spec.load import load_model

    model = load_model(args.model)
    plans = list(search_plans(model, cluster, train_spec(args, cluster), num_devices=nproc))
    if not plans:
        raise NoFeasiblePlan(f"no plan of {model.name} fits {nproc} x {cluster.name}; try a smaller --global-batch "
                             "or --seq-len")
    from plait.profile.terms import informative_plans
    from plait.profile.tune import layouts_first

    return informative_plans(layouts_first(plans)[:CANDIDATES_PER_PLAN * args.top], cluster, args.top)


# ---- measuring ----------------------------------------------------------------------------------

def _timeout(args: argparse.Namespace, count: int) -> float:
    return args.timeout or LAUNCH_SECONDS + count * (30.0 + 10.0 * (args.steps + args.warmup))


def _round_robin(cluster: Any) -> int:
    """Plans stepped in turn (plait.profile.tune.time_plans): all of them on CPU, where load from
    elsewhere is the noise to beat; one at a time on GPUs, so each plan's memory peak is its own."""
    return 1 if cluster.device_type == "cuda" else 64


def time_on_local_ranks(plans: list[Any], args: argparse.Namespace, nproc: int) -> list[Any]:
    from plait.runtime.launch import run_local
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


def torchrun_main(args: argparse.Namespace, out: Path, plot: Path) -> int:
    """Every rank plans (the search is deterministic), all time the plans together, rank 0 reports."""
    from plait.runtime.launch import ending_together, init_distributed
    from plait.profile.tune import TimingOptions, time_plans

    rank, world = init_distributed(timeout_s=_timeout(args, args.top))
    with ending_together():
        cluster = resolve_cluster(args.cluster, world)
        plans = candidate_plans(args, cluster, world)
        options = TimingOptions(steps=args.steps, warmup=args.warmup, batch=_round_robin(cluster))
        results = time_plans(plans, options)
        if rank == 0:
            report_and_write(plans, results, cluster, out, plot)
    return 0


# ---- report, fit, write -------------------------------------------------------------------------

def report_and_write(plans: list[Any], results: list[Any], cluster: Any, out: Path, plot: Path) -> int:
    """Fit the timed plans' steps (plait tune), report and write; refuse a fit that does not generalise."""
    from plait.profile.terms import Observation

    timed = [(p, r) for p, r in zip(plans, results) if r.median_s is not None]
    for plan, result in zip(plans, results):
        if result.error:
            print(f"tune: not timed: {plan.describe()}: {result.error}", file=sys.stderr)
    if not timed:
        raise PlaitError("no plan could be timed; nothing was written")
    observations = [Observation(plan=p, measured_s=r.median_s) for p, r in timed]
    steps = len(timed[0][1].step_times_s)
    advice = (f"time more steps (--steps {max(10, 2 * steps)}) and more plans (--top {max(6, 2 * len(timed))}), on "
              f"an otherwise idle machine")
    memory = {id(p): r.peak_memory_bytes for p, r in timed}
    return fit_and_write(observations, cluster, out, plot, advice, f"the measured steps of {len(timed)} plan(s)",
                         memory)


def from_run(log_dirs: list[str], cluster_name: str | None, out: Path, plot: Path) -> int:
    """`plait tune --from-run LOG_DIR ...`: the parts each run measured (plait/train/measure.py), two halves of
    its steps each, as timings of its plan."""
    from plait.plan import Plan
    from plait.train.measure import read_measured

    segments = [(d, s) for d in log_dirs for s in read_measured(d)]
    uniform = [(d, s) for d, s in segments if not Plan.from_dict(s.plan).stage_groups]
    for d, s in segments:
        if Plan.from_dict(s.plan).stage_groups:
            print(f"tune: left out a plan of {d} on a mixed cluster (its groups' constants are not this cluster's): "
                  f"{Plan.from_dict(s.plan).describe()}", file=sys.stderr)
    if not uniform:
        raise ConfigError(f"{', '.join(log_dirs)}: no plan measured on a uniform cluster; nothing to fit")
    first = Plan.from_dict(uniform[0][1].plan)
    cluster = resolve_cluster(cluster_name, first.num_devices) if cluster_name else first.cluster
    observations = run_observations(uniform, cluster)
    if not observations:
        raise ConfigError(f"{', '.join(log_dirs)}: the runs measured no step past their warm-up; train longer")
    advice = ("train longer (more steps measured per run), or give runs of other plans (--from-run once per "
              "run), on an otherwise idle machine")
    return fit_and_write(observations, cluster, out, plot, advice,
                         f"what {len(log_dirs)} run(s) of `plait train` measured ({len(uniform)} plan(s))")


def run_observations(segments: list[tuple[str, Any]], cluster: Any) -> list[Any]:
    """Per (LOG_DIR, segment: a plan that run trained with) and half of its measured steps: compute, waiting and
    optimizer, each marked with its run (Observation.launch); a mixture-of-experts plan priced with the router
    balance its run measured."""
    from plait.plan import Plan
    from plait.profile.terms import Observation

    from plait.train.measure import SHARED_CORES_SHARE, measured_router_imbalance

    observations = []
    for log_dir, segment in segments:
        plan = Plan.from_dict(segment.plan).replace(cluster=cluster, predicted=None)
        if plan.model.num_experts and (router := measured_router_imbalance([segment])):
            # the experts' wait for the busiest rank is the router's, not a constant of the cluster: price it as
            # measured, so the fit does not fold it into the GEMM efficiency
            print(f"tune: priced {plan.describe()} with the router balance it measured: {router[1]} (planned with "
                  f"{plan.model.router_imbalance:g})")
            plan = plan.replace(model=plan.model.replace(router_imbalance=router[0]))
        if (queued := segment.queued_share()) is not None and queued >= SHARED_CORES_SHARE:
            wall, less = segment.measured(wall_clock=True), segment.measured()
            print(f"tune: {log_dir}: its ranks waited for a core held by other work for {queued:.0%} of the step; "
                  f"read less that wait ({less.step:.4g} s a step; {wall.step:.4g} s by the wall clock)")
        for parts in segment.measured_chunks(2):
            observations += [Observation(plan=plan, measured_s=getattr(parts, part), part=part, launch=str(log_dir))
                             for part in ("compute", "waiting", "optimizer") if getattr(parts, part) > 0]
    return observations


def fit_and_write(observations: list[Any], cluster: Any, out: Path, plot: Path, advice: str, source: str,
                  memory: dict[int, float | None] | None = None) -> int:
    from plait.profile.clusterfile import write_cluster_file
    from plait.profile.terms import fit_terms, refusal

    fit = fit_terms(observations, cluster)
    tuned = fit.cluster.replace(name=_tuned_name(cluster.name))
    _print_table(observations, fit, cluster, tuned, memory or {})
    _print_fit(fit, cluster, tuned)
    reason = refusal(fit)
    if reason:
        raise PlaitError(f"{reason}; {out} was not written. {advice[0].upper() + advice[1:]}")
    path = write_cluster_file(out, tuned, file_comments(observations, cluster, fit, source))
    print(f"wrote {path}  (use: plait plan --cluster {path} ...)")
    print(f"wrote {_plot(observations, cluster, fit, plot)}")
    return 0


def _tuned_name(name: str) -> str:
    return name if name.endswith("-tuned") else f"{name}-tuned"


def _predicted(plan: Any, cluster: Any) -> Any:
    from plait.cost import predict

    return predict(plan.replace(cluster=cluster, predicted=None))


def _label(observation: Any) -> str:
    part = "" if observation.part == "step" else f"  ({observation.part} part)"
    return observation.plan.describe() + part


def _print_table(observations: list[Any], fit: Any, cluster: Any, tuned: Any, memory: dict[int, float | None]) -> None:
    from rich.table import Table

    from plait.profile.terms import predicted_time
    from plait.report.console import output_console

    console = output_console()
    steps = [i for i, o in enumerate(observations) if o.part == "step"]
    best = min(steps, key=lambda i: observations[i].measured_s) if len(steps) > 1 else None
    shown_memory = any(memory.get(id(o.plan)) is not None for o in observations)
    table = Table(title=f"predicted vs measured ({cluster.name} -> {tuned.name})", title_justify="left")
    for name in ("#", "plan", "predicted s", "measured s", "error", "tuned s", "tuned error", "held-out error"):
        table.add_column(name, justify="left" if name == "plan" else "right")
    if shown_memory:
        table.add_column("pred. memory", justify="right")
        table.add_column("meas. memory", justify="right")
    for i, o in enumerate(observations):
        before, after = predicted_time(o.plan, cluster, o.part), predicted_time(o.plan, tuned, o.part)
        row = [str(i + 1), _label(o) + ("  [bold green]<- measured best[/]" if i == best else ""),
               f"{before:.3f}", f"{o.measured_s:.3f}", _signed(before, o.measured_s), f"{after:.3f}",
               _signed(after, o.measured_s), f"{fit.held_out[i]:.0%}" if fit.held_out else "-"]
        if shown_memory:
            measured = memory.get(id(o.plan))
            row += [f"{_predicted(o.plan, cluster).peak_memory_bytes / 2**30:.2f} GiB",
                    "-" if measured is None else f"{measured / 2**30:.2f} GiB"]
        table.add_row(*row)
    console.print(table)


def _signed(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}"


def summary_lines(fit: Any) -> list[str]:
    """Errors before and after (in-sample and held out), and whether the measured best plan ranks first."""
    from plait.profile.terms import rms

    n = len(fit.errors_before)
    held = f", held out {rms(fit.held_out):.1%} (each timing predicted by the fit of the others)" if fit.held_out else ""
    lines = [f"RMS error of {n} timing(s): {rms(fit.errors_before):.1%} before tuning; after: in-sample "
             f"{rms(fit.errors_after):.1%}{held}"]
    if fit.best_first_after is not None:
        lines.append(f"ranks the measured best plan first: {_yes(fit.best_first_before)} before tuning, "
                     f"{_yes(fit.best_first_after)} after")
    return lines


def _yes(flag: bool | None) -> str:
    return "yes" if flag else "no"


def _print_fit(fit: Any, cluster: Any, tuned: Any) -> None:
    for line in summary_lines(fit):
        print(line)
    for line in factor_lines(fit, cluster, tuned):
        print("  " + line)
    for note in fit.notes:
        print(f"tune: note: {note}", file=sys.stderr)


def factor_lines(fit: Any, cluster: Any, tuned: Any) -> list[str]:
    """One line per fitted term: the ClusterSpec field it changed, by how much, and its standard error."""
    lines = [_field_change(term, cluster, tuned, fit.uncertainty.get(term)) for term in fit.fitted]
    if fit.left:
        lines.append(f"left at their values: {', '.join(fit.left)} (the timings move them, but fitting them predicts "
                     f"none of the timings from the others better: time plans that differ in what they pay for)")
    unused = [term for term in fit.before if term not in fit.fitted and term not in fit.left]
    if unused:
        lines.append(f"unchanged: {', '.join(unused)} (no timing moves them by 1%)")
    return lines


def _field_change(term: str, cluster: Any, tuned: Any, error: float | None) -> str:
    from plait.profile.terms import HOST_TERMS, term_value

    spread = ""
    if error is not None and term_value(tuned, term) > 0:
        spread = f" (± {error / term_value(tuned, term):.0%})"
    old, new = cluster.efficiency, tuned.efficiency
    if term == "compute":
        ratio = (cluster.peak_flops * old.matmul) / (tuned.peak_flops * new.matmul)
        return f"compute: efficiency.matmul {old.matmul:.4g} -> {new.matmul:.4g} (GEMM time x{ratio:.3g}){spread}"
    if term in HOST_TERMS:
        field = f"{term}_s"
        old, new = cluster.host, tuned.host
        return (f"{term}: host.{field} {getattr(old, field) * 1e6:.0f} -> {getattr(new, field) * 1e6:.0f} us "
                f"{HOST_TERMS[term]}{spread}")
    level, _, quantity = term.partition("_")
    attr = {"intra": "intra_node", "inter": "inter_node"}[level]
    before, after = getattr(cluster, attr), getattr(tuned, attr)
    if quantity == "latency":
        return f"{term}: {attr}.latency_s {before.latency_s * 1e6:.1f} -> {after.latency_s * 1e6:.1f} us{spread}"
    return f"{term}: {attr}.bandwidth {before.bandwidth / 1e9:.3f} -> {after.bandwidth / 1e9:.3f} GB/s{spread}"


def file_comments(observations: list[Any], cluster: Any, fit: Any, source: str) -> list[str]:
    lines = [f"Written by `plait tune`: {cluster.name} corrected from {source} on {cluster.num_devices} rank(s)."]
    lines += summary_lines(fit)
    lines += factor_lines(fit, cluster, fit.cluster)
    lines += [f"note: {note}" for note in fit.notes]
    lines += [f"measured {o.measured_s:.4f} s: {_label(o)}" for o in observations]
    return lines


def _plot(observations: list[Any], cluster: Any, fit: Any, path: Path) -> Path:
    """Measured against the tuned cluster's predictions (what the written file will predict), the untuned
    ones as hollow marks: the title's errors name the kinds of point."""
    from plait.profile.terms import predicted_time, rms
    from plait.report import plot_predicted_vs_measured

    rows = [(f"#{i + 1}", predicted_time(o.plan, fit.cluster, o.part), o.measured_s) for i, o in enumerate(observations)]
    before = [predicted_time(o.plan, cluster, o.part) for o in observations]
    best = min(range(len(observations)), key=lambda i: observations[i].measured_s)
    held = f", held out {rms(fit.held_out):.0%}" if fit.held_out else ""
    title = (f"{len(rows)} timings: tuned ({_tuned_name(cluster.name)}) RMS error {rms(fit.errors_after):.0%}"
             f"{held}; untuned ({cluster.name}, hollow) {rms(fit.errors_before):.0%}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return plot_predicted_vs_measured(rows, path, title=title, best_label=f"#{best + 1}", before=before)
