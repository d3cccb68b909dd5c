"""Which solver to use: each solver's gap to an independent reference, the candidates it priced and its time, on
uniform and mixed clusters up to 1,024 devices, most of them of families the learned solver never saw in training.

Problems (plait.search.training; seeds and ranges apart from training's):

* uniform: wider and deeper decoders (40-96 layers, 40-96 heads, longer sequences) than the layout scorer was
  trained on, on `--uniform-devices` devices of one public part; reference: exact search's optimum.
* mixed, one row per family of plait.search.training.PLACEMENT_FAMILIES: "train" (the only family the placement
  policy was trained on: two groups of 1-4 nodes), and kept out of training: "held-out" (two or three groups of
  2-8 nodes), "four-groups", "slow-stragglers" (a part beside copies at 15-35% of its speed; training saw 40-70%),
  "large" (two groups of 16-64 nodes: 256 to 1,024 devices, pipelines far longer than training's).

The reference never comes from the learned solver's result:
* "exact": exact search finished within `--limit` seconds: the cost model's optimum;
* "pinned": where it did not, exact search over every placement, micro-batch, ZeRO stage and schedule with the
  degrees (dp, tp, pp, cp, ep) pinned, once for the degrees of each solver's best plan, each within `--limit`
  (the least of those it finished; said "pinned*" where one stopped at its limit). The learned solver can be
  worse than that reference (a placement or micro-batch it missed) or better (degrees no other solver tried:
  a negative gap).
* "bound": a proven lower bound on the optimum over the whole space (plait.search.pricing.Pricer.lower_bound of
  every layout: the work spread evenly on the fastest group, no recompute), so "gap to bound" is the most a plan
  can be from the optimum. Loose on mixed clusters (it prices every rank at the fastest group's pace).

Solvers: exact and dichotomy (stopped at `--limit`), learned with its default budget, learned with the placement
policy alone (random_orderings=0), learned with four times the budget (proposals 96, orderings 16, random 16):
each an argument of the search (plait.search.plan_with_stats' solver_options), nothing patched.

Also, on request: `--placements N` (the placement policy's orderings, random ones and the learned solver's, against
the best ordering of N layouts per mixed family) and `--top-check N` (exact search with --top 1 against the full
search, both under the full schedule simulation).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/solvers.py [--uniform 4] [--mixed 2] [--limit 30]
        [--placements 16] [--top-check 8]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

SOLVERS = {
    "exact": ("exact", {}),
    "dichotomy": ("dichotomy", {}),
    "learned": ("learned", {}),
    "learned, policy only": ("learned", {"random_orderings": 0}),
    "learned, 4x budget": ("learned", {"proposals": 96, "orderings": 16, "random_orderings": 16}),
}
LIMITED = ("exact", "dichotomy")
MIXED_FAMILIES = ("train", "held-out", "four-groups", "slow-stragglers", "large")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uniform", type=int, default=4, help="uniform problems per device count")
    parser.add_argument("--uniform-devices", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--mixed", type=int, default=2, help="mixed-cluster problems per family")
    parser.add_argument("--families", nargs="+", default=list(MIXED_FAMILIES), choices=MIXED_FAMILIES)
    parser.add_argument("--limit", type=float, default=30.0,
                        help="time limit of each exact, dichotomy and pinned-reference search, seconds")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--top-check", type=int, default=0, metavar="N",
                        help="also: on N small uniform problems (16-64 devices), how far exact search's --top 1 plan "
                             "is from the best of every feasible plan under the full schedule simulation")
    parser.add_argument("--placements", type=int, default=0, metavar="N",
                        help="also: for N layouts of each mixed family (pipelines of 20-5,000 placements), the best "
                             "of the orderings each way proposes against the best of all of them")
    parser.add_argument("--json", help="also write the per-problem results here")
    return parser.parse_args()


def problems(args: argparse.Namespace) -> list[tuple[str, object, object, object, int]]:
    from plait.search.training import mixed_cluster, random_problem
    from plait.spec import TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    rng = random.Random(args.seed)
    out = []
    for devices in args.uniform_devices:
        for _ in range(args.uniform):
            model, cluster, train, _ = random_problem(rng, "held-out")
            batch = devices * rng.choice([1, 2])
            out.append((f"uniform {devices}", model, CLUSTER_PRESETS[cluster].with_devices(devices),
                        TrainSpec(global_batch=batch, seq_len=train.seq_len), devices))
    for family in args.families:
        for _ in range(args.mixed):
            model, _, train, _ = random_problem(rng, "train")
            cluster = mixed_cluster(rng, family)
            out.append((f"mixed {family}", model, cluster,
                        TrainSpec(global_batch=cluster.num_devices * 2, seq_len=train.seq_len), cluster.num_devices))
    return out


def solve(model, cluster, train, devices: int, solver: str, options: dict, limit: float | None, **pins) -> dict:
    from plait.search import plan_with_stats

    began = time.perf_counter()
    try:
        result = plan_with_stats(model, cluster, train, num_devices=devices, top=1, solver=solver,
                                 solver_options=options, explain_infeasible=False, time_limit_s=limit, **pins)
    except Exception as error:  # e.g. no layout at all, or a limit reached before any plan: the row says so
        return {"time": math.inf, "seconds": time.perf_counter() - began, "complete": False, "evaluated": 0,
                "error": str(error)[:200]}
    best = result.plans[0] if result.plans else None
    return {"time": best.predicted.step_time_s if best else math.inf, "seconds": time.perf_counter() - began,
            "complete": result.complete, "evaluated": result.candidates_evaluated,
            "degrees": dict(best.degrees.to_dict()) if best else None, "plan": best.describe() if best else None}


def lower_bound(model, cluster, train, devices: int) -> float:
    """The least Pricer.lower_bound over every layout of the space: no plan's estimated step time is below it."""
    from plait.cost.layout import Setting
    from plait.search.pricing import Pricer
    from plait.search.space import Pins, Space, degree_choices

    pins = Pins()
    pricer = Pricer(Setting(model, cluster.with_devices(devices) if not cluster.mixed else cluster, train), pins, None)
    degrees = degree_choices(pins, model, cluster, train, devices)
    groups = tuple((g.name, g.num_devices) for g in cluster.groups) if cluster.mixed else ()
    space = Space(pins, degrees, train.global_batch, model.num_layers, groups, model, train.seq_len)
    return min((pricer.lower_bound(layout) for d in degrees for layout in space.base_layouts(d)), default=math.inf)


