"""Predicted against measured peak memory per rank, by part, over a grid of plans.

    python benchmarks/memory_accuracy.py [--nproc 2 4] [--json FILE] [--quick] [--match mem-moe] [--grid pipeline|lora]

Every plan of the grid (data parallelism on DDP and ZeRO-1, fully_shard ZeRO-2 and ZeRO-3, tensor parallelism
with and without sequence parallelism, pipelines under GPipe, 1F1B and interleaved 1F1B, each recompute mode,
several micro-batch sizes and counts and sequence lengths up to a long one, Llama- and GPT-style blocks, fused
and math attention) is built by plait's executor on local ranks, and its third step is measured by PyTorch's
own trackers (plait.profile.peak_memory: `MemTracker` / `FSDPMemTracker` on CPU, `max_memory_allocated` on
CUDA). The cost model's prediction (plait.cost.memory) is the allocated part of its peak: everything but the
reserve it keeps for the allocator's fragmentation, which a tensor count cannot see.

The table gives, per plan and pipeline rank, predicted and measured bytes (the largest over the rank's data-
and tensor-parallel peers) and the relative error, and the parts of both peaks. Targets: every row within 10%,
median within 5%.

On CUDA (one GPU here) the grid runs its single-rank plans in bf16 with fused attention (--cuda-single).

`--grid pipeline`: GPipe, 1F1B and interleaved 1F1B on 2 and 4 ranks at m = 4, 8, 16, 32 and 64 micro-batches (an
8-block Llama). The executor holds the receive buffers in flight only (plait/execute/buffers.py), so past the warm-up
the buffers part stays flat in m (GPipe's grows: it keeps every micro-batch by design); a second table gives each
rank's predicted and measured buffers against m, and the m = 64 figure against m = 8's. The zero-bubble V schedules
(ZB-V, DualPipeV) are left out: their split backward runs torch.autograd.grad, which MemTracker's module hooks refuse
in torch 2.13 ("A leaf node was passed to _will_engine_execute_node ..."); tests/dist/test_pipeline_buffers.py
checks their pool against the live set instead.

`--grid lora`: LoRA adapters on the Llama's frozen base under DDP, ZeRO-3, tp2 with SP and pp2 (docs/lora.md).

`--grid llama2-13b`: torchtitan's Llama 2 13B row (FSDP, local batch 2, seq 4096, no recompute) scaled down to run
here: two blocks at 1/20 of the width (h 256, ffn 688: 13B's ratio 2.7; head_dim 128, so 2 heads), the full 32,000
vocabulary, ZeRO-3 over 2 CPU ranks, fp32; its rows check the activation estimate behind the full-size row. A first
table runs the same blocks in one process with fp32 and with bf16 parameters (a GPU run's blocks under fully_shard's
mixed precision: plait's CPU ranks keep fp32 parameters and autocast) and compares what they keep for backward with
the estimate (`--blocks-only`: that table alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from plait.cost import predict
from plait.cost.activations import Dtypes, activation_bytes
from plait.models.reference import TransformerBlock, rope_tables
from plait.plan import Plan
from plait.spec import ModelSpec, TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS

TARGETS = {"row": 0.10, "median": 0.05}
MiB = 2**20
PART_COLUMNS = ("params", "grads", "optimizer", "activations", "temporaries", "buffers")


def model(arch: str, attention: str = "fused", num_layers: int = 4) -> ModelSpec:
    """Small decoders whose activations, states and logits all matter: 4 blocks of width 128, a byte vocabulary;
    Llama-style with grouped-query attention (2 kv heads of 4), or GPT-style (LayerNorm, GeLU, biases); "moe": the
    Llama with 4 experts of width 128, top-2, in place of its MLP."""
    experts = dict(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=128) if arch == "moe" else {}
    base = "llama" if arch == "moe" else arch
    name = f"mem-{arch}" + ("-math" if attention == "math" else "") + (f"-{num_layers}l" if num_layers != 4 else "")
    return ModelSpec(name=name, arch=base, num_layers=num_layers,
                     hidden_size=128, num_heads=4, num_kv_heads=2 if base == "llama" else None, ffn_hidden_size=256,
                     vocab_size=256, max_seq_len=4096, attention=attention, **experts)


def make_plan(nproc: int, arch: str = "llama", seq: int = 128, attention: str = "fused", precision: str = "fp32",
              device: str = "local-cpu", num_layers: int = 4, **fields) -> Plan:
    fields.setdefault("micro_batch", 2)
    fields.setdefault("num_micro_batches", 1)
    batch = fields.get("dp", 1) * fields["micro_batch"] * fields["num_micro_batches"]
    return Plan.of(model=model(arch, attention, num_layers), train=TrainSpec(global_batch=batch, seq_len=seq, precision=precision),
                   cluster=CLUSTER_PRESETS[device].with_devices(nproc), **fields)


MODES = ("none", "selective", "full")


def grid(nproc: int, quick: bool = False) -> list[Plan]:
    """The plans measured on `nproc` ranks."""
    plans: list[Plan] = []
    modes = MODES[:1] if quick else MODES
    if nproc == 1:
        for mode in modes:
            plans.append(make_plan(1, recompute=(mode,)))
        plans.append(make_plan(1, seq=2048, micro_batch=1))
        return plans
    if nproc == 2:
        layouts = [dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=3),
                   dict(tp=2, sequence_parallel=True), dict(tp=2),
                   dict(pp=2, schedule="1f1b", num_micro_batches=4), dict(pp=2, schedule="gpipe", num_micro_batches=4),
                   dict(pp=2, schedule="interleaved", interleave=2, num_micro_batches=4)]
        for layout in layouts:
            for mode in modes:
                plans.append(make_plan(2, recompute=(mode,), **layout))
        if quick:
            return plans
        plans += [make_plan(2, dp=2, micro_batch=1, num_micro_batches=4),            # micro-batches: size and count
                  make_plan(2, dp=2, zero=3, micro_batch=4),
                  make_plan(2, dp=2, zero=2, micro_batch=1, num_micro_batches=4),
                  # ZeRO-3 accumulating 4 micro-batches: gradients reduced once (whole, fp32) or every time (sharded)
                  make_plan(2, dp=2, zero=3, micro_batch=1, num_micro_batches=4),
                  make_plan(2, dp=2, zero=3, micro_batch=1, num_micro_batches=4, grad_sync="micro_batch"),
                  make_plan(2, pp=2, schedule="1f1b", micro_batch=1, num_micro_batches=8),
                  make_plan(2, dp=2, seq=512),                                          # sequence lengths
                  make_plan(2, tp=2, sequence_parallel=True, seq=512, recompute=("selective",)),
                  make_plan(2, dp=2, zero=3, seq=2048, micro_batch=1),                  # a long one
                  make_plan(2, pp=2, schedule="1f1b", seq=2048, micro_batch=1, num_micro_batches=2),
                  make_plan(2, tp=2, sequence_parallel=True, seq=2048, micro_batch=1, recompute=("full",)),
                  make_plan(2, dp=2, zero=3, seq=4096, micro_batch=1, recompute=("selective",))]
        for mode in MODES:                                                                # GPT-style blocks
            plans.append(make_plan(2, arch="gpt", dp=2, recompute=(mode,)))
        plans += [make_plan(2, arch="gpt", tp=2, sequence_parallel=True),
                  make_plan(2, arch="gpt", pp=2, schedule="1f1b", num_micro_batches=4, recompute=("selective",))]
        for mode in ("none", "selective"):                                                # the math path
            plans.append(make_plan(2, attention="math", seq=512, dp=2, recompute=(mode,)))
        return plans
    if nproc == 4:
        return [make_plan(4, dp=2, tp=2, sequence_parallel=True, zero=1),
                make_plan(4, dp=2, tp=2, sequence_parallel=True, zero=3, recompute=("selective",)),
                make_plan(4, dp=2, pp=2, schedule="1f1b", num_micro_batches=4, zero=1),
                make_plan(4, tp=2, sequence_parallel=True, pp=2, schedule="interleaved", interleave=2,
                          num_micro_batches=4, recompute=("full",)),
                # experts: sharded over their two copies (ep2 x edp2) under ZeRO-3 and ZeRO-2, whole under ep4
                make_plan(4, arch="moe", dp=4, ep=2, zero=3),
                make_plan(4, arch="moe", dp=4, ep=2, zero=2),
                make_plan(4, arch="moe", dp=4, ep=4, zero=1)][: 2 if quick else 7]
    raise SystemExit(f"--nproc {nproc}: the grid has plans for 1, 2 and 4 ranks")


PIPELINE_MICRO_BATCHES = (4, 8, 16, 32, 64)
PIPELINE_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2}  # the V schedules: see the module docstring


def pipeline_grid(nproc: int, quick: bool = False) -> list[Plan]:
    """Every schedule at every m of PIPELINE_MICRO_BATCHES that it runs on `nproc` pipeline ranks."""
    from plait import legality

    plans = []
    for schedule, v in PIPELINE_SCHEDULES.items():
        for m in PIPELINE_MICRO_BATCHES[:2] if quick else PIPELINE_MICRO_BATCHES:
            plan = make_plan(nproc, pp=nproc, schedule=schedule, interleave=v, micro_batch=1, num_micro_batches=m,
                             num_layers=8)
            if not legality.plan_problems(plan):  # DualPipeV needs m >= 2p
                plans.append(plan)
    return plans


def llama2_13b_grid(nproc: int, quick: bool = False) -> list[Plan]:
    """The scaled-down Llama 2 13B row (module docstring)."""
    model = ModelSpec(name="mem-llama2-13b-scaled", arch="llama", num_layers=2, hidden_size=256, num_heads=2,
                      num_kv_heads=2, ffn_hidden_size=688, vocab_size=32000, max_seq_len=4096)
    return [Plan.of(model=model, train=TrainSpec(global_batch=2 * nproc, seq_len=4096, precision="fp32"), dp=nproc,
                    zero=3, micro_batch=2, num_micro_batches=1, cluster=CLUSTER_PRESETS["local-cpu"].with_devices(nproc))]


def lora_grid(nproc: int, quick: bool = False) -> list[Plan]:
    """LoRA (rank 8) on the Llama's every projection ("all-linear") and on q and v only, each layout of 2 ranks: the
    frozen base's states and the adapters' (plait.cost.trainable), activations priced as full fine-tuning's."""
    from plait.models.lora import with_lora
    from plait.spec.lora import Lora

    layouts = [dict(dp=2), dict(dp=2, zero=3), dict(tp=2, sequence_parallel=True),
               dict(pp=2, schedule="1f1b", num_micro_batches=4)][: 2 if quick else 4]
    plans = []
    for targets in (("all-linear",), ("wq", "wv")):
        for layout in layouts:
            plan = make_plan(nproc, **layout)
            spec = with_lora(plan.model, Lora(rank=8, targets=targets))
            plans.append(plan.replace(model=spec.replace(name=f"{spec.name}-lora-{'+'.join(targets)}")))
    return plans


