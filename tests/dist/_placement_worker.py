"""Worker of test_mixed.py: parallelize a mixed-cluster plan and report where each rank landed."""

import json
import sys

import torch.distributed as dist

from plait.execute import parallelize
from plait.execute.mesh import pipeline_position
from plait.runtime.launch import init_distributed, shutdown_distributed
from plait.profile.tune import read_plans

plan_file, out = sys.argv[1], sys.argv[2]
rank, _ = init_distributed("gloo")
plan = read_plans(plan_file)[0]
model = parallelize(plan, seed=0, device="cpu")
mine = {"rank": rank, "position": pipeline_position(model.mesh), "stages": list(model.stage_ids),
        "throttled": sorted({getattr(b, "_plait_throttle", 1.0) for p in model.model_parts
                             for b in p.stage_blocks().values()})}
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, mine)
if rank == 0:
    with open(out, "w") as f:
        json.dump(everyone, f)
shutdown_distributed()
