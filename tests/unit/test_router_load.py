"""The run measures its router's balance (plait.train.measure.RouterLoad): the busiest expert-parallel rank's slots
over the mean, for every ep the experts split into, from the real MoE layer's top-k choices."""

from __future__ import annotations

import pytest
import torch

from plait.models.moe import MoE
from plait.spec.models import MODEL_PRESETS
from plait.train.measure import Parts, RankRecord, RouterLoad, Segment, router_line
from plait.plan import Plan

A = [2.0, 0.0, 1.0, 0.0]  # top-2 {0, 2}
B = [0.0, 2.0, 0.0, 1.0]  # top-2 {1, 3}


def moe_layer() -> MoE:
    spec = MODEL_PRESETS["tiny-moe"].replace(hidden_size=4, num_heads=1, num_kv_heads=1, moe_ffn_hidden_size=4)
    moe = MoE(spec)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(4))  # logits = the token itself
        for p in moe.experts.parameters():
            p.normal_()
    return moe


def run(moe: MoE, tokens: list[list[float]]) -> None:
    moe(torch.tensor(tokens).reshape(1, len(tokens), 4)).sum().backward()


def test_a_balanced_router_reads_one_and_a_skewed_one_its_busiest_group():
    moe = moe_layer()
    meter = RouterLoad([moe])
    run(moe, [A, B] * 8)  # every expert 8 slots
    assert meter.take() == {2: pytest.approx(1.0), 4: pytest.approx(1.0)}
    run(moe, [A] * 16)  # experts 0 and 2 take every slot: each half of the experts holds one of them
    assert meter.take() == {2: pytest.approx(1.0), 4: pytest.approx(2.0)}
    run(moe, [A] * 16)
    run(moe, [A, B] * 8)  # the mean over the passes since the last take
    assert meter.take() == {2: pytest.approx(1.0), 4: pytest.approx(1.5)}
    assert meter.take() == {}


def test_only_training_passes_count_and_remove_unhooks():
    moe = moe_layer()
    meter = RouterLoad([moe])
    moe.eval()
    with torch.no_grad():
        moe(torch.tensor([A] * 4).reshape(1, 4, 4))
    assert meter.take() == {}
    moe.train()
    meter.remove()
    run(moe, [A] * 4)
    assert meter.take() == {}


def test_the_segment_reports_the_median_step_of_the_mean_over_ranks(tmp_path):
    records = []
    for rank, loads in enumerate(([1.0, 1.2, 1.4, 1.6], [1.0, 1.4, 1.6, 1.8])):
        record = RankRecord(rank=rank, pp_rank=0, dp_rank=rank)
        for step, load in enumerate(loads, 1):
            record.add(step, 1.0, 0.5, 0.4, 0.1, {2: load, 4: 2 * load})
        records.append(record)
    segment = Segment(plan={}, predicted=Parts(step=1.0, compute=1.0, waiting=0.0, optimizer=0.0), predicted_rank_compute=[1.0], ranks=records)
    # warmup 1 leaves steps 2-4: means over ranks 1.3, 1.5, 1.7 -> median 1.5
    assert segment.router_imbalance(warmup=1) == {2: pytest.approx(1.5), 4: pytest.approx(3.0)}
    again = Segment.from_dict(segment.to_dict())
    assert again.router_imbalance(warmup=1) == segment.router_imbalance(warmup=1)
    # files written before the router was measured read back without it
    old = segment.to_dict()
    for r in old["ranks"]:
        del r["router_load"]
    assert Segment.from_dict(old).router_imbalance() == {}


def test_the_line_names_the_priced_value_and_how_to_plan_with_the_measured_one():
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.spec import TrainSpec

    model = MODEL_PRESETS["tiny-moe"]
    plan = Plan.of(dp=2, model=model, cluster=CLUSTER_PRESETS["local-cpu"].with_devices(2),
                   train=TrainSpec(global_batch=2, seq_len=16))
    line = router_line({2: 1.031, 4: 1.2}, plan)
    assert "ep2 1.031" in line and "ep4 1.200" in line and "priced with 1.25" in line
    assert "--router-imbalance" in line


