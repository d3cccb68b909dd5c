"""Rank parallel plans for a model on a cluster.

examples:
  plait plan --model gpt3-175b --cluster a100-80g --devices 1024 --global-batch 1536 --seq-len 2048
  plait plan --model llama3-70b --cluster h100-80g --devices 64 --global-batch 512 --seq-len 8192 --tp 8
  plait plan --model examples/hf/mistral-7b/config.json --cluster examples/clusters/a100-cluster.yaml \\
             --global-batch 256 --seq-len 4096 --json plans.json --report report/
  plait plan --model tiny-gpt --cluster local-cpu --devices 4 --global-batch 8 --seq-len 128
  plait plan --model llama3-8b --cluster h100-80g --devices 8 --global-batch 8 --seq-len 131072 --cp 4
  plait plan --model mixtral-8x7b --cluster h100-80g --devices 64 --global-batch 256 --seq-len 4096 --ep 8

The model is a preset name, a Hugging Face config.json (Llama, Mistral, Qwen2/3, Gemma, GPT-2; Mixtral
and Qwen3-MoE shapes) or a plait model file; the cluster a preset name or a cluster file. Every pin is optional; the search
completes the rest. `--json` writes {"plans": [...], "search": {...}}, best first, which
`plait train`, `plait check` and `Plan.from_json` read.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from plait.plan import ISLAND_METHODS, RECOMPUTE_MODES, SCHEDULES
from plait.commands import load_ratio, positive_float, positive_int
from plait.errors import ConfigError

PROGRESS_AFTER_S = 0.5
"""Show a spinner on stderr only when the search outlasts this, so quick plans print nothing extra."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from plait.spec.clusters import CLUSTER_PRESETS

    what = parser.add_argument_group("what to plan for")
    what.add_argument("--model", required=True, metavar="M",
                      help="model preset (e.g. gpt3-175b, llama3-8b, tiny-gpt), HF config.json, or plait model file")
    what.add_argument("--cluster", required=True, metavar="C",
                      help=f"cluster preset ({', '.join(CLUSTER_PRESETS)}) or cluster file")
    what.add_argument("--devices", type=positive_int, metavar="N", help="devices to plan for (default: the cluster's)")
    what.add_argument("--global-batch", type=positive_int, required=True, metavar="B", help="sequences per step")
    what.add_argument("--seq-len", type=positive_int, required=True, metavar="S", help="tokens per sequence")
    what.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                      help="16-bit keeps fp32 master weights and Adam states (default: bf16 on GPUs, fp32 on CPU "
                           "clusters, which is what plait runs there)")
    what.add_argument("--document-len", type=positive_int, metavar="D",
                      help="rows pack documents of D tokens on average, each attending to itself only (`plait train` "
                           "with data.packing = \"documents\" measures its data's): attention is priced over each "
                           "document's own square (docs/attention-and-loss.md)")
    what.add_argument("--router-imbalance", type=load_ratio, metavar="R",
                      help="mixture-of-experts models: slots the busiest expert-parallel rank receives over the mean "
                           "(default: the model's router_imbalance, 1.25 unless set; `plait train` measures your "
                           "router's in LOG_DIR/measured.json: see --from-run)")
    what.add_argument("--from-run", metavar="LOG_DIR",
                      help="mixture-of-experts models: price expert parallelism with the router balance a `plait "
                           "train` run measured (LOG_DIR/measured.json) instead of --router-imbalance")
    what.add_argument("--lora-rank", type=positive_int, metavar="R",
                      help="price LoRA fine-tuning: rank-R adapters on a frozen base (docs/lora.md)")
    what.add_argument("--lora-targets", metavar="NAMES",
                      help="with --lora-rank: the linear layers adapted, comma-separated module names of the blocks "
                           "(q_proj,v_proj; the presets' are wq,wk,wv,wo,w1,w2,w3), or all-linear (the default)")
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=positive_int, default=5, metavar="K", help="plans to show and write (default: 5)")
    out.add_argument("--json", type=Path, metavar="FILE", help="write the ranked plans as JSON")
    out.add_argument("--report", type=Path, metavar="DIR",
                     help="write PNG plots: pipeline timeline, memory per stage, candidates scatter")
    pins = parser.add_argument_group("pins (each optional; the search completes the rest)")
    pins.add_argument("--dp", type=positive_int, metavar="N", help="data-parallel degree")
    pins.add_argument("--tp", type=positive_int, metavar="N", help="tensor-parallel degree")
    pins.add_argument("--pp", type=positive_int, metavar="N", help="pipeline-parallel degree")
    pins.add_argument("--cp", type=positive_int, metavar="N",
                      help="context-parallel degree (each rank holds 1/N of every sequence)")
    pins.add_argument("--ep", type=positive_int, metavar="N",
                      help="expert-parallel degree (experts split over N ranks of each data-parallel group)")
    pins.add_argument("--context-parallel", choices=("all_gather", "all_to_all"), default=None,
                      help="how context-parallel ranks see each other's keys and values: all_gather (K/V gathered "
                           "along the sequence) or all_to_all (Ulysses: heads swapped for the sequence); default: "
                           "the cheaper")
    pins.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (3 = FSDP)")
    pins.add_argument("--recompute", choices=RECOMPUTE_MODES, help="activation recomputation on every stage")
    pins.add_argument("--micro-batch", type=positive_int, metavar="N", help="sequences per micro-batch")
    pins.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule")
    pins.add_argument("--interleave", type=positive_int, metavar="V", help="model chunks per pipeline rank")
    pins.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                      help="sequence parallelism over the tensor group")
    pins.add_argument("--allow-cross-node-tp", action="store_true", help="let tensor groups span nodes")
    isl = parser.add_argument_group("islands (a cluster file with `islands:`; docs/islands.md)")
    isl.add_argument("--island-method", choices=ISLAND_METHODS,
                     help="how islands talk: synchronous data parallelism over the slow link, or DiLoCo")
    isl.add_argument("--inner-steps", type=int, metavar="H", help="DiLoCo's inner steps between outer steps")
    isl.add_argument("--fragments", type=int, metavar="F", help="streaming DiLoCo: model parts exchanged in turn")
    isl.add_argument("--island-precision", choices=("fp32", "bf16", "int8"),
                     help="element type of the pseudo-gradients on the slow link")
    isl.add_argument("--overlap", type=int, metavar="T",
                     help="inner steps each exchange runs under before it is applied (streaming DiLoCo's tau)")
    how = parser.add_argument_group("search")
    # plait.search.solvers.SOLVER_NAMES, spelt here so that parsing imports no search (a test holds them equal)
    how.add_argument("--solver", choices=("exact", "dichotomy", "learned", "auto"), default="auto",
                     help="how the space is searched: exact (the cost model's optimum), dichotomy (bisection over "
                          "the micro-batch size, CSIMD), learned (a network trained offline proposes), auto "
                          "(default: exact, but learned on a mixed cluster whose placements are too many to price)")
    how.add_argument("--time-limit", type=positive_float, metavar="S",
                     help="stop the search after S seconds and show the best plans found so far (said so)")
    from plait.commands.operators import add_operator_arguments

    add_operator_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from plait.outputs import output_dir, output_file
    from plait.spec.load import load_cluster, load_model, load_train

    if args.json:
        output_file(args.json, "--json", "plans.json")
    if args.report:
        output_dir(args.report, "--report")
    if args.batch:  # a module of any shape: per-operator sharding (plait/commands/operators.py)
        from plait.commands.operators import plan_operators

        return plan_operators(args)
    from plait.train.resolve import check_position_limit

    model = with_lora_args(with_router_balance(load_model(args.model), args.router_imbalance, args.from_run), args)
    cluster = load_cluster(args.cluster)
    train = load_train(global_batch=args.global_batch, seq_len=args.seq_len,
                       precision=args.precision or default_precision(cluster), document_len=args.document_len)
    check_position_limit(model, train.seq_len, "--seq-len")  # as `plait train` refuses it
    if args.precision == "fp16":
        print("plait plan: warning: --precision fp16 prices fp16, but plait train refuses it (no loss scaler); "
              "bf16 trains, on CPU too", file=sys.stderr)
    num_devices = args.devices or cluster.num_devices
    if cluster.islands is not None:
        return _plan_islands(model, cluster, train, num_devices, args)
    _refuse_island_pins(args)
    result = _with_progress(lambda: _search(model, cluster, train, num_devices, args),
                            f"planning {model.name} on {num_devices:,} x {cluster.name}")
    _print_result(result, args.top, model, cluster, num_devices)
    if cluster.failures is not None:  # goodput of the run as one job, or as torchft replica groups
        from plait.report.islands import print_replica_groups
        from plait.search.islands import replica_group_choice

        print_replica_groups(replica_group_choice(model, cluster, train, num_devices, **_search_pins(args)))
    _print_unpriced(model, train.seq_len)
    if args.json:
        _write_json(args.json, result, args.top)
    if args.report:
        _write_report(args.report, result)
    return 0


