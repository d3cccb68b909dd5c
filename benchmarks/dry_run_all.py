"""Does every plan the planner emits build? For every model preset and every Hugging Face example in
examples/hf, plan on a cluster of the model's size and build each of the top plans with the executor's dry run
(`plait check --dry-run`: the legality rules, then the pipeline ranks' stages on `meta` under a fake process
group of the plan's world size; here the first and the last pipeline rank, which hold the embedding and the
head, `--all-ranks` for every one). Prints one row per model, with the seconds of planning and building; exit
code 1 if any plan failed to build.

    .venv/bin/python benchmarks/dry_run_all.py [--top 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (model, cluster, devices, global batch, sequence): each model on a setting of its size
SETTINGS = {
    "tiny": ("local-cpu", 4, 16, 128),
    "small": ("a100-80g", 64, 512, 2048),
    "large": ("a100-80g", 1024, 1536, 2048),
    "huge": ("h100-80g", 4096, 2048, 4096),
}


def setting_of(name: str, params: float) -> tuple:
    if name.startswith("tiny"):
        return SETTINGS["tiny"]
    if params < 30e9:
        return SETTINGS["small"]
    return SETTINGS["large"] if params < 300e9 else SETTINGS["huge"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=5, help="plans per model to build (default 5)")
    parser.add_argument("--all-ranks", action="store_true", help="build every pipeline rank, not the two ends")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from plait.execute.dryrun import dry_run
    from plait.search import plan_with_stats
    from plait.spec import TrainSpec
    from plait.spec.load import load_model
    from plait.spec.models import MODEL_PRESETS

    models = list(MODEL_PRESETS) + sorted(str(p) for p in (ROOT / "examples" / "hf").iterdir() if p.is_dir())
    table = Table(title=f"top {args.top} plans of every preset and examples/hf model, built by the dry run")
    for column in ("model", "cluster", "devices", "plans", "built", "best plan", "seconds"):
        table.add_column(column, justify="left" if column in ("model", "cluster", "best plan") else "right")
    failures = 0
    for name in models:
        spec = load_model(name)
        cluster, devices, batch, seq = setting_of(spec.name, spec.num_params)
        seq = min(seq, spec.max_seq_len)
        began = time.perf_counter()
        print(f"{name} ...", file=sys.stderr, flush=True)
        precision = "fp32" if cluster == "local-cpu" else "bf16"
        plans = plan_with_stats(spec, cluster, TrainSpec(global_batch=batch, seq_len=seq, precision=precision),
                                num_devices=devices, top=args.top).plans
        built = 0
        for plan in plans:
            try:
                dry_run(plan, None if args.all_ranks else sorted({0, plan.pp - 1}))
                built += 1
            except Exception as error:  # noqa: BLE001 - reported, counted, and the exit code says so
                print(f"{name}: {plan.describe()} did not build: {error}", file=sys.stderr)
        failures += len(plans) - built
        label = Path(name).name if "/" in name else name
        table.add_row(label, cluster, f"{devices:,}", str(len(plans)), str(built),
                      plans[0].describe() if plans else "-", f"{time.perf_counter() - began:.1f}")
    Console(width=170).print(table)
    print(f"{failures} plan(s) failed to build" if failures else "every plan built")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