def reference(model, cluster, train, devices: int, runs: dict, limit: float) -> tuple[float, str]:
    """The exact optimum where exact search finished; else the exact search with each solver's degrees pinned."""
    if runs["exact"]["complete"] and math.isfinite(runs["exact"]["time"]):
        return runs["exact"]["time"], "exact"
    pinned = {json.dumps(r["degrees"], sort_keys=True) for r in runs.values() if r.get("degrees")}
    results = [solve(model, cluster, train, devices, "exact", {}, limit, **json.loads(d)) for d in sorted(pinned)]
    best = min((r["time"] for r in results), default=math.inf)
    return best, "pinned" if all(r["complete"] for r in results) else "pinned*"


def top_check(count: int, seed: int) -> None:
    """--top K prunes by the quick estimate and re-prices a shortlist of 2K under the full simulation; the full
    search re-prices every feasible plan. The gap between their best plans, per problem."""
    from plait.search import plan_with_stats
    from plait.search.training import random_problem
    from plait.spec import TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    rng = random.Random(seed + 1)
    gaps = []
    while len(gaps) < count:
        model, cluster, train, devices = random_problem(rng, "train")
        devices = rng.choice([16, 32, 64])
        train = TrainSpec(global_batch=devices * rng.choice([1, 2, 4]), seq_len=train.seq_len)
        spec = CLUSTER_PRESETS[cluster].with_devices(devices)
        try:
            top = plan_with_stats(model, spec, train, top=1, solver="exact", explain_infeasible=False)
            full = plan_with_stats(model, spec, train, top=None, solver="exact", explain_infeasible=False)
        except Exception:  # no layout for this shape: draw another
            continue
        if not top.plans:
            continue
        gap = top.plans[0].predicted.step_time_s / full.plans[0].predicted.step_time_s - 1
        gaps.append(gap)
        print(f"top-1 check {model.name} on {devices} x {cluster}: {len(full.plans)} feasible plans, top-1 "
              f"{'the same plan' if top.plans[0].describe() == full.plans[0].describe() else 'another plan'}, "
              f"{gap:+.3%}", flush=True)
    print(f"exact search with --top 1 against the full search, {count} problems: same best plan in "
          f"{sum(g <= 1e-9 for g in gaps)}, mean gap {statistics.fmean(gaps):+.3%}, worst {max(gaps):+.3%}")


