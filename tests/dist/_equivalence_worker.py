"""Worker for tests/dist: runs every case of one world size in one launch, writes JSON on rank 0.

Usage (via plait.runtime.launch.run_local or torchrun): python tests/dist/_equivalence_worker.py WORLD OUT.json [CASE ...]"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch.distributed as dist  # noqa: E402

from equivalence_cases import CLIP, cases_for, make_plan  # noqa: E402
from plait.execute.equivalence import CheckSettings, check_plan  # noqa: E402
from plait.runtime.launch import init_distributed, shutdown_distributed  # noqa: E402

parallelize_module = sys.modules["plait.execute.parallelize"]  # the module (plait.execute exports the function)


@contextlib.contextmanager
def dropped_gradient_sync():
    """Every micro-batch's backward skips the data-parallel reduction: replicas train on their own rows only."""
    real = parallelize_module.gradient_sync
    parallelize_module.gradient_sync = lambda parts, enabled, keep_gathered=False, **kw: real(parts, False, keep_gathered, **kw)
    try:
        yield
    finally:
        parallelize_module.gradient_sync = real


def run_case(case: dict) -> dict:
    settings = CheckSettings(steps=3, seed=1, lr=1e-3, max_norm=CLIP if case["clip"] else None, verify_load=True,
                             chat=case.get("chat", False))
    try:
        with dropped_gradient_sync() if case.get("broken") else contextlib.nullcontext():
            result = check_plan(make_plan(case), settings)
    except Exception as error:  # recorded, so one broken case does not hide the others' results
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    return {} if result is None else result.to_dict() | {"grad_rel_diffs": result.grad_rel_diffs}


def main() -> None:
    world, out = int(sys.argv[1]), Path(sys.argv[2])
    wanted = set(sys.argv[3:])
    init_distributed(timeout_s=120)
    results = {}
    for case in cases_for(world):
        if wanted and case["name"] not in wanted:
            continue
        results[case["name"]] = run_case(case)
        dist.barrier()
        if dist.get_rank() == 0:
            out.write_text(json.dumps(results, indent=1))  # written as we go: a crash keeps what finished
    shutdown_distributed()


if __name__ == "__main__":
    main()
