"""Per-operator sharding on the non-decoder examples (examples/operators): solve time, the heuristic's gap to the
program, predicted step against data parallelism alone, and the communication the executor issues against what
the plan predicted.

For each model and mesh (tp = 2, 4, 8 ranks, dp = 1; planned only: 64 and 512 devices as dp x tp8):

* solve: seconds for capture + strategies + the integer program (scipy milp / HiGHS), and the propagation
  heuristic's cost over the program's (the gap; target within 5%);
* predicted: the plan's step time (per micro-batch, forward + backward + data-parallel sync) against the same
  work under data parallelism alone over every device (plait.operators.planner.data_parallel_time);
* measured bytes (meshes up to 8 only): one forward and backward of the plan through the executor
  (plait.execute.operators.step_collectives: apply_operator_sharding on rank 0 of a fake process group of the
  mesh's size), every collective DTensor issues, explicit or inside its op dispatch, counted with its bytes (the
  whole tensor a collective produces or reduces; a shard for all-to-all, as the plan counts them); against the
  plan's comm_bytes (target within 10%). The fake group moves no data, so this measures what the executor asks
  for, not wall time. The executor redistributes each torch-level call's arguments to the placements the plan
  read them in (plan.operators.function_reads), so eager DTensor runs the strategies the solver priced.

The DLRM model is planned under a per-device memory budget its replicated table does not fit (1.7x, 3.3x and 5.3x
the budget on 2, 4 and 8 ranks; DLRM_BUDGET_MIB), its table trained by the fused row-wise SGD: the solver must
split the table.

    OMP_NUM_THREADS=1 PYTHONPATH=.:examples/operators .venv/bin/python benchmarks/per_operator.py [--models vit,dlrm]

`--pp N` prints the pipeline table instead (pipeline_table): the models with repeated blocks (ViT, Mixer, both
Llamas) cut into N stages, planned and measured per stage; `--decoders --pp N` plans Llama 3 8B's shape with N
stages (pipeline_8b_table).

`--decoders` prints the decoders' table instead (decoders_table): plait's reference Llama and a Hugging Face
Llama (examples/operators/decoders.py) at tp2 and tp4, the automatic plan against Megatron's pattern pinned, the
automatic plan's measured bytes against predicted (as above), and
Llama 3 8B's shape (32 layers, sequence 8192) planned only on 64 and 512 devices (dp8 x tp8, dp64 x tp8):
capture, build and solve seconds with the repeated block solved once, next to a fixed reference computation timed
in the same run (the machine may be shared: the ratio is the figure that travels).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time


MODELS = ("mlp", "vit", "mixer", "resnet", "dlrm")
MEASURED_TP = (2, 4, 8)
PLANNED = ((8, 8), (64, 8))
"""(dp, tp) meshes planned without a run: 64 and 512 devices."""
DLRM_BUDGET_MIB = {2: 2.3, 4: 1.2, 8: 0.75}
"""Per-device budget by tp: the 4 MiB table (examples/operators/dlrm.py) is 1.7x, 3.3x and 5.3x of it. Its lookup
trains with the fused row-wise SGD (plait.execute.embedding_tables), so a rank holds its share of the weights alone; a table
at 4x a rank's budget needs more than 4 ranks to hold it at all."""
GLOBAL_BATCH = 8


def table_bytes() -> float:
    from dlrm import DIM, ROWS  # examples/operators, on PYTHONPATH

    return ROWS * DIM * 4.0


def budget(model: str, tp: int) -> float | None:
    return DLRM_BUDGET_MIB[tp] * 2**20 if model == "dlrm" else None


def solve(model: str, dp: int, tp: int, solver: str):
    from plait.operators.planner import auto_plan
    from plait.spec.clusters import CLUSTER_PRESETS

    start = time.perf_counter()
    plan = auto_plan(f"{model}:build", f"{model}:batch", CLUSTER_PRESETS["local-cpu"], global_batch=GLOBAL_BATCH * dp,
                     dp=dp, tp=tp, solver=solver, memory_limit=budget(model, tp),
                     table_optimizer="sgd" if model == "dlrm" else None)
    return plan, time.perf_counter() - start


def measure(plan) -> tuple[float, dict[str, int], int]:
    from plait.execute.operators import step_collectives

    return step_collectives(plan)


