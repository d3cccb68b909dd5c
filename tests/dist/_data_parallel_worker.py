"""Worker for tests/dist/test_operator_data_parallel.py: `plait check` of several per-operator plans in one launch,
each plan's data-parallel carrier recorded beside its verdict; JSON on rank 0.

Usage (via plait.runtime.launch.run_local): python tests/dist/_data_parallel_worker.py OUT.json PLAN.json ...
A plan file whose name holds "broken" runs with every micro-batch's data-parallel reduction skipped (replicas train
on their own rows): its check must say DIFFERENT."""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from plait.execute import data
from plait.execute.equivalence import CheckSettings, Tolerance
from plait.execute.module_model import parallelize_module
from plait.execute.operators import check_plan
from plait.models.factory import use_import_roots
from plait.plan import Plan
from plait.runtime.launch import init_distributed, shutdown_distributed


@contextlib.contextmanager
def dropped_gradient_sync():
    real = data.gradient_sync
    data.gradient_sync = lambda parts, enabled, keep_gathered=False, last=None: real(parts, False, keep_gathered, last)
    try:
        yield
    finally:
        data.gradient_sync = real


def run(path: Path) -> dict:
    plan = Plan.from_json(path)
    use_import_roots(plan.operators.import_paths)  # where the module was planned from, as `plait check` finds it
    model = parallelize_module(plan, seed=1)
    optimizer = model.make_optimizer(lr=1e-3)
    summary = model.runtime_summary(optimizer)
    try:
        with dropped_gradient_sync() if "broken" in path.name else contextlib.nullcontext():
            result = check_plan(plan, CheckSettings(steps=2, seed=1, lr=1e-3))
    except Exception as error:  # recorded, so one broken case does not hide the others' results
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    if result is None:
        return {}
    return {"summary": summary, "failures": result.failures(Tolerance()), "losses": result.losses}


def main() -> None:
    out, plans = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    init_distributed(timeout_s=120)
    results = {}
    for path in plans:
        results[path.name] = run(path)
        dist.barrier()
        if dist.get_rank() == 0:
            out.write_text(json.dumps(results, indent=1))  # written as we go: a crash keeps what finished
    shutdown_distributed()


if __name__ == "__main__":
    main()