def hf_moe_block():
    """The sparse MLP of a tiny Qwen3-MoE (transformers' own class) whose router reads the token itself."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=4, moe_intermediate_size=4, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=True)
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(torch.eye(4))
        for p in block.experts.parameters():
            p.normal_()
    return block


def test_a_hugging_face_moe_is_measured_as_plaits():
    block = hf_moe_block()
    meter = RouterLoad([block])
    run(block, [A, B] * 8)
    assert meter.take() == {2: pytest.approx(1.0), 4: pytest.approx(1.0)}
    run(block, [A] * 16)
    assert meter.take() == {2: pytest.approx(1.0), 4: pytest.approx(2.0)}
    meter.remove()
    run(block, [A] * 16)
    assert meter.take() == {}


# ---- the measured balance flows back: plan --from-run, tune --from-run, --adapt --------------------------------
def _moe_run(log_dir, model: str, readings: dict[int, float], steps: int = 6):
    """A run's measured.json as `plait train` writes it: two ranks, `readings` per ep on every step."""
    from plait.spec import TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.train.measure import write_measured

    plan = Plan.of(dp=2, model=MODEL_PRESETS[model], cluster=CLUSTER_PRESETS["local-cpu"].with_devices(2),
                   train=TrainSpec(global_batch=2, seq_len=16, precision="fp32"))
    records = []
    for rank in range(2):
        record = RankRecord(rank=rank, pp_rank=0, dp_rank=rank)
        for step in range(1, steps + 1):
            record.add(step, 1.0, 0.6, 0.5, 0.1, readings)
        records.append(record)
    segment = Segment(plan=plan.to_dict(), predicted=Parts(step=1.0, compute=0.5, waiting=0.1, optimizer=0.1),
                      predicted_rank_compute=[0.5], ranks=records)
    log_dir.mkdir(parents=True, exist_ok=True)
    write_measured(log_dir, [segment])
    return plan, segment


def test_a_measured_router_balance_changes_the_next_plan(tmp_path, capsys):
    """Mixtral 8x7B on 64 H100s: priced at the assumed 1.25 plait keeps experts whole (tp2); a run that measured a
    balanced router (ep8 1.02) makes `plait plan --from-run` pick expert parallelism, no number copied by hand."""
    from plait.cli import main as cli_main

    _moe_run(tmp_path / "run", "mixtral-8x7b", {2: 1.0, 4: 1.01, 8: 1.02})
    argv = ["plan", "--model", "mixtral-8x7b", "--cluster", "h100-80g", "--devices", "64", "--global-batch", "256",
            "--seq-len", "4096", "--top", "1"]
    assert cli_main(argv + ["--json", str(tmp_path / "assumed.json")]) == 0
    assert cli_main(argv + ["--json", str(tmp_path / "measured.json"), "--from-run", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "router balance 1.02 (ep8, the largest expert split measured" in err and "was 1.25" in err
    assumed, measured = (Plan.from_json(tmp_path / f"{name}.json") for name in ("assumed", "measured"))
    assert assumed.degrees.ep == 1 and measured.degrees.ep == 8
    assert measured.model.router_imbalance == pytest.approx(1.02)
    # a dense run has nothing to give, and both sources at once are refused
    _moe_run(tmp_path / "dense", "tiny-gpt", {})
    assert cli_main(argv + ["--from-run", str(tmp_path / "dense")]) == 2
    assert "holds no router balance" in capsys.readouterr().err
    assert cli_main(argv + ["--from-run", str(tmp_path / "run"), "--router-imbalance", "1.1"]) == 2
    assert "give one" in capsys.readouterr().err


def test_tune_and_adapt_price_a_moe_plan_with_the_balance_its_run_measured(tmp_path, capsys):
    from plait.profile.tuning import run_observations
    from plait.train.adapt import with_measured_router

    plan, segment = _moe_run(tmp_path, "tiny-moe", {2: 1.3, 4: 1.7})
    assert plan.model.router_imbalance == 1.25
    observations = run_observations([("runs/moe", segment)], plan.cluster)
    assert observations and all(o.plan.model.router_imbalance == pytest.approx(1.7) for o in observations)
    assert "router balance it measured: 1.7 (ep4" in capsys.readouterr().out
    assert with_measured_router(plan, segment).model.router_imbalance == pytest.approx(1.7)
    dense, dense_segment = _moe_run(tmp_path / "dense", "tiny-gpt", {})
    assert with_measured_router(dense, dense_segment) is dense