def reference_seconds() -> float:
    """A fixed computation (Python loops and small dense algebra, as the planner's build and HiGHS do): the yardstick
    the 8B rows' seconds are divided by. Median of 3."""
    import numpy as np

    def once() -> float:
        start = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i % 7
        a = np.random.default_rng(0).standard_normal((200, 200))
        for _ in range(50):
            a = np.tanh(a @ a.T / 200)
        return time.perf_counter() - start
    return statistics.median(once() for _ in range(3))


def plan_8b(dp: int, tp: int, full_program: bool) -> dict[str, float]:
    """Seconds of each phase planning Llama 3 8B's shape on dp x tp (h100-80g), the block solved once; with
    full_program, the untied program too (HiGHS's 60 s limit) and the tied plan's cost over it."""
    import torch
    from decoders import WithLoss

    from plait.models.reference import Transformer
    from plait.operators import planner
    from plait.operators.capture import capture
    from plait.search import sharding
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.spec.models import MODEL_PRESETS

    times: dict = {}
    start = time.perf_counter()
    with torch.device("meta"):
        model = WithLoss(Transformer(MODEL_PRESETS["llama3-8b"]))
    graph = capture(model, planner.meta_batch("decoders:tokens_8k", 1))
    times["capture"] = time.perf_counter() - start
    start = time.perf_counter()
    built = planner.build_problem(graph, tp, dp, CLUSTER_PRESETS["h100-80g"].with_devices(dp * tp))
    times["build"] = time.perf_counter() - start
    start = time.perf_counter()
    tied = planner.solve(built, prove=False)
    times["solve"] = time.perf_counter() - start
    start = time.perf_counter()
    bound = sharding.relaxation_bound(built.problem)
    times["bound"] = time.perf_counter() - start
    times["proven gap"] = tied.cost / bound - 1  # against the untied program's LP relaxation: every placement
    times["nodes"], times["tied nodes"] = built.problem.num_nodes, tied.stats.get("nodes", 0)
    times["step"] = tied.cost
    if full_program:
        start = time.perf_counter()
        full = planner.solve(built, reuse_blocks=False)
        times["full solve"], times["tied / full"] = time.perf_counter() - start, tied.cost / full.cost - 1
        times["full status"] = full.status
        times["full gap"] = full.gap if full.gap is not None else float("nan")
        # the untied program's own dual bound, where HiGHS stopped: the tightest bound proven on any placement
        times["tied / full bound"] = tied.cost / max(full.lower_bound, bound) - 1
    return times


