"""plait's per-operator placements of embedding tables against TorchRec's EmbeddingShardingPlanner on the same
tables, world sizes and per-device budgets.

Two sets of tables (SETS), trained by row-wise Adagrad on both sides (TorchRec's fused default, plait's
`--table-optimizer rowwise_adagrad`), each world size planned under the set's budgets:

* "dlrm": examples/operators/dlrm_tables.py's five (100,003, 25,013, 4,099, 1,009 and 97 rows of 32 floats; row
  counts no degree divides), unlimited, with 10 MiB a device (the largest table does not fit whole) and 6 MiB (the
  two largest do not fit beside each other);
* "equal": examples/operators/equal_tables.py's four of 40,001 rows of 64 floats (10 MiB each), unlimited and with
  12 MiB a device (a device holds one whole).

Side by side:

* plait: the whole module planned per operator on h100-80g with every rank on the tensor-parallel axis (dp = 1, tp =
  world: the tables over every rank, as TorchRec shards them), its tables' placements (R: a copy on every rank,
  TorchRec's data_parallel; S0: row-wise, uneven where the degree does not divide the rows, TorchRec's
  table_row_wise within a node; S1: column-wise; T<rank>: table-wise, whole on that rank, the tables bin-packed),
  the plan's step and peak memory, its lookups priced from a sample of the DLRM's own (skewed) ids;
* TorchRec (1.8.0, whose fbgemm-gpu-cpu 1.8.0 loads on torch 2.13; 1.9.x's fbgemm 1.9.0 is built for torch 2.14
  and does not): each table's sharding type and ranks, and its planner's per-shard perf estimate (fwd + bwd
  compute and comms, the planner's own units) and HBM storage.

TorchRec is not a dependency of plait: fetch it beside the shared environment, not into it, and put it on the path:

    pip download torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 --no-deps -d /tmp/trec
    (cd /tmp/trec && mkdir site && cd site && for w in ../*.whl; do python -m zipfile -e $w .; done)
    OMP_NUM_THREADS=1 PYTHONPATH=.:examples/operators:/tmp/trec/site python benchmarks/torchrec_tables.py
"""

from __future__ import annotations

import argparse
import time

WORLDS = (2, 4, 8)
BATCH_PER_RANK = 8
SETS = {
    "dlrm": ("dlrm_tables:build", "dlrm_tables:batch", (100_003, 25_013, 4_099, 1_009, 97), 32, (None, 10.0, 6.0)),
    "equal": ("equal_tables:build_large", "equal_tables:batch", (40_001,) * 4, 64, (None, 12.0)),
}
"""name -> (module, batches, rows of each table, width, per-device budgets in MiB): see the module docstring."""
PLACEMENT_AS_TORCHREC = {"R": "data_parallel", "S0": "row_wise", "S1": "column_wise", "T": "table_wise"}
ROW_SPLITS = ("row_wise", "table_row_wise")


def torchrec_kind(placement: str) -> str:
    return PLACEMENT_AS_TORCHREC.get(placement[:1] if placement.startswith("T") else placement, placement)


REASONS = {
    "same": ("same kind", ""),
    "rows": ("same kind (rows over tp)", "plait's S0 splits rows over the tensor-parallel axis, which stays in a node: "
             "TorchRec's table_row_wise; its row_wise over the whole world has no counterpart (plait's tables are "
             "replicated over dp, their touched rows exchanged)"),
    "R": ("R: ranks share samples", "plait keeps it replicated where it fits: its ranks (tp) hold the same samples, so "
          "a replicated lookup pays no collective; TorchRec's ranks hold other samples and its data_parallel "
          "all-reduces the whole table's gradient, so TorchRec shards it"),
    "T": ("T: broadcast of distinct rows", "plait puts it whole on one rank: its ranks hold the same ids, so the owner's "
          "lookup broadcasts each distinct row once (the ids sample's count), fewer bytes than a split lookup's "
          "all-reduce or gather of every id's row"),
    "split": ("split: T dearer or over budget", "plait splits where TorchRec places it whole: table-wise was priced "
              "dearer, or its owner (the fullest rank after bin-packing) would exceed the budget; TorchRec's ranks "
              "hold other samples and trade ids and pooled rows all-to-all"),
    "collective": ("split: cheaper collective", "both split it, differently: on samples every rank shares, plait "
                   "prices a row split's all-reduce and a column split's gather of the pooled rows and takes the "
                   "cheaper"),
    "none": ("plait: nothing fits", "plait found no plan at this budget (the line above names the smallest that "
             "fits); where TorchRec's shows 0 MiB of HBM a shard, it keeps that table in host memory (UVM caching, "
             "its perf estimate a hundred times dearer), which plait does not do"),
    "-": ("TorchRec: no plan", "TorchRec's planner found no plan"),
}
"""Why plait's placement of a table differs from TorchRec's: (the table's short cell, the legend's sentence)."""


def why_they_differ(ours: str, theirs: str) -> str:
    """The REASONS key for one table: both planners model the same step, plait's ranks on the tensor-parallel axis
    (the same samples), TorchRec's each with its own."""
    kind = torchrec_kind(ours)
    if ours == "-":
        return "none"
    if theirs == "-":
        return "-"
    if kind == "row_wise" and theirs in ROW_SPLITS:
        return "rows"
    if kind == theirs:
        return "same"
    if ours == "R":
        return "R"
    if kind == "table_wise":
        return "T"
    return "split" if theirs == "table_wise" else "collective"


