"""Worker for tests/dist: runs every case of one world size in one launch, writes JSON on rank 0.

Usage (via plait.launch.run_local or torchrun): python tests/dist/_equivalence_worker.py WORLD OUT.json [CASE ...]"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch.distributed as dist  # noqa: E402

from equivalence_cases import CLIP, cases_for, make_plan  # noqa: E402
from plait.execute.equivalence import CheckSettings, check_plan  # noqa: E402
from plait.launch import init_distributed, shutdown_distributed  # noqa: E402


def run_case(case: dict) -> dict:
    settings = CheckSettings(steps=3, seed=1, lr=1e-3, max_norm=CLIP if case["clip"] else None,
                             verify_load=True)
    try:
        result = check_plan(make_plan(case), settings)
    except Exception as error:  # recorded, so one broken case does not hide the others' results
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    if result is None:
        return {}
    return {"plan": result.plan, "losses": result.losses, "reference_losses": result.reference_losses,
            "max_loss_rel_diff": result.max_loss_rel_diff, "max_param_diff": result.max_param_diff,
            "worst_param": result.worst_param, "grad_norms": result.grad_norms,
            "reference_grad_norms": result.reference_grad_norms, "max_grad_norm_rel_diff": result.max_grad_norm_rel_diff,
            "runtime": result.runtime}


def main() -> None:
    world, out = int(sys.argv[1]), Path(sys.argv[2])
    wanted = set(sys.argv[3:])
    init_distributed(timeout_s=60)
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