GRIDS = {"main": grid, "pipeline": pipeline_grid, "llama2-13b": llama2_13b_grid, "lora": lora_grid}
BLOCK_DTYPES = {"fp32": (torch.float32, Dtypes(compute=4, residual=4)),
                "bf16": (torch.bfloat16, Dtypes(compute=2, residual=2))}  # fully_shard's mixed precision on a GPU


def measure_blocks(spec: ModelSpec, dtype: torch.dtype, micro_batch: int, seq: int) -> float:
    """Bytes plait's reference blocks keep for backward after a forward pass, as MemTracker counts them: every
    block of `spec` with parameters in `dtype` (what fully_shard's MixedPrecisionPolicy gives a GPU run's blocks;
    plait's CPU runs keep fp32 parameters and autocast instead), less the last block's output (the next one's
    input). The first block's input is made inside the tracker and only the blocks hold it."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(TransformerBlock(spec) for _ in range(spec.num_layers)).to(dtype)
    rope = rope_tables(torch.arange(seq), spec.head_dim, spec.rope_theta)
    source = torch.randn(micro_batch, seq, spec.hidden_size, dtype=dtype, requires_grad=True)
    tracker = MemTracker()
    tracker.track_external(blocks, source, *rope)
    with tracker:
        before = tracker.get_tracker_snapshot()
        y = source * 1.0  # saves nothing: the blocks alone decide whether their input stays
        for block in blocks:
            y = block(y, rope)
        after = tracker.get_tracker_snapshot()
    device = next(iter(after))
    return after[device]["Total"] - before[device].get("Total", 0) - y.nbytes


def blocks_table(spec: ModelSpec, micro_batch: int, seq: int) -> Table:
    """The scaled-down Llama 2 13B's blocks in fp32 and bf16: what they keep for backward, predicted
    (plait.cost.activations, no recompute) against MemTracker."""
    t = Table(title=f"{spec.name}: {spec.num_layers} blocks, micro-batch {micro_batch} x {seq}, kept for backward")
    for col in ("dtype", "predicted MiB", "measured MiB", "error", "predicted bytes / token / hidden unit"):
        t.add_column(col, justify="right")
    for name, (dtype, dtypes) in BLOCK_DTYPES.items():
        predicted = spec.num_layers * activation_bytes(spec, micro_batch, seq, 1, False, "none", dtypes)
        measured = measure_blocks(spec, dtype, micro_batch, seq)
        per_unit = predicted / (spec.num_layers * micro_batch * seq * spec.hidden_size)
        t.add_row(name, f"{predicted / MiB:.2f}", f"{measured / MiB:.2f}", f"{predicted / measured - 1:+.2%}",
                  f"{per_unit:.2f}")
    return t


def buffers_table(rows: list[dict]) -> Table:
    """Per schedule, world and pipeline rank: the buffers part (predicted / measured MiB) at each m, and m = 64
    against m = 8."""
    t = Table(title="Pipeline buffers by micro-batches: predicted / measured MiB (flat in m: the pool)")
    for col in ("schedule", "p", "rank", *(f"m={m}" for m in PIPELINE_MICRO_BATCHES), "m=64 / m=8 (measured)"):
        t.add_column(col, justify="left" if col == "schedule" else "right")
    series: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        if r.get("schedule"):
            series.setdefault((r["schedule"], r["pp"], r["pp_rank"]), {})[r["num_micro_batches"]] = r
    for (schedule, pp, rank), by_m in series.items():
        cells = [f"{by_m[m]['predicted_parts']['buffers'] / MiB:.2f}/{by_m[m]['measured_parts']['buffers'] / MiB:.2f}"
                 if m in by_m else "" for m in PIPELINE_MICRO_BATCHES]
        ratio = ""
        if 8 in by_m and 64 in by_m and by_m[8]["measured_parts"]["buffers"] > 0:
            ratio = f"{by_m[64]['measured_parts']['buffers'] / by_m[8]['measured_parts']['buffers']:.2f}"
        t.add_row(schedule, str(pp), str(rank), *cells, ratio)
    return t


def measure(plans: list[Plan], nproc: int) -> list[list[dict]]:
    """Run the plans on `nproc` local ranks; per plan, each rank's peak (plait.profile.peak_memory)."""
    from plait.runtime.launch import run_local
    from plait.profile.tune import write_plans

    with tempfile.TemporaryDirectory(prefix="plait-memory-") as folder:
        plans_file, results_file = Path(folder) / "plans.json", Path(folder) / "results.json"
        write_plans(plans, plans_file)
        code = run_local(nproc, ["-m", "plait.profile.peak_memory", str(plans_file), str(results_file)], module=None)
        results = json.loads(results_file.read_text())["results"] if results_file.is_file() else []
        if len(results) != len(plans):
            raise SystemExit(f"measuring on {nproc} ranks failed (exit code {code})")
        if code != 0:  # every plan was measured and written; a rank died tearing down its process group
            print(f"warning: the {nproc}-rank launch exited with code {code} after writing every result",
                  file=sys.stderr)
        return results