def decoders_table(full_program: bool, small: bool = True) -> None:
    from decoders import megatron_pins
    from rich.console import Console
    from rich.table import Table

    from plait.operators.planner import auto_plan
    from plait.spec.clusters import CLUSTER_PRESETS

    if not small:
        return llama_8b_table(full_program)
    table = Table(title="per-operator sharding of decoders (local-cpu cluster model; machine shared)")
    for column in ("model", "mesh", "solve s", "auto ms", "Megatron ms", "dp-only ms", "heuristic gap",
                   "projections as Megatron", "predicted bytes", "measured bytes", "bytes error", "collectives"):
        table.add_column(column, justify="left" if column in ("model", "mesh", "collectives") else "right")
    for model in ("llama", "hf_llama"):
        for tp in (2, 4):
            plans = {}
            for name, solver, pins in (("auto", "program", None), ("megatron", "program", megatron_pins(model)),
                                       ("heuristic", "propagation", None)):
                start = time.perf_counter()
                plans[name] = (auto_plan(f"decoders:{model}", "decoders:tokens", CLUSTER_PRESETS["local-cpu"],
                                         global_batch=4, tp=tp, solver=solver, pins=pins),
                               time.perf_counter() - start)
            measured, counts, _ = measure(plans["auto"][0])
            auto, megatron, heuristic = (plans[k][0].operators for k in ("auto", "megatron", "heuristic"))
            weights = {k: v for k, v in megatron_pins(model).items() if k.endswith(".weight")}
            same = sum(auto.params[k] == v for k, v in weights.items())
            table.add_row(model, f"tp{tp}", f"{plans['auto'][1]:.2f}", f"{auto.step_time_s * 1e3:.2f}",
                          f"{megatron.step_time_s * 1e3:.2f}", f"{auto.data_parallel_step_time_s * 1e3:.2f}",
                          f"{heuristic.step_time_s / auto.step_time_s - 1:+.2%}", f"{same}/{len(weights)}",
                          f"{auto.comm_bytes / 1024:.0f} KiB", f"{measured / 1024:.0f} KiB",
                          f"{(measured - auto.comm_bytes) / auto.comm_bytes:+.1%}",
                          ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    Console(width=260).print(table)
    llama_8b_table(full_program)


def llama_8b_table(full_program: bool) -> None:
    """Llama 3 8B's shape planned per operator on 64 and 512 h100s (plan_8b), with the tied solve's proven gap."""
    from rich.console import Console
    from rich.table import Table

    reference = reference_seconds()
    big = Table(title=f"Llama 3 8B's shape planned on h100-80g (reference computation {reference:.2f} s this run)")
    for column in ("mesh", "nodes", "tied nodes", "capture s", "build s", "solve s", "build + solve s",
                   "/ reference", "step s", "proven gap (LP) ", "bound s", "full program s", "full status",
                   "tied vs full", "proven gap (full bound)"):
        big.add_column(column, justify="left" if column in ("mesh", "full status") else "right")
    for dp, tp in ((8, 8), (64, 8)):
        t = plan_8b(dp, tp, full_program)
        total = t["build"] + t["solve"]
        big.add_row(f"dp{dp} x tp{tp}", f"{t['nodes']:.0f}", f"{t['tied nodes']:.0f}", f"{t['capture']:.2f}",
                    f"{t['build']:.2f}", f"{t['solve']:.2f}", f"{total:.2f}", f"{total / reference:.1f}x",
                    f"{t['step']:.3f}", f"{t['proven gap']:+.2%}", f"{t['bound']:.1f}",
                    f"{t['full solve']:.1f}" if "full solve" in t else "-", str(t.get("full status", "-")),
                    f"{t['tied / full']:+.2%}" if "tied / full" in t else "-",
                    f"{t['tied / full bound']:+.2%}" if "tied / full bound" in t else "-")
    Console(width=200).print(big)


PIPELINE_MODELS = ("vit", "mixer", "llama", "hf_llama")
"""The models with repeated blocks (examples/operators): the ones a pipeline can cut."""
PIPELINE_MEASURED_TP = (1, 2)
PIPELINE_PLANNED = ((4, 8), (32, 8))
"""(dp, tp) meshes planned without a run under the pipeline: 64 and 512 devices at pp2."""


def sources(model: str) -> tuple[str, str]:
    if model in ("llama", "hf_llama"):
        return f"decoders:{model}", "decoders:tokens"
    return f"{model}:build", f"{model}:batch"


def pipeline_table(pp: int, models: list[str]) -> None:
    """Per-operator plans with pp pipeline stages (1F1B, pp micro-batches of GLOBAL_BATCH / pp): solve seconds
    (the whole module, the stage split, every stage's capture and solve), each stage's time per micro-batch, the
    step and bubble from the cost model's schedule simulator, against the same devices without a pipeline (its
    ranks data-parallel instead) and against data parallelism alone; measured bytes (dp = 1): every stage built as
    its pipeline rank builds it, one micro-batch through the chain on a fake process group of tp ranks
    (plait.execute.operators_pipeline.stage_collectives), summed over the stages, against the stages' comm_bytes."""
    from rich.console import Console
    from rich.table import Table

    from plait.execute.operators_pipeline import stage_collectives
    from plait.operators.planner import auto_plan
    from plait.spec.clusters import CLUSTER_PRESETS

    cluster = CLUSTER_PRESETS["local-cpu"]
    table = Table(title=f"per-operator plans with {pp} pipeline stages (local-cpu cluster model; machine shared)")
    for column in ("model", "mesh", "schedule", "blocks/stage", "solve s", "stage ms", "predicted ms", "bubble",
                   "pp1 same devices ms", "dp-only ms", "predicted bytes", "measured bytes", "bytes error",
                   "collectives (measured)"):
        table.add_column(column, justify="left" if column in ("model", "mesh", "schedule", "collectives (measured)")
                         else "right")
    for model in models:
        source, batch = sources(model)
        for dp, tp in [(1, tp) for tp in PIPELINE_MEASURED_TP] + list(PIPELINE_PLANNED):
            start = time.perf_counter()
            plan = auto_plan(source, batch, cluster, global_batch=GLOBAL_BATCH * dp, dp=dp, tp=tp, pp=pp)
            seconds = time.perf_counter() - start
            flat = auto_plan(source, batch, cluster, global_batch=GLOBAL_BATCH * dp, dp=dp * pp, tp=tp).operators
            ops = plan.operators
            cells = ["-", "-", "-", "-"]
            if dp == 1:
                measured = stage_collectives(plan)
                nbytes = sum(b for b, _, _ in measured)
                counts: dict[str, int] = {}
                for _, c, _ in measured:
                    for kind, n in c.items():
                        counts[kind] = counts.get(kind, 0) + n
                error = (nbytes - ops.comm_bytes) / ops.comm_bytes if ops.comm_bytes else (0.0 if not nbytes else 1.0)
                cells = [f"{ops.comm_bytes / 1024:.0f} KiB", f"{nbytes / 1024:.0f} KiB", f"{error:+.1%}",
                         ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"]
            table.add_row(model, f"dp{dp} x pp{pp} x tp{tp}", f"{plan.schedule} mb{plan.micro_batch}x"
                          f"{plan.num_micro_batches}", "|".join(map(str, plan.layers_per_stage)), f"{seconds:.2f}",
                          " | ".join(f"{s.step_time_s * 1e3:.2f}" for s in ops.stages), f"{ops.step_time_s * 1e3:.3f}",
                          f"{plan.predicted.bubble_fraction:.1%}", f"{flat.step_time_s * 1e3:.3f}",
                          f"{ops.data_parallel_step_time_s * 1e3:.3f}", *cells)
    Console(width=240).print(table)


def pipeline_8b_table(pp: int) -> None:
    """Llama 3 8B's shape (32 layers, sequence 8192, micro-batch 1, 8 micro-batches) planned only with pp stages on
    h100-80g: the whole module solved once (its block tied), plait's stage split, each stage captured and solved
    with the block solution reused, the step from the schedule simulator; planning seconds in all."""
    import torch
    from decoders import WithLoss
    from rich.console import Console
    from rich.table import Table

    from plait.models.reference import Transformer
    from plait.operators import planner
    from plait.operators.pipeline import PipelineSettings, plan_pipeline
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.spec.models import MODEL_PRESETS

    table = Table(title=f"Llama 3 8B's shape with {pp} pipeline stages, planned on h100-80g (1F1B, 8 micro-batches)")
    for column in ("mesh", "plan s", "blocks/stage", "stage s", "step s", "bubble", "peak GiB", "split params"):
        table.add_column(column, justify="left" if column == "mesh" else "right")
    for dp, tp in ((8, 8), (16, 8)):
        with torch.device("meta"):
            model = WithLoss(Transformer(MODEL_PRESETS["llama3-8b"]))
        start = time.perf_counter()
        ops, split, bubble = plan_pipeline(
            model, planner.meta_batch("decoders:tokens_8k", 1), PipelineSettings(pp, 8),
            batch_source="decoders:tokens_8k", tp=tp, dp=dp, cluster=CLUSTER_PRESETS["h100-80g"].with_devices(
                dp * tp * pp), pins={}, solver="program", memory_limit=None, table_optimizer=None)
        table.add_row(f"dp{dp} x pp{pp} x tp{tp}", f"{time.perf_counter() - start:.2f}", "|".join(map(str, split)),
                      " | ".join(f"{s.step_time_s:.3f}" for s in ops.stages), f"{ops.step_time_s:.3f}",
                      f"{bubble:.1%}", f"{ops.peak_memory_bytes / 2**30:.1f}",
                      f"{sum(p != 'R' for p in ops.params.values())}/{len(ops.params)}")
    Console(width=200).print(table)


ZOO = ("dual_encoder", "unet", "gnn", "dlrm_tables")
"""Module kinds beyond the first examples (examples/operators): a dual encoder with a scalar parameter and odd tables, a
U-Net with GroupNorm, a graph network, a DLRM of several tables of odd sizes."""
ZOO_LOCAL = (2, 4, 8)
"""Devices the zoo is searched on with local-cpu, measured (bytes) and checked (EQUAL, --check: 2 devices)."""
ZOO_GPU = (8, 64, 1024)
"""Devices the zoo is searched on with h100-80g (planned only; global batch 2 per device)."""
ZOO_BUDGET_MIB = {"dual_encoder": 40.0, "dlrm_tables": 10.0}
"""Per-device budgets the tables' models are planned under (everywhere): the dual encoder's 40 MiB is the issue's
case (its 28 MiB of tables fit whole nowhere with the rest), the DLRM's 10 MiB its 12.2 MiB table does not fit."""
ZOO_TABLE_OPTIMIZER = {"dual_encoder": "sgd", "dlrm_tables": "rowwise_adagrad"}
"""The tables' fused row-wise optimizers: SGD for the dual encoder, row-wise Adagrad (TorchRec's default) for the
DLRM."""


def zoo_budget(model: str) -> float | None:
    return ZOO_BUDGET_MIB[model] * 2**20 if model in ZOO_BUDGET_MIB else None


def measured_bytes(plan) -> tuple[float, dict[str, int]]:
    """What the executor asks the tensor-parallel axis to carry in one micro-batch's forward and backward of `plan`
    (one data-parallel replica: dp set to 1, the micro-batch as the batch), on a fake process group (no ranks): the
    pipeline's stages chained (plait.execute.operators_pipeline.stage_collectives), or the module with every
    collective counted (plait.execute.dryrun.CollectiveCounter)."""
    import torch
    from torch.distributed.tensor.experimental import implicit_replication

    from plait.execute.operators import apply_operator_sharding, build_module, fake_tensor_parallel_mesh, make_batch
    from plait.execute.dryrun import CollectiveCounter

    if plan.pp > 1:
        from plait.execute.operators_pipeline import stage_collectives

        replica = dataclasses.replace(plan.train, global_batch=plan.micro_batch * plan.num_micro_batches)
        stages = stage_collectives(plan.replace(dp=1, train=replica))
        counts: dict[str, int] = {}
        for _, c, _ in stages:
            for kind, n in c.items():
                counts[kind] = counts.get(kind, 0) + n
        return sum(b for b, _, _ in stages), counts
    one = plan.replace(dp=1, train=dataclasses.replace(plan.train, global_batch=plan.micro_batch))
    with fake_tensor_parallel_mesh(plan.tp) as mesh:
        model = apply_operator_sharding(build_module(one.model.source, seed=0, dtype=torch.float32), one, mesh)
        counter = CollectiveCounter()
        with counter:
            loss = model(*make_batch(one.operators.batch, one.train.global_batch, 0, 0, torch.float32))
            with implicit_replication():
                loss.backward()
    return counter.nbytes, counter.counts


def best_pinned(model: str, cluster, devices: int, global_batch: int) -> float:
    """The best step among every dp x tp x pp of `devices` pinned alone and planned as the pinned path plans it
    (plait.operators.planner.auto_plan: pp micro-batches under a pipeline); inf when none fits."""
    from plait.errors import ConfigError
    from plait.operators.planner import auto_plan
    from plait.operators.search import DegreePins, shapes

    best, meshes = float("inf"), set()
    for shape in shapes(devices, global_batch, 64, DegreePins(max_tp=cluster.devices_per_node)):
        if shape.num_micro_batches != shape.pp or (shape.dp, shape.tp, shape.pp) in meshes:
            continue  # a mesh once (the shapes list each ZeRO stage of a mesh without a pipeline)
        meshes.add((shape.dp, shape.tp, shape.pp))
        try:
            plan = auto_plan(f"{model}:build", f"{model}:batch", cluster, global_batch=global_batch, dp=shape.dp,
                             tp=shape.tp, pp=shape.pp, table_optimizer=ZOO_TABLE_OPTIMIZER.get(model),
                             memory_limit=zoo_budget(model))
        except ConfigError:
            continue
        best = min(best, plan.predicted.step_time_s)
    return best


def check_equal(plan) -> str:
    """`plait check` of `plan` on its ranks (2 steps, float64): EQUAL, DIFFERENT, or the error's last line."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        with open(path, "w") as f:
            json.dump({"plans": [plan.to_dict()]}, f)
        run = subprocess.run([sys.executable, "-m", "plait", "check", "--plan", path, "--steps", "2"],
                             capture_output=True, text=True, timeout=900)
    if run.returncode == 0:
        return "EQUAL"
    if run.returncode == 1:
        return "DIFFERENT"
    lines = [line for line in (run.stderr + run.stdout).splitlines() if line.strip()]
    return f"exit {run.returncode}: " + (lines[-1][:90] if lines else "?")


def zoo_table(check: bool, models: list[str]) -> None:
    """Each zoo module searched freely (plait.operators.search) on local-cpu at 2, 4 and 8 devices and on h100-80g
    at 8, 64 and 1,024: search seconds, shapes priced, the best shape, its predicted step and memory, the free
    best against the best mesh pinned alone (local), bytes predicted against bytes the executor issues (local), and
    `plait check`'s verdict (local, 2 devices, with --check). The tables' models under ZOO_BUDGET_MIB."""
    from rich.console import Console
    from rich.table import Table

    from plait.operators.search import search
    from plait.spec.clusters import CLUSTER_PRESETS

    table = Table(title="the zoo, searched freely per operator (machine shared; seconds are wall time)")
    for column in ("model", "cluster", "devices", "search s", "shapes fit/refused/bounded", "best", "step ms",
                   "peak MiB", "free / best pinned", "predicted bytes", "measured bytes", "bytes error", "check"):
        table.add_column(column, justify="left" if column in ("model", "cluster", "best", "check") else "right")
    for model in models:
        for cluster_name, counts in (("local-cpu", ZOO_LOCAL), ("h100-80g", ZOO_GPU)):
            cluster = CLUSTER_PRESETS[cluster_name]
            for devices in counts:
                batch = 8 if cluster_name == "local-cpu" else 2 * devices
                start = time.perf_counter()
                result = search(f"{model}:build", f"{model}:batch", cluster, devices=devices, global_batch=batch,
                                table_optimizer=ZOO_TABLE_OPTIMIZER.get(model), memory_limit=zoo_budget(model))
                seconds = time.perf_counter() - start
                best = result.plans[0]
                ops = best.operators
                cells = ["-"] * 5
                if cluster_name == "local-cpu":
                    pinned = best_pinned(model, cluster, devices, batch)
                    nbytes, _ = measured_bytes(best)
                    error = (nbytes - ops.comm_bytes) / ops.comm_bytes if ops.comm_bytes else \
                        (0.0 if not nbytes else 1.0)
                    cells = [f"{best.predicted.step_time_s / pinned:.3f}", f"{ops.comm_bytes / 1024:.0f} KiB",
                             f"{nbytes / 1024:.0f} KiB", f"{error:+.1%}",
                             check_equal(best) if check and devices == 2 else "-"]
                table.add_row(model, cluster_name, str(devices), f"{seconds:.1f}",
                              f"{len(result.plans)}/{len(result.refused)}/{result.dominated}",
                              f"dp{best.dp} tp{best.tp} pp{best.pp} mb{best.micro_batch}x{best.num_micro_batches}"
                              + (f" zero{best.zero}" if best.dp > 1 else "")
                              + (" recompute" if best.recompute[0] != "none" else ""),
                              f"{best.predicted.step_time_s * 1e3:.4g}",
                              f"{best.predicted.peak_memory_bytes / 2**20:.1f}", *cells)
                Console(width=250).print(f"{model} {cluster_name} {devices}: done in {seconds:.1f} s",
                                         style="dim", highlight=False)
    Console(width=250).print(table)


def search_8b_table(devices: int, global_batch: int) -> None:
    """Llama 3 8B's shape (plait's reference code, sequence 8192) searched freely per operator on h100-80g with pp
    searched: plan seconds in all, shapes priced, the best plans."""
    from rich.console import Console
    from rich.table import Table

    from plait.operators.search import search
    from plait.spec.clusters import CLUSTER_PRESETS

    start = time.perf_counter()
    result = search("decoders:llama_8b", "decoders:tokens_8k", CLUSTER_PRESETS["h100-80g"], devices=devices,
                    global_batch=global_batch)
    seconds = time.perf_counter() - start
    table = Table(title=f"Llama 3 8B's shape searched per operator on {devices} x h100-80g, global batch "
                        f"{global_batch} x 8192 tokens, fp32: {seconds:.0f} s, {result.candidates_evaluated} shapes "
                        f"({len(result.plans)} fit, {len(result.refused)} refused, {result.dominated} bounded out)")
    for column in ("#", "mesh", "mb x n", "blocks/stage", "step s", "peak GiB", "solve status", "proven gap"):
        table.add_column(column, justify="left" if column in ("mesh", "solve status") else "right")
    for rank, plan in enumerate(result.plans[:5], start=1):
        ops = plan.operators
        table.add_row(str(rank), f"dp{plan.dp} x tp{plan.tp} x pp{plan.pp}",
                      f"{plan.micro_batch} x {plan.num_micro_batches}", "|".join(map(str, plan.layers_per_stage)),
                      f"{plan.predicted.step_time_s:.3f}", f"{plan.predicted.peak_memory_bytes / 2**30:.1f}",
                      ops.solver_status, f"{ops.proven_gap:.2%}" if ops.proven_gap is not None else "-")
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=None, help=f"comma-separated; default {','.join(MODELS)} (with --pp: "
                                                        f"{','.join(PIPELINE_MODELS)})")
    parser.add_argument("--decoders", action="store_true", help="the decoders' table instead (see the docstring)")
    parser.add_argument("--full-program", action="store_true", help="with --decoders: the untied 8B program too")
    parser.add_argument("--only-8b", action="store_true", help="with --decoders: Llama 3 8B's table alone")
    parser.add_argument("--pp", type=int, default=None, metavar="N",
                        help="the pipeline table instead: per-operator plans with N stages (pipeline_table)")
    parser.add_argument("--zoo", action="store_true", help="the zoo's free search table instead (zoo_table)")
    parser.add_argument("--check", action="store_true", help="with --zoo: plait check the 2-device plans")
    parser.add_argument("--search-8b", type=int, default=None, metavar="DEVICES",
                        help="Llama 3 8B's shape searched per operator with pp on DEVICES h100s (search_8b_table)")
    parser.add_argument("--global-batch", type=int, default=None, metavar="B",
                        help="with --search-8b: sequences per step (default: one per device)")
    args = parser.parse_args()
    if args.zoo:
        zoo_table(args.check, (args.models or ",".join(ZOO)).split(","))
        return
    if args.search_8b:
        search_8b_table(args.search_8b, args.global_batch or args.search_8b)
        return
    if args.decoders and args.pp:
        pipeline_8b_table(args.pp)
        return
    if args.decoders:
        decoders_table(args.full_program, small=not args.only_8b)
        return
    if args.pp:
        pipeline_table(args.pp, (args.models or ",".join(PIPELINE_MODELS)).split(","))
        return
    args.models = args.models or ",".join(MODELS)
    from rich.console import Console
    from rich.table import Table

    table = Table(title="per-operator sharding on examples/operators (local-cpu cluster model; machine shared)")
    for column in ("model", "mesh", "solve s", "split params", "peak MiB", "predicted ms", "dp-only ms", "speedup",
                   "heuristic gap", "predicted bytes", "measured bytes", "bytes error", "collectives"):
        table.add_column(column, justify="left" if column in ("model", "mesh", "collectives") else "right")
    gaps, errors = [], []
    for model in args.models.split(","):
        meshes = [(1, tp) for tp in MEASURED_TP] + list(PLANNED)
        for dp, tp in meshes:
            plan, seconds = solve(model, dp, tp, "program")
            heuristic, _ = solve(model, dp, tp, "propagation")
            ops = plan.operators
            gap = heuristic.operators.step_time_s / ops.step_time_s - 1
            gaps.append(gap)
            cells = ["-", "-", "-", "-"]
            if dp == 1:
                measured, counts, debug_total = measure(plan)
                error = (measured - ops.comm_bytes) / ops.comm_bytes if ops.comm_bytes else (0.0 if not measured else 1.0)
                errors.append(abs(error))
                cells = [f"{ops.comm_bytes / 1024:.0f} KiB", f"{measured / 1024:.0f} KiB", f"{error:+.1%}",
                         f"{debug_total} ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))})"]
            split = sum(1 for p in ops.params.values() if p != "R")
            limit = budget(model, tp)
            memory = f"{ops.peak_memory_bytes / 2**20:.2f}" + (
                f" of {limit / 2**20:.2f} (table {table_bytes() / limit:.1f}x)" if limit else "")
            table.add_row(model, f"dp{dp} x tp{tp}", f"{seconds:.2f}", f"{split}/{len(ops.params)}", memory,
                          f"{ops.step_time_s * 1e3:.3f}", f"{ops.data_parallel_step_time_s * 1e3:.3f}",
                          f"{ops.data_parallel_step_time_s / ops.step_time_s:.2f}x", f"{gap:+.2%}", *cells)
    Console(width=220).print(table)
    print(f"heuristic gap: median {statistics.median(gaps):+.2%}, worst {max(gaps):+.2%}; bytes error: median "
          f"{statistics.median(errors):.1%}, worst {max(errors):.1%}")


if __name__ == "__main__":
    main()
