"""Islands in the cluster file, the price of how they talk, the planner's choice, failures priced, and the bad input
refused before anything runs (pure: no process groups)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from plait.cli import main as cli
from plait.cost.failures import MEASURED_RESTART_S, price_failures, young_interval
from plait.cost.islands import (
    exchange_time,
    price_diloco,
    price_sync,
    smallest_hiding_h,
)
from plait.errors import ConfigError
from plait.plan import IslandPlan, Plan
from plait.search.islands import IslandPins, plan_islands
from plait.spec import LinkSpec
from plait.spec.cluster import Islands
from plait.spec.load import load_cluster, load_model, load_train

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "examples" / "clusters" / "islands-local.yaml"
WAN = ROOT / "examples" / "clusters" / "small-clusters-wan.yaml"
REGION = ROOT / "examples" / "clusters" / "two-clusters-one-region.yaml"


def test_example_cluster_files_read_with_their_islands():
    wan, region = load_cluster(WAN), load_cluster(REGION)
    assert (wan.islands.count, wan.island_devices) == (4, 16)
    assert wan.islands.link.bandwidth == pytest.approx(10e9 / 8) and wan.islands.link.latency_s == pytest.approx(0.04)
    assert (region.islands.count, region.island_devices, region.failures.per) == (2, 64, "node")
    view = region.island_view()
    assert view.islands is None and view.num_devices == 64 and view.inter_node == region.inter_node


def test_the_exchange_is_the_ring_all_reduce_of_the_link():
    cluster = load_cluster(WAN)
    link = cluster.islands.link
    nbytes = 1e9
    expected = 2 * 3 * link.latency_s + 2 * 3 / 4 * nbytes / link.bandwidth  # 4 islands, one per "node"
    assert exchange_time(nbytes, cluster) == pytest.approx(expected)
    sync = price_sync(cluster, params=nbytes / 4, inner_step_s=1.0, tokens_per_step=1000)
    assert sync.step_time_s == pytest.approx(1.0 + expected)
    assert sync.link_bytes_per_step == pytest.approx(2 * 3 / 4 * nbytes)


def test_diloco_divides_the_traffic_by_h_and_the_precision():
    cluster = load_cluster(WAN)
    sync = price_sync(cluster, 1e9, 1.0, 1000)
    diloco = price_diloco(cluster, 1e9, 1.0, 1000, inner_steps=100, precision="bf16")
    assert diloco.link_bytes_per_step == pytest.approx(sync.link_bytes_per_step / 100 / 2)
    assert diloco.tokens_per_s > sync.tokens_per_s
    overlapped = price_diloco(cluster, 1e9, 1.0, 1000, inner_steps=100, precision="bf16", overlap=99)
    assert overlapped.hidden and overlapped.step_time_s == pytest.approx(1.0)


def test_the_smallest_hiding_h_hides_and_one_step_less_overlap_would_not():
    cluster = load_cluster(WAN)
    for fragments in (1, 2, 4):
        cost = smallest_hiding_h(cluster, 1e9, 0.5, 1000, fragments=fragments, precision="fp32")
        assert cost.hidden and cost.inner_steps == fragments * (cost.overlap + 1)
        less = price_diloco(cluster, 1e9, 0.5, 1000, inner_steps=cost.inner_steps, fragments=fragments,
                            precision="fp32", overlap=cost.overlap - 1)
        assert not less.hidden or cost.overlap == 1


def test_planner_picks_diloco_over_a_wide_area_link_and_explains_it():
    cluster = load_cluster(WAN)
    train = load_train(global_batch=256, seq_len=4096, precision="bf16")
    choice = plan_islands(load_model("llama3-8b"), cluster, train, top=2)
    best = choice.plans[0]
    assert best.islands.method == "diloco" and choice.chosen.hidden
    assert best.num_devices == 64 and best.degrees.world_size == 16
    assert choice.chosen.tokens_per_s > 2 * choice.sync.tokens_per_s
    assert "H=500" in choice.why and "your call" in choice.why
    # smallest H among the runnable options that hide (fp32 and bf16: int8 is chosen only where pinned)
    hiding = [o for o in choice.options if o.hidden and o.precision in ("fp32", "bf16")]
    assert best.islands.inner_steps == min(o.inner_steps for o in hiding)
    again = Plan.from_json(json.dumps(best.to_dict()))
    assert again.islands == best.islands and again.island_plan().train.global_batch == 64


def test_planner_keeps_sync_where_the_link_is_fast_enough():
    fast = dataclasses.replace(load_cluster(REGION), islands=Islands(count=2, link=LinkSpec(latency_s=1e-5,
                                                                                        bandwidth=2e12)))
    choice = plan_islands(load_model("llama3-8b"), fast, load_train(global_batch=256, seq_len=4096), top=1)
    assert choice.chosen.method == "sync" and choice.plans[0].islands.method == "sync"


def test_pinned_h_is_priced_as_given():
    cluster = load_cluster(LOCAL)
    choice = plan_islands(load_model("tiny-gpt"), cluster, load_train(global_batch=8, seq_len=128, precision="fp32"),
                          top=1, island_pins=IslandPins(method="diloco", inner_steps=8, fragments=2, precision="bf16"))
    islands = choice.plans[0].islands
    assert (islands.inner_steps, islands.fragments, islands.precision) == (8, 2, "bf16")


def test_failures_priced_young_interval_and_replica_groups():
    cluster = load_cluster(REGION)  # 2000 h per node, 16 nodes
    one_job = price_failures(cluster, 1000.0)
    mtbf = 2000 * 3600 / 16
    assert one_job.mtbf_s == pytest.approx(mtbf)
    assert one_job.checkpoint_interval_s == pytest.approx(young_interval(one_job.checkpoint_interval_s ** 2 /
                                                                         (2 * mtbf), mtbf))
    assert one_job.per_failure_s == pytest.approx(one_job.checkpoint_interval_s / 2 + MEASURED_RESTART_S)
    groups = price_failures(cluster, 1000.0, replica_groups=2, lost_work_s=10.0)
    assert groups.per_failure_s < one_job.per_failure_s and groups.goodput_tokens_per_s > one_job.goodput_tokens_per_s
    assert price_failures(load_cluster("local-cpu"), 1000.0) is None


def test_island_plan_refuses_bad_fields():
    with pytest.raises(ValueError, match="inner_steps=0"):
        IslandPlan(count=2, inner_steps=0)
    with pytest.raises(ValueError, match="multiple of fragments"):
        IslandPlan(count=2, inner_steps=6, fragments=4)
    with pytest.raises(ValueError, match="sync"):
        IslandPlan(count=2, method="sync", inner_steps=10)


BASE = ["plan", "--model", "tiny-gpt", "--global-batch", "8", "--seq-len", "128"]


@pytest.mark.parametrize("extra, says", [
    (["--cluster", str(LOCAL), "--inner-steps", "0"], "H=0"),
    (["--cluster", str(LOCAL), "--fragments", "9"], "more than the"),
    (["--cluster", "local-cpu", "--inner-steps", "4"], "has none"),
])
def test_bad_island_pins_are_one_line_and_exit_2(extra, says, capsys):
    assert cli(BASE + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_a_slow_link_faster_than_the_fast_one_is_refused(tmp_path, capsys):
    text = LOCAL.read_text().replace("bandwidth: 50 MB/s", "bandwidth: 400 GB/s")
    path = tmp_path / "fast.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="faster than the links inside an island"):
        load_cluster(path)
    assert cli(BASE + ["--cluster", str(path)]) == 2
    assert "the link between islands is the slow one" in capsys.readouterr().err


def test_plan_cli_prints_the_choice_beside_sync(tmp_path, capsys):
    out = tmp_path / "plans.json"
    assert cli(BASE + ["--cluster", str(LOCAL), "--top", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "islands of 2 devices talk" in printed and "sync" in printed and "chosen:" in printed
    assert "failures priced" in printed
    plan = Plan.from_json(out)
    assert plan.islands is not None and plan.num_devices == 4
    options = json.loads(out.read_text())["islands"]["options"]
    assert {"sync", plan.islands.exchange()} <= {o["exchange"] for o in options}
    assert math.isfinite(plan.predicted.goodput_tokens_per_s) and plan.predicted.goodput_tokens_per_s > 0


def test_replica_groups_of_a_failing_cluster_rank_by_goodput():
    from plait.search.islands import replica_group_choice

    cluster = dataclasses.replace(load_cluster("h100-80g"), num_devices=64,
                                  failures=load_cluster(REGION).failures)
    rows = replica_group_choice(load_model("llama3-8b"), cluster, load_train(global_batch=128, seq_len=4096), 64)
    assert [r.failure.goodput_tokens_per_s for r in rows] == sorted((r.failure.goodput_tokens_per_s for r in rows),
                                                                    reverse=True)
    one_job = next(r for r in rows if r.count == 1)
    groups = [r for r in rows if r.count > 1]
    assert groups and all(r.failure.per_failure_s < one_job.failure.per_failure_s for r in groups)
    assert {r.count * r.group_devices for r in rows} == {64}


def test_fragments_are_runs_of_whole_blocks():
    import torch

    from plait.errors import PlaitError
    from plait.train.islands import fragment_modules

    names = ["tok_embeddings.weight", "layers.0.a", "layers.0.b", "layers.1.a", "layers.2.a", "layers.3.a",
             "norm.weight", "output.weight"]
    named = [(n, torch.nn.Parameter(torch.zeros(1))) for n in names]
    first, second = fragment_modules(named, 2)
    held = [{id(p) for p in f.parameters()} for f in (first, second)]
    by_name = dict(named)
    assert held[0] == {id(by_name[n]) for n in names[:4]} and held[1] == {id(by_name[n]) for n in names[4:]}
    with pytest.raises(PlaitError, match="more than the 4 blocks"):
        fragment_modules(named, 5)


def test_what_the_island_runtime_cannot_run_is_refused_before_ranks_start():
    from plait.train.config import load_config
    from plait.train.island_loop import check_island_plan, with_config_h

    choice = plan_islands(load_model("tiny-gpt"), load_cluster(LOCAL),
                          load_train(global_batch=8, seq_len=128, precision="fp32"), top=1,
                          island_pins=IslandPins(method="diloco", inner_steps=4, precision="int8"))
    with pytest.raises(ConfigError, match="int8"):
        check_island_plan(choice.plans[0])
    config = load_config(None, ["islands.inner_steps=6"])
    assert with_config_h(choice.plans[0], config).islands.inner_steps == 6
    with pytest.raises(ConfigError, match="inner_steps=3"):
        with_config_h(choice.plans[0].replace(islands=dataclasses.replace(choice.plans[0].islands, fragments=2)),
                      load_config(None, ["islands.inner_steps=3"]))


@pytest.mark.parametrize("extra, says", [
    (["--set", "islands.lighthouse=localhost:1"], "islands.lighthouse='localhost:1': no lighthouse answers there"),
    (["--resume", "--set", "checkpoint.dir=\"{tmp}/ckpt\""], "cannot resume"),
])
def test_island_runs_refuse_bad_input_in_one_line_before_any_rank_starts(tmp_path, capsys, extra, says):
    choice = plan_islands(load_model("tiny-gpt"), load_cluster(LOCAL),
                          load_train(global_batch=8, seq_len=64, precision="fp32"), top=1)
    plan = tmp_path / "plan.json"
    plan.write_text(choice.plans[0].to_json())
    (tmp_path / "run.toml").write_text("[data]\nsource = \"shipped\"\n")
    code = cli(["train", str(tmp_path / "run.toml"), "--plan", str(plan), "--log-dir", str(tmp_path / "log"),
                "--set", "train.global_batch=8", "--set", "train.seq_len=64",
                *[item.format(tmp=tmp_path) for item in extra]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert says in err[0]
    assert not (tmp_path / "log" / "island0").exists()  # nothing started


def test_a_plan_across_islands_needs_a_cluster_with_them():
    choice = plan_islands(load_model("tiny-gpt"), load_cluster(LOCAL),
                          load_train(global_batch=8, seq_len=64, precision="fp32"), top=1)
    data = choice.plans[0].to_dict()
    data["cluster"] = "local-cpu"
    with pytest.raises(ConfigError, match="has no islands"):
        Plan.from_dict(data)


def test_diloco_plans_count_the_outer_state_in_memory():
    from plait.cost.islands import outer_state_bytes

    choice = plan_islands(load_model("llama3-8b"), load_cluster(WAN),
                          load_train(global_batch=256, seq_len=4096, precision="bf16"), top=3)
    for plan in choice.plans:
        inner = plan.island_plan()
        assert plan.predicted.memory_parts["outer_state"] == pytest.approx(
            outer_state_bytes(inner, plan.islands.fragments, plan.islands.overlap))
        assert plan.predicted.peak_memory_bytes <= plan.cluster.memory_bytes
        assert plan.predicted.peak_memory_bytes == pytest.approx(sum(plan.predicted.memory_parts.values()), rel=1e-6)