def rows_of(plan: Plan, peaks: list[dict]) -> list[dict]:
    """One row per pipeline rank: predicted (reserve left out) and measured (largest over its peers) bytes."""
    from plait.cost.layout import Setting
    from plait.cost.memory import rank_memory

    prediction = predict(plan)
    setting, layout = Setting(plan.model, plan.cluster, plan.train), plan.layout
    rows = []
    for pp_rank in range(plan.pp):
        mine = [p for p in peaks if p["pp_rank"] == pp_rank]
        measured = max(mine, key=lambda p: p["total"])
        layers = sum(plan.layers_per_stage[pp_rank::plan.pp])
        parts = rank_memory(setting, layout, pp_rank, plan.recompute[pp_rank]).parts(layers)
        predicted = prediction.memory_per_stage[pp_rank] - parts["reserve"]
        rows.append({"plan": plan.describe(), "model": plan.model.name, "seq_len": plan.train.seq_len,
                     "schedule": plan.schedule if plan.pp > 1 else None, "pp": plan.pp,
                     "num_micro_batches": plan.num_micro_batches,
                     "pp_rank": pp_rank, "predicted": predicted, "measured": measured["total"],
                     "error": predicted / measured["total"] - 1, "predicted_parts": parts,
                     "measured_parts": measured["parts"]})
    return rows


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for col in ("plan", "model", "s", "pp rank", "predicted MiB", "measured MiB", "error",
                *(f"{c[:5]} p/m" for c in PART_COLUMNS)):
        t.add_column(col, justify="left" if col in ("plan", "model") else "right")
    for r in rows:
        err = r["error"]
        color = "green" if abs(err) <= TARGETS["row"] else "red"
        parts = [f"{r['predicted_parts'].get(c, 0) / MiB:.2f}/{r['measured_parts'].get(c, 0) / MiB:.2f}"
                 for c in PART_COLUMNS]
        t.add_row(r["plan"], r["model"], str(r["seq_len"]), str(r["pp_rank"]), f"{r['predicted'] / MiB:.2f}",
                  f"{r['measured'] / MiB:.2f}", f"[{color}]{err:+.1%}[/]", *parts)
    return t


