"""The joint search: sensible plans, pins honoured, memory respected, errors that say what would work."""

import dataclasses

import pytest

import plait
from plait import ConfigError, NoFeasiblePlan, TrainSpec
from plait.cost import predict
from plait.search import explain, plan, plan_with_stats

GPT3 = TrainSpec(global_batch=1536, seq_len=2048)
TINY = TrainSpec(global_batch=8, seq_len=64)


@pytest.fixture(scope="module")
def gpt3_1024():
    return plan_with_stats("gpt3-175b", "a100-80g", GPT3, num_devices=1024, top=5)


def test_gpt3_on_1024_a100_is_sensible(gpt3_1024):
    best = gpt3_1024.plans[0]
    assert best.num_devices == best.dp * best.cp * best.tp * best.pp == 1024
    assert best.pp > 1 and 1 < best.tp <= 8  # the model needs pipelining; tensor groups stay inside a node
    assert 0.3 < best.predicted.mfu < 0.6
    assert gpt3_1024.candidates_evaluated > 100 and gpt3_1024.seconds > 0
    times = [p.predicted.step_time_s for p in gpt3_1024.plans]
    assert times == sorted(times)


def test_every_plan_fits_and_its_prediction_is_reproducible(gpt3_1024):
    for p in gpt3_1024.plans:
        assert p.predicted.peak_memory_bytes <= p.cluster.memory_bytes
        again = predict(plait.Plan.from_json(p.to_json()))
        assert again.step_time_s == pytest.approx(p.predicted.step_time_s)


def test_public_api_and_tiny_gpt_on_local_cpu():
    for n in (2, 4, 8):
        plans = plait.plan("tiny-gpt", "local-cpu", TINY, num_devices=n, top=3)
        assert plans and all(p.num_devices == n for p in plans)
    assert plait.plan("tiny-llama", "local-cpu", TINY, num_devices=4, tp=2, pp=2)[0].tp == 2


def test_pins_are_honoured():
    pins = dict(tp=2, pp=2, zero=1, micro_batch=1, schedule="1f1b", recompute="selective", sequence_parallel=True)
    plans = plan("tiny-gpt", "local-cpu", TINY, num_devices=8, **pins)
    assert plans
    for p in plans:
        assert (p.tp, p.pp, p.dp * p.cp, p.zero, p.micro_batch, p.schedule) == (2, 2, 2, 1, 1, "1f1b")
        assert p.recompute == ("selective", "selective") and p.sequence_parallel


def test_all_pinned_evaluates_one_plan():
    result = plan_with_stats("tiny-gpt", "local-cpu", TINY, num_devices=4, dp=1, tp=2, pp=2, zero=0, micro_batch=2,
                             schedule="interleaved", interleave=2, recompute="none", sequence_parallel=False)
    assert result.candidates_evaluated == 1 and len(result.plans) == 1
    p = result.plans[0]
    assert p.schedule == "interleaved" and p.interleave == 2 and len(p.layers_per_stage) == 4


def test_pins_without_effect_are_accepted():
    plans = plan("tiny-gpt", "local-cpu", TINY, num_devices=2, pp=1, tp=1, schedule="gpipe", sequence_parallel=True)
    assert plans and all(p.pp == 1 and not p.sequence_parallel for p in plans)


def test_uneven_split_and_per_rank_recompute_when_memory_is_tight():
    # 175B on 64 A100-80GB: tight memory, so early pipeline ranks (more micro-batches in flight) recompute more.
    best = plan("gpt3-175b", "a100-80g", GPT3, num_devices=64, tp=8, pp=8, schedule="1f1b", top=1)[0]
    order = {"none": 0, "selective": 1, "full": 2}
    ranks = [order[m] for m in best.recompute]
    assert ranks == sorted(ranks, reverse=True)
    assert best.predicted.peak_memory_bytes <= best.cluster.memory_bytes


@pytest.mark.parametrize("pins,needle", [
    (dict(tp=3), "valid tp"),
    (dict(tp=16), "does not divide 8 devices"),
    (dict(pp=5), "valid pp"),
    (dict(dp=3), "valid dp"),
    (dict(dp=2, tp=2, pp=4), "cannot make"),
    (dict(micro_batch=3), "valid micro_batch"),
    (dict(zero=4), "zero=4"),
    (dict(schedule="zigzag"), "schedule="),
    (dict(recompute="some"), "recompute="),
])
def test_bad_pins_name_the_value_and_what_works(pins, needle):
    with pytest.raises(ConfigError, match=needle):
        plan("llama2-7b", "a100-80g", TrainSpec(global_batch=64, seq_len=1024), num_devices=8, **pins)