def placements(count: int, families: list[str]) -> None:
    """Per family: how far the best of the placement policy's orderings (greedy + 4 sampled), of 5 uniformly random
    ones, and of the learned solver's (both: LearnedSolver.placements) are from the best ordering of a layout."""
    from plait.search.groups import propose, random_orderings
    from plait.search.learned import LearnedSolver
    from plait.search.space import _multiset_permutations
    from plait.search.training import group_problems

    solver = LearnedSolver()
    for family in families:
        if family == "large":  # its pipelines have too many orderings to enumerate
            continue
        gaps: dict[str, list[float]] = {"policy": [], "random 5": [], "learned solver": []}
        for p in group_problems(77, count, family):
            best = min(p.time(o) for o in _multiset_permutations(p.counts))
            if not math.isfinite(best):
                continue
            for name, ways in (("policy", propose(p.pricer, p.layout, p.counts, 4)),
                               ("random 5", random_orderings(p.counts, 5, seed=1)),
                               ("learned solver", solver.placements(p.pricer, p.layout, p.counts))):
                gaps[name].append(min(p.time(o) for o in ways) / best - 1)
        print(f"placements, {family} ({len(gaps['policy'])} layouts): " + ", ".join(
            f"{name} mean {statistics.fmean(g):+.2%} worst {max(g):+.2%}" for name, g in gaps.items() if g)
            + f"; policy worse than random 5 in {sum(a > b + 1e-9 for a, b in zip(gaps['policy'], gaps['random 5']))}",
            flush=True)


def main() -> None:
    args = parse_args()
    if args.placements:
        placements(args.placements, args.families)
    if args.top_check:
        top_check(args.top_check, args.seed)
    rows = []
    for family, model, cluster, train, devices in problems(args):
        runs = {name: solve(model, cluster, train, devices, solver, options, args.limit if name in LIMITED else None)
                for name, (solver, options) in SOLVERS.items()}
        ref, kind = reference(model, cluster, train, devices, runs, args.limit)
        if not math.isfinite(ref):
            print(f"{family}: {model.name} on {devices} devices: no reference (nothing fits?); left out", flush=True)
            continue
        bound = lower_bound(model, cluster, train, devices)
        rows.append({"family": family, "model": model.name, "devices": devices, "reference": ref, "kind": kind,
                     "bound": bound, "runs": runs})
        print(f"{family:24s} {devices:5d} dev, {model.num_layers} layers h={model.hidden_size}, ref {kind} "
              f"(bound {bound / ref - 1:+.1%}): " + ", ".join(
                  f"{name} {r['seconds']:.1f}s/{r['evaluated']} {r['time'] / ref - 1:+.2%}" for name, r in runs.items()),
              flush=True)
    report(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


def _percent(values: list[float], how) -> str:
    finite = [v for v in values if math.isfinite(v)]
    missing = len(values) - len(finite)
    text = f"{how(finite):+.2%}" if finite else "-"
    return text + (f" ({missing} none)" if missing else "")


def report(rows: list[dict], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"solvers against an independent reference (limit {args.limit:g} s; gap: predicted step time "
                        f"of the best plan over the reference's)")
    for column in ("family", "solver", "problems", "reference", "mean gap", "worst gap", "median candidates",
                   "median time", "gap to bound (worst)"):
        table.add_column(column, justify="left" if column in ("family", "solver", "reference") else "right")
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family]
        kinds = ", ".join(f"{k} {sum(r['kind'] == k for r in mine)}" for k in dict.fromkeys(r["kind"] for r in mine))
        for name in SOLVERS:
            gaps = [r["runs"][name]["time"] / r["reference"] - 1 for r in mine]
            to_bound = [r["runs"][name]["time"] / r["bound"] - 1 for r in mine]
            table.add_row(family, name, str(len(mine)), kinds, _percent(gaps, statistics.fmean),
                          _percent(gaps, max), f"{statistics.median(r['runs'][name]['evaluated'] for r in mine):,.0f}",
                          f"{statistics.median(r['runs'][name]['seconds'] for r in mine):.2f} s",
                          _percent(to_bound, max))
        table.add_section()
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
