"""A sample of benchmarks/hf_families.py in the suite: Hugging Face families plait has no code for, each run by the
generic adapter under one plan on 2 ranks and judged by `plait check`'s verdict (one launch for all of them).

OLMo 2 (post-norms, q/k norms over the whole projection: its plan gathers q, k, v) under tp2 with sequence
parallelism; Phi-3 (fused q|k|v and gate|up projections) under pp2; Gemma 2 (soft-capped attention and logits: the
class's own eager attention) under pp2; MiniCPM3 (latent attention: q_a_proj, which its plan leaves unplaced,
replicated; kv_a_proj_with_mqa's rotary part's gradient summed) under tp2; MiniMax (lightning attention its plan
leaves unplaced, run whole on every rank in its linear layers, the full attention split in the others) under tp2;
StableLM (no tensor-parallel plan of its own: plait's, derived from its plain projections, plait.hf.tensor_plan)
under tp2 with sequence parallelism. And a refusal: Gemma 2 under ep2 has no experts, OLMo 2's tensor plan under a
style plait does not run would be refused before any rank starts (benchmarks/hf_families.admit)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "hf_families.py"
SAMPLE = [("olmo2", "tp2"), ("phi3", "pp2"), ("gemma2", "pp2"), ("minicpm3", "tp2"), ("minimax", "tp2"),
          ("stablelm", "tp2")]


def _sweep_module():
    spec = importlib.util.spec_from_file_location("hf_families", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    module = _sweep_module()
    work = tmp_path_factory.mktemp("families")
    results = work / "results.jsonl"
    for family in {f for f, _ in SAMPLE}:
        assert module.write_tiny(family, work / family) is None
    cases = [{"family": f, "plan": p, "dir": str(work / f)} for f, p in SAMPLE]
    for case in cases:
        assert module.admit(Path(case["dir"]), case["plan"]) is None  # legal: nothing refuses it
    module._launch(cases, results, work, timeout_s=600)
    return module, work, module._done(results)


@pytest.mark.parametrize("family,plan", SAMPLE)
def test_family_runs_equal_to_one_process(sweep, family, plan):
    _, _, rows = sweep
    assert rows[(family, plan)]["status"] == "EQUAL", rows[(family, plan)]


def test_refusals_name_their_rule(sweep):
    module, work, _ = sweep
    assert module.admit(work / "gemma2", "ep2") == {"status": "N/A", "detail": "no experts"}
    from plait.legality import tensor_problems
    from plait.spec.load import load_model

    olmo = load_model(str(work / "olmo2"))
    unknown = olmo.replace(tp_plan={**olmo.tp_plan, "layers.*.mlp.up_proj": "a_future_style"})
    (problem,) = tensor_problems(unknown, 2)
    assert problem.rule == "tp-style-runs" and "layers.*.mlp.up_proj" in str(problem) and "a_future_style" in str(problem)
    assert not tensor_problems(unknown, 1)