def with_lora_args(model: Any, args: argparse.Namespace) -> Any:
    """`model` with the LoRA adapters --lora-rank and --lora-targets ask for (counted on meta), or as it is."""
    if args.lora_rank is None:
        if args.lora_targets:
            raise ConfigError(f"--lora-targets {args.lora_targets!r} needs --lora-rank (the adapters' rank, e.g. 16)")
        return model
    from plait.models.lora import with_lora
    from plait.spec.lora import ALL_LINEAR, Lora

    targets = tuple(t.strip() for t in (args.lora_targets or ALL_LINEAR).split(",") if t.strip())
    try:
        lora = Lora(rank=args.lora_rank, targets=targets)
    except ValueError as e:
        raise ConfigError(f"--lora-targets: {e}") from None
    return with_lora(model, lora)


def _plan_islands(model: Any, cluster: Any, train: Any, num_devices: int, args: argparse.Namespace) -> int:
    """A cluster of islands: one island's plan, then how the islands talk, beside the synchronous alternative."""
    from plait.report.islands import print_islands
    from plait.search.islands import IslandPins, plan_islands

    if num_devices != cluster.num_devices:
        raise ConfigError(f"--devices {num_devices}: a cluster of islands is planned whole ({cluster.islands.count} "
                          f"islands of {cluster.island_devices}); leave --devices out")
    pins = IslandPins(method=args.island_method, inner_steps=args.inner_steps, fragments=args.fragments,
                      precision=args.island_precision, overlap=args.overlap)
    choice = _with_progress(lambda: plan_islands(model, cluster, train, top=args.top, island_pins=pins,
                                                 **_search_pins(args)),
                            f"planning {model.name} on {cluster.islands.count} islands of {cluster.name}")
    result = choice.inner
    island_result = type(result)(choice.plans, result.candidates_evaluated, result.seconds, None, result.points,
                                 result.candidates_pruned, result.solver, result.complete)
    _print_result(island_result, args.top, model, cluster.island_view(), cluster.island_devices)
    print_islands(choice, cluster)
    _print_unpriced(model, train.seq_len)
    if args.json:
        import dataclasses

        _write_json(args.json, island_result, args.top, {"islands": {
            "chosen": choice.chosen.describe(), "why": choice.why,
            "options": [{"exchange": o.describe(), **dataclasses.asdict(o)} for o in choice.options],
            "failures": {name: dataclasses.asdict(cost) for name, cost in choice.failures.items()}}})
    if args.report:
        _write_report(args.report, island_result)
    return 0


