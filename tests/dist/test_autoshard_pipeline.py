"""Per-operator plans with pipeline stages, proved on their ranks: the tiny decoders cut between their blocks
(plait.operators.stages), each stage with its own per-operator placements, run by torch.distributed.pipelining's
1F1B; `plait check` EQUAL to one process (tests/unit/test_operators_pipeline.py covers planning)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.operators.planner import auto_plan
from plait.spec.clusters import CLUSTER_PRESETS

from test_autoshard import check_equal  # tests/dist is on sys.path (pytest's default import mode)

pytestmark = pytest.mark.dist
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "auto"


def test_check_proves_a_transformers_llama_cut_in_two_stages_equal(tmp_path, monkeypatch):
    """pp2 on 2 ranks: transformers' LlamaForCausalLM, its own forward run around the block each stage holds."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("decoders:hf_llama", "decoders:tokens", CLUSTER_PRESETS["local-cpu"], global_batch=8, pp=2)
    assert plan.pp == 2 and plan.layers_per_stage == (1, 1) and len(plan.operators.stages) == 2
    check_equal(plan, tmp_path)


def test_check_proves_pipeline_stages_with_tensor_parallel_placements_equal(tmp_path, monkeypatch):
    """pp2 x tp2 on 4 ranks: plait's reference Llama, Megatron's pattern inside each stage (the block solution the
    whole module's program found, reused on both stages), hidden states sent whole between the stages."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    plan = auto_plan("decoders:llama", "decoders:tokens", CLUSTER_PRESETS["local-cpu"], global_batch=8, tp=2, pp=2)
    assert all(sum(p != "R" for p in stage.params.values()) >= 7 for stage in plan.operators.stages)
    check_equal(plan, tmp_path)