def plait_tables(model: str, batch: str, world: int, budget_mib: float | None
                 ) -> tuple[dict[str, str], float, float, float, str]:
    """({table: placement}, step s, peak bytes, plan seconds, the ids sample it priced by) of `model` on dp1 x
    tp`world`."""
    from plait.operators.search import DegreePins, search
    from plait.spec.clusters import CLUSTER_PRESETS

    start = time.perf_counter()
    result = search(model, batch, CLUSTER_PRESETS["h100-80g"], devices=world,
                    global_batch=BATCH_PER_RANK * world, degrees=DegreePins(dp=1, tp=world),
                    memory_limit=budget_mib * 2**20 if budget_mib else None, table_optimizer="rowwise_adagrad")
    plan = result.plans[0]
    tables = {name.removesuffix(".weight"): placement for name, placement in plan.operators.params.items()
              if name.startswith("tables.")}
    return (tables, plan.predicted.step_time_s, plan.predicted.peak_memory_bytes, time.perf_counter() - start,
            plan.operators.table_sample)


def torchrec_tables(rows_of: tuple[int, ...], dim: int, world: int, budget_mib: float | None
                    ) -> tuple[dict[str, tuple[str, list[int], float, int]], float]:
    """({table: (sharding type, ranks, perf estimate summed over its shards, HBM bytes of its largest shard)},
    plan seconds) from TorchRec's EmbeddingShardingPlanner."""
    import logging

    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    configs = [EmbeddingBagConfig(name=f"table{i}", embedding_dim=dim, num_embeddings=rows,
                                  feature_names=[f"feature{i}"]) for i, rows in enumerate(rows_of)]
    collection = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    topology = Topology(world_size=world, compute_device="cuda", local_world_size=8,
                        **({"hbm_cap": int(budget_mib * 2**20)} if budget_mib else {}))
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=BATCH_PER_RANK)
    start = time.perf_counter()
    planner.plan(collection, [EmbeddingBagCollectionSharder()])
    seconds = time.perf_counter() - start
    found = {}
    for option in planner._best_plan or []:  # the planner's chosen ShardingOptions (no public accessor in 1.8)
        found[option.name.replace("table", "tables.")] = (option.sharding_type, sorted({s.rank for s in option.shards}),
                              sum(s.perf.total for s in option.shards if s.perf),
                              max(s.storage.hbm for s in option.shards if s.storage))
    return found, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated of {', '.join(SETS)}")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from plait.errors import ConfigError

    table = Table(title="embedding tables: plait's placement against TorchRec 1.8's planner (row-wise Adagrad; "
                        "h100 figures, planned only)")
    for column in ("set", "world", "budget", "table", "rows", "plait", "TorchRec", "TorchRec ranks", "TorchRec perf",
                   "TorchRec HBM/shard", "plait step µs", "plait peak MiB", "plan s plait / TorchRec",
                   "why plait's differs"):
        table.add_column(column, justify="left" if column in ("set", "table", "plait", "TorchRec", "TorchRec ranks",
                                                               "why plait's differs") else "right")
    samples, seen = {}, set()
    for world, set_name in ((w, s) for s in args.sets.split(",") for w in map(int, args.worlds.split(","))):
        model, batch, TABLES, dim, budgets = SETS[set_name]
        for budget in budgets:
            try:
                ours, step, peak, ours_s, samples[set_name] = plait_tables(model, batch, world, budget)
            except ConfigError as e:  # nothing fits: the line says what would
                ours, step, peak, ours_s = {f"tables.{i}": "-" for i in range(len(TABLES))}, 0.0, 0.0, 0.0
                print(f"plait, {set_name}, world {world}, budget {budget}: {e}")
            try:
                theirs, theirs_s = torchrec_tables(TABLES, dim, world, budget)
            except Exception as e:  # noqa: BLE001 - TorchRec's PlannerError when nothing fits
                theirs, theirs_s = {}, 0.0
                print(f"TorchRec, {set_name}, world {world}, budget {budget}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0]}")
            for i, rows in enumerate(TABLES):
                name = f"tables.{i}"
                kind, ranks, perf, hbm = theirs.get(name, ("-", [], 0.0, 0))
                placement = ours.get(name, "R")
                table.add_row(set_name, str(world), f"{budget:g} MiB" if budget else "-", name, f"{rows:,}",
                              f"{placement} ({torchrec_kind(placement)})", kind,
                              ",".join(map(str, ranks)), f"{perf:.3g}", f"{hbm / 2**20:.2f} MiB",
                              f"{step * 1e6:.1f}" if i == 0 else "", f"{peak / 2**20:.1f}" if i == 0 else "",
                              f"{ours_s:.1f} / {theirs_s:.2f}" if i == 0 else "",
                              REASONS[why_they_differ(placement, kind)][0])
                seen.add(why_they_differ(placement, kind))
    Console(width=250).print(table)
    for key, (short, sentence) in REASONS.items():
        if key in seen and sentence:
            print(f"{short}: {sentence}.")
    for set_name, sample in samples.items():
        print(f"{set_name}: plait's lookups priced by the {sample}")


if __name__ == "__main__":
    main()