def test_tensor_groups_stay_inside_a_node_unless_allowed():
    train = TrainSpec(global_batch=64, seq_len=1024)
    with pytest.raises(ConfigError, match="inside a node of 8"):
        plan("llama2-7b", "a100-80g", train, num_devices=32, tp=16)
    assert plan("llama2-7b", "a100-80g", train, num_devices=32, tp=16, allow_cross_node_tp=True, top=1)[0].tp == 16


def test_unknown_presets_and_bad_counts():
    with pytest.raises(ConfigError, match="unknown model"):
        plan("gpt-5", "a100-80g", GPT3)
    with pytest.raises(ConfigError, match="unknown cluster"):
        plan("tiny-gpt", "tpu-v9", TINY)
    with pytest.raises(ConfigError, match="num_devices"):
        plan("tiny-gpt", "local-cpu", TINY, num_devices=0)


def test_indivisible_batch_is_a_config_error():
    with pytest.raises(ConfigError, match="global_batch=7"):
        plan("tiny-gpt", "local-cpu", TrainSpec(global_batch=7, seq_len=64), num_devices=4, dp=4)


def test_nothing_fits_says_by_how_much_and_what_would():
    with pytest.raises(NoFeasiblePlan) as info:
        plan("gpt3-175b", "a100-80g", TrainSpec(global_batch=64, seq_len=2048), num_devices=8)
    message = str(info.value)
    assert "GiB too much" in message and "smallest device count" in message
    smallest = int(message.rsplit(" ", 1)[-1])
    assert smallest % 8 == 0 and plan("gpt3-175b", "a100-80g", TrainSpec(global_batch=64, seq_len=2048),
                                      num_devices=smallest, top=1)


def test_explain_names_the_parts_that_differ(gpt3_1024):
    best, runner = gpt3_1024.plans[:2]
    line = explain(best, runner)
    # faster, or as fast and lighter: either way the parts that differ are named in brackets
    assert line.startswith(("best by", "ties with the runner-up")) and "[" in line
    slower = next(p for p in gpt3_1024.plans if p.predicted.step_time_s > best.predicted.step_time_s * 1.001)
    line = explain(best, slower)
    assert line.startswith("best by") and "[" in line
    assert explain(best, None) == "the only feasible plan"


def test_full_listing_matches_top_k():
    full = plan_with_stats("tiny-gpt", "local-cpu", TINY, num_devices=4)
    top = plan_with_stats("tiny-gpt", "local-cpu", TINY, num_devices=4, top=2)
    assert len(full.plans) >= len(top.plans) == 2
    assert [p.describe() for p in top.plans] == [p.describe() for p in full.plans[:2]]
    assert len(full.points) == full.candidates_evaluated - 0 or len(full.points) <= full.candidates_evaluated


def test_pruned_search_finds_the_same_best_as_the_full_one():
    train = TrainSpec(global_batch=64, seq_len=1024)
    full = plan_with_stats("gpt-7.5b", "a100-40g", train, num_devices=16)
    top = plan_with_stats("gpt-7.5b", "a100-40g", train, num_devices=16, top=3)
    assert top.candidates_pruned > 0 and top.candidates_evaluated < full.candidates_evaluated
    # the shortlist is ranked by the closed-form schedule: a plan within 0.1% of the exact best may take its place
    # (here two plans 0.01% apart: dp8 pp2 interleaved v=5 and dp16 ZeRO-3)
    assert top.plans[0].predicted.step_time_s <= full.plans[0].predicted.step_time_s * (1 + 1e-3)
    assert top.plans[0].describe() in [p.describe() for p in full.plans[:5]]


def test_pruned_search_stays_exact_where_ranks_share_cores():
    """Idle pipeline stages lend their cores (oversubscription 2): the bound must still never exceed a price."""
    from plait.spec.load import load_cluster

    shared = load_cluster("local-cpu").replace(oversubscription=2.0, host=dataclasses.replace(
        load_cluster("local-cpu").host, layer_overhead_s=2e-3))
    train = TrainSpec(global_batch=16, seq_len=128, precision="fp32")
    full = plan_with_stats("tiny-gpt", shared, train, num_devices=4)
    top = plan_with_stats("tiny-gpt", shared, train, num_devices=4, top=3)
    assert [p.describe() for p in top.plans] == [p.describe() for p in full.plans[:3]]
    assert any(p.pp > 1 for p in full.plans[:10])