def _refuse_island_pins(args: argparse.Namespace) -> None:
    given = [flag for flag, value in (("--island-method", args.island_method), ("--inner-steps", args.inner_steps),
                                      ("--fragments", args.fragments), ("--island-precision", args.island_precision),
                                      ("--overlap", args.overlap)) if value is not None]
    if given:
        raise ConfigError(f"{given[0]} prices islands, but cluster {args.cluster} has none; add an `islands:` "
                          "section to the cluster file (examples/clusters/two-clusters-one-region.yaml)")


def with_router_balance(model: Any, given: float | None, log_dir: str | None) -> Any:
    """`model` priced with the router balance given (--router-imbalance) or measured by a run (--from-run), said
    on stderr; ConfigError for a dense model or both at once."""
    if given is None and log_dir is None:
        return model
    flag = "--router-imbalance" if log_dir is None else "--from-run"
    if given is not None and log_dir is not None:
        raise ConfigError(f"--router-imbalance {given:g} and --from-run {log_dir}: give one (--from-run reads the "
                          f"figure the run measured)")
    if not model.num_experts:
        raise ConfigError(f"{flag} prices expert parallelism, but {model.name} has no experts; leave it out for a "
                          "dense model")
    if log_dir is None:
        return model.replace(router_imbalance=given)
    from plait.train.measure import run_router_imbalance

    figure, how, trained = run_router_imbalance(log_dir)
    if trained != model.name:
        print(f"plait plan: warning: {log_dir} trained {trained}, not {model.name}: its router may balance "
              "differently", file=sys.stderr)
    print(f"plait plan: router balance {how}, measured by {log_dir} (was {model.router_imbalance:g})",
          file=sys.stderr)
    return model.replace(router_imbalance=figure)


