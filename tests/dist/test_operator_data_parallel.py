"""Every ZeRO stage, recompute and gradient accumulation a per-operator plan without a pipeline can choose, proven
equal to one process by `plait check`, in one launch of 2 ranks (tests/dist/_data_parallel_worker.py): the graph
network's plans of the joint search at dp2 (examples/operators/gnn.py, one list of repeated layers), pinned as a
user pins them, its layers recomputed at tp2 (the forward's planned reads replayed), and DDP over a module with a
parameter its forward never reads."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "operators"
WORKER = Path(__file__).parent / "_data_parallel_worker.py"

CASES = {  # file name: (zero, recompute, micro-batches per step), the carrier the executor must build; dp2, or tp2
    "tp2-recompute.json": ((0, "full", 1), "none", "AdamW"),
    "zero0-accumulated.json": ((0, "none", 2), "ddp", "AdamW"),
    "zero1-recompute.json": ((1, "full", 1), "ddp", "ZeroRedundancyOptimizer"),
    "zero2.json": ((2, "none", 1), "fully_shard", "AdamW"),
    "zero3-recompute-accumulated.json": ((3, "full", 2), "fully_shard", "AdamW"),
    "zero0-broken.json": ((0, "none", 1), "ddp", "AdamW"),
    "zero0-unread.json": ((0, "none", 1), "ddp", "AdamW"),
}
UNREAD = """import torch
from torch import nn


class Spare(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.spare = nn.Linear(8, 8)  # never read by the forward

    def forward(self, x, y):
        return ((self.fc(x) - y) ** 2).mean()


def build():
    return Spare()


def batch(n, generator):
    return torch.randn(n, 8, generator=generator), torch.randn(n, 8, generator=generator)
"""
"""A module with a parameter its forward never reads: DDP's reducer stops the second step unless told
(OperatorSharding.unread_params)."""


def test_every_zero_stage_recompute_and_accumulation_is_equal_to_one_process(tmp_path):
    from plait.operators.search import DegreePins, search
    from plait.runtime.launch import run_local
    from plait.spec.clusters import CLUSTER_PRESETS

    (tmp_path / "spare_parameter.py").write_text(UNREAD)
    sys.path[:0] = [str(EXAMPLES), str(tmp_path)]
    try:
        for name, ((zero, recompute, m), _, _) in CASES.items():
            dp = 1 if name.startswith("tp2") else 2
            pins = DegreePins(dp=dp, tp=2 // dp, zero=zero, recompute=recompute, micro_batch=8 // dp // m)
            model = "spare_parameter" if "unread" in name else "gnn"
            plan = search(f"{model}:build", f"{model}:batch", CLUSTER_PRESETS["local-cpu"], devices=2, global_batch=8,
                          degrees=pins).plans[0]
            assert (plan.zero, plan.recompute, plan.num_micro_batches) == (zero, (recompute,), m)
            if model == "gnn":
                assert plan.operators.blocks == ("layers" if recompute == "full" or zero >= 2 else "")
            else:
                assert plan.operators.unread_params == ("spare.weight", "spare.bias")
            (tmp_path / name).write_text(plan.to_json())
    finally:
        del sys.path[:2]
    out = tmp_path / "results.json"
    os.environ.setdefault("PLAIT_OMP_THREADS", "1")
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(EXAMPLES), saved]))
    try:
        code = run_local(2, [str(WORKER), str(out), *(str(tmp_path / n) for n in CASES)], module=None, timeout_s=600)
    finally:
        os.environ.pop("PYTHONPATH") if saved is None else os.environ.__setitem__("PYTHONPATH", saved)
    results = json.loads(out.read_text()) if out.exists() else {}
    assert code == 0 and set(results) == set(CASES), results
    for name, (_, carrier, optimizer) in CASES.items():
        result = results[name]
        assert "error" not in result, result.get("traceback")
        assert result["summary"]["data_parallel"] == [carrier] and result["summary"]["optimizer"] == optimizer, \
            (name, result["summary"])
        assert bool(result["failures"]) == ("broken" in name), (name, result["failures"])