def summary(rows: list[dict]) -> str:
    errors = [abs(r["error"]) for r in rows]
    median, worst = statistics.median(errors), max(errors)
    verdict = "meets" if worst <= TARGETS["row"] and median <= TARGETS["median"] else "misses"
    return (f"{len(rows)} rows: median |error| {median:.1%}, worst {worst:.1%} -> {verdict} the targets "
            f"(every row within {TARGETS['row']:.0%}, median within {TARGETS['median']:.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="world sizes to run the grid on")
    parser.add_argument("--json", help="write every row (predicted and measured parts) to this file")
    parser.add_argument("--quick", action="store_true", help="a few plans per world size (a smoke test)")
    parser.add_argument("--match", default="", help="only the plans whose model name contains this (e.g. mem-moe)")
    parser.add_argument("--grid", choices=tuple(GRIDS), default="main",
                        help="the plans: the main grid, pipelines at m = 4..64, or Llama 2 13B scaled down (docstring)")
    parser.add_argument("--cuda-single", action="store_true",
                        help="one GPU: the single-rank plans in bf16 with fused attention, measured by max_memory_allocated")
    parser.add_argument("--blocks-only", action="store_true",
                        help="--grid llama2-13b: only the blocks' table (fp32 and bf16, one process), not the plan")
    args = parser.parse_args()
    console = Console(width=220)
    if args.grid == "llama2-13b":
        plan = llama2_13b_grid(2)[0]
        console.print(blocks_table(plan.model, plan.micro_batch, plan.train.seq_len))
        if args.blocks_only:
            return
    rows: list[dict] = []
    sizes = [1] if args.cuda_single else args.nproc
    for nproc in sizes:
        plans = GRIDS[args.grid](nproc, args.quick)
        plans = [plan for plan in plans if args.match in plan.model.name]
        if args.cuda_single:
            plans = [make_plan(1, precision="bf16", device="h100-80g", recompute=p.recompute, micro_batch=p.micro_batch,
                               seq=p.train.seq_len) for p in plans]
        for plan, peaks in zip(plans, measure(plans, nproc)):
            rows += rows_of(plan, peaks)
    console.print(table(rows, "Peak memory per rank: predicted (plait.cost.memory) / measured (PyTorch's trackers)"))
    console.print(summary(rows))
    if args.grid == "pipeline":
        console.print(buffers_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary(rows)}, indent=1))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