def default_precision(cluster: Any) -> str:
    """What plait's executor computes in on this cluster: fp32 on CPU (no fast 16-bit GEMMs there), else bf16."""
    return "fp32" if cluster.device_type == "cpu" else "bf16"


def _search(model: Any, cluster: Any, train: Any, num_devices: int, args: argparse.Namespace) -> Any:
    from plait.search import plan_with_stats

    return plan_with_stats(model, cluster, train, num_devices=num_devices, top=args.top, **_search_pins(args))


def _search_pins(args: argparse.Namespace) -> dict[str, Any]:
    return dict(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, context_parallel=args.context_parallel,
                zero=args.zero, recompute=args.recompute, micro_batch=args.micro_batch, schedule=args.schedule,
                interleave=args.interleave, sequence_parallel=args.sequence_parallel,
                allow_cross_node_tp=args.allow_cross_node_tp, solver=args.solver, time_limit_s=args.time_limit)


def _with_progress(work: Callable[[], Any], message: str) -> Any:
    """Run `work` in a worker thread; if it outlasts PROGRESS_AFTER_S, show a spinner on stderr."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = work()
        except BaseException as e:  # re-raised in the caller's thread, so the CLI's error handling applies
            box["error"] = e

    worker = threading.Thread(target=target, name="plait-search", daemon=True)
    worker.start()
    worker.join(PROGRESS_AFTER_S)
    if worker.is_alive():
        from rich.console import Console

        with Console(stderr=True).status(message + " ..."):
            worker.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _print_result(result: Any, top: int, model: Any, cluster: Any, num_devices: int) -> None:
    from plait.report.console import output_console
    from plait.report.tables import (GROUPS_LEGEND, LAYERS_LEGEND, human_count, plans_table, search_stats_line,
                                     stages_table)

    console = output_console()
    plans = list(result.plans)
    title = (f"{model.name} ({human_count(model.num_params)} params) on {num_devices:,} × {cluster.name}, "
             f"batch {result_batch(plans)}: top {min(top, len(plans))} plans")
    console.print(plans_table(plans[:top], title=title, width=console.width))
    _print_degrees_legend(console, plans[:top])
    if any(plan.num_stages > 1 for plan in plans[:top]):
        console.print(LAYERS_LEGEND, highlight=False, markup=False, style="dim")
    mixed = bool(plans and plans[0].stage_groups)
    if mixed:
        console.print(GROUPS_LEGEND, highlight=False, markup=False, style="dim")
    if len(plans) >= 2:
        from plait.search import explain

        from rich.text import Text

        # Text, not markup: the explanation holds brackets ("[pp 8->4]") that rich would eat as tags.
        console.print(Text.assemble(("why #1 beats #2: ", "bold"), explain(plans[0], plans[1])))
    if plans and plans[0].predicted is not None:
        console.print(_parts_line(plans[0].predicted), highlight=False)
    if mixed and plans[0].predicted is not None:
        from rich.text import Text

        from plait.search.explain import balance_note, stage_rows

        console.print(stages_table(stage_rows(plans[0]), "stages of #1"))
        console.print(Text.assemble(("why this split: ", "bold"), balance_note(plans[0])))
    feasible = len(getattr(result, "points", ())) or None
    console.print(search_stats_line(result.candidates_evaluated, result.seconds, feasible) + f" ({result.solver} solver)",
                  highlight=False)
    if not result.complete:
        console.print("stopped at the time limit: these are the best plans among those priced, not necessarily the "
                      "cost model's optimum (raise --time-limit, or use --solver learned)", style="yellow",
                      highlight=False)


def _print_unpriced(model: Any, seq_len: int) -> None:
    from plait.models.measure import unpriced_note

    note = unpriced_note(model, seq_len) if model.blocks else None
    if note:
        print(f"plait plan: warning: {note}", file=sys.stderr)


def _print_degrees_legend(console: Any, plans: list[Any]) -> None:
    """What the table's cp/ep marks mean, where a shown plan has them."""
    from plait.report.tables import degrees_legend

    legend = degrees_legend(plans)
    if legend:
        console.print(legend, highlight=False, markup=False, style="dim")


