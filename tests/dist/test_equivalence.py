"""Every technique alone and the combinations that matter, on 2, 4 and 8 gloo ranks, for plait's reference
decoders and every Hugging Face family plait runs: three AdamW steps give the same losses, gradients and
parameters as one process (float64), by the verdict `plait check` uses; a plan with a dropped gradient
reduction is called DIFFERENT by orders of magnitude."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2] / "examples" / "custom"))  # the module:factory model, planned here
from equivalence_cases import CASES, CLIP, make_plan  # noqa: E402

from plait.execute.equivalence import Tolerance  # noqa: E402
from plait.legality import data_parallel_mode  # noqa: E402

pytestmark = pytest.mark.dist
TOL = Tolerance()
SOUND = [c for c in CASES if not c.get("broken")]


def _result(dist_results, case: dict) -> dict:
    run = dist_results.get(case["world"])
    result = run["cases"].get(case["name"])
    assert result is not None, f"no result for {case['name']} (launch exit code {run['exit_code']})"
    assert "error" not in result, result.get("traceback", result.get("error"))
    return result


@pytest.mark.parametrize("case", SOUND, ids=[f"{c['world']}r-{c['name']}" for c in SOUND])
def test_equals_one_process(dist_results, case):
    result = _result(dist_results, case)
    assert len(result["losses"]) == 3
    assert len(set(result["reference_losses"])) == 3, "training did not move the loss; the test would prove nothing"
    assert result["max_loss_rel_diff"] <= TOL.loss, (result["losses"], result["reference_losses"])
    assert result["worst_grad"][1] <= TOL.grad, result["worst_grad"]
    assert result["worst_update"][1] <= TOL.update, result["worst_update"]
    if case["clip"]:
        # the norm is global (all dp/tp/pp shards) and clipping acted: Adam alone would hide a wrong scale
        assert min(result["reference_grad_norms"]) > CLIP
        assert result["max_grad_norm_rel_diff"] <= TOL.loss, (result["grad_norms"], result["reference_grad_norms"])


def test_a_dropped_gradient_reduction_is_different_by_orders_of_magnitude(dist_results):
    broken = _result(dist_results, next(c for c in CASES if c.get("broken")))
    sound = [_result(dist_results, c) for c in SOUND if c["world"] == 2]
    noise = max(r["worst_grad"][1] for r in sound)
    assert broken["worst_grad"][1] > 1e3 * TOL.grad > 1e3 * noise
    assert broken["worst_update"][1] > 1e3 * TOL.update


@pytest.mark.parametrize("case", SOUND, ids=[f"{c['world']}r-{c['name']}" for c in SOUND])
def test_runs_the_planned_building_blocks(dist_results, case):
    """The equality above must come from the techniques the plan names, not from skipping them."""
    runtime = _result(dist_results, case)["runtime"]
    assert runtime["load_roundtrip_max_diff"] == 0.0  # load_full_state_dict / full_state_dict are inverses
    dp, tp, pp, zero = (case.get(k, d) for k, d in (("dp", 1), ("tp", 1), ("pp", 1), ("zero", 0)))
    interleave = case.get("interleave", 1)
    carrier = data_parallel_mode(make_plan(case).degrees, zero).carrier  # context ranks reduce like data ranks
    if carrier != "none":
        sharded = zero >= 2 or carrier == "fully_shard"  # DDP cannot run under a pipeline schedule
        expected = "fully_shard" if sharded else "DistributedDataParallel"
        assert expected in runtime["data_parallel"], runtime
        if zero == 1 and not sharded:
            assert runtime["optimizer"] == "ZeroRedundancyOptimizer"
    else:
        assert runtime["data_parallel"] == ["none"]
    if tp > 1:
        assert runtime["dtensor_params"] == runtime["params"] > 0
    expected_schedule = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                         "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
    assert runtime["schedule"] == (expected_schedule[case.get("schedule", "1f1b")] if pp > 1 else None)
    assert len(runtime["stages"]) == interleave
    if pp > 1 and case["model"] in ("gpt-tied", "hf:gpt2", "hf:qwen2", "hf:gemma"):
        assert runtime["tied_synced"] == 1  # the first stage's embedding and the last's output layer
    mode = (case.get("recompute") or ["none"])[0]  # rank 0 is pipeline rank 0
    if mode == "none":
        assert runtime["checkpointed_blocks"] == 0 and runtime["selective_blocks"] == 0
    elif mode == "full":
        assert runtime["checkpointed_blocks"] > 0 or pp > 1
    else:
        assert runtime["selective_blocks"] > 0 or pp > 1


def test_chat_masked_batches_give_one_loss_under_every_layout(dist_results):
    """dp2, tp2 and pp2 cut one chat-masked global batch three ways; each step's loss is the same token mean."""
    chat = [c for c in SOUND if c["name"] in ("chat-hf-llama-dp2", "chat-hf-llama-tp2", "chat-hf-llama-pp2")]
    results = [_result(dist_results, c) for c in chat]
    assert len(results) == 3 and len({tuple(r["reference_losses"]) for r in results}) == 1, "one batch, one truth"
    for case, result in zip(chat, results):
        assert result["losses"] == pytest.approx(results[0]["reference_losses"], rel=1e-12), case["name"]