def result_batch(plans: list[Any]) -> str:
    if not plans:
        return "?"
    train = plans[0].train
    return f"{train.global_batch}×{train.seq_len} {train.precision}"


def _parts_line(predicted: Any) -> str:
    """'#1 step 1.23 s = compute 0.9 + bubble 0.2 + ...; peak 61.2 GiB = params 10.1 + ...'."""
    time_parts = " + ".join(f"{k} {v:.3g}" for k, v in _largest(predicted.step_time_parts))
    memory_parts = " + ".join(f"{k} {v / 2**30:.3g}" for k, v in _largest(predicted.memory_parts))
    return (f"#1 step {predicted.step_time_s:.3g} s = {time_parts or '?'}; "
            f"peak {predicted.peak_memory_bytes / 2**30:.3g} GiB = {memory_parts or '?'}")


def _largest(parts: dict[str, float], share: float = 0.01) -> list[tuple[str, float]]:
    """Parts of at least `share` of the total, largest first; the small rest summed as 'other'."""
    total = sum(parts.values()) or 1.0
    big = sorted(((k, v) for k, v in parts.items() if v >= share * total), key=lambda kv: -kv[1])
    rest = sum(v for k, v in parts.items() if v < share * total)
    return big + ([("other", rest)] if rest > 0 else [])


def _write_json(path: Path, result: Any, top: int, extra: dict[str, Any] | None = None) -> None:
    document = {
        "plans": [plan.to_dict() for plan in list(result.plans)[:top]],
        "search": {"candidates_evaluated": int(result.candidates_evaluated), "seconds": float(result.seconds)},
        **(extra or {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def _write_report(directory: Path, result: Any) -> None:
    from plait.report.plan_report import write_plan_report

    for png in write_plan_report(list(result.plans), directory, points=getattr(result, "points", None)):
        print(f"wrote {png}", file=sys.stderr)
