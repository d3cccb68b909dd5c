"""The per-operator executor runs what the plan priced: the collectives one forward and backward issue on a fake
process group (no processes) are the plan's, byte for byte, where eager DTensor left to itself picks others
(tier 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.execute.operators import step_collectives
from plait.operators.planner import auto_plan
from plait.spec.clusters import CLUSTER_PRESETS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "operators"


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_executor_issues_exactly_the_planned_collectives_for_a_split_table():
    """DLRM with its table split by columns: the plan gathers the lookup before the feature interaction (4 KiB,
    one all-gather). Left at module boundaries, eager DTensor kept the lookup split into the interaction and
    all-reduced a pending sum instead (-42% against the plan); each torch-level call's arguments redistributed to
    the planned placements make it the plan's."""
    plan = auto_plan("dlrm:build", "dlrm:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8, tp=2,
                     memory_limit=10 * 2**20)
    assert plan.operators.params["table.weight"] != "R" and plan.operators.function_reads
    nbytes, counts, _ = step_collectives(plan)
    assert nbytes == plan.operators.comm_bytes > 0
    assert counts == plan.operators.comm_counts


def test_executor_issues_the_planned_backward_collectives_of_a_batch_split_cnn():
    """ResNet at tp2: convolutions split by batch with their weights kept split and gathered for use; the planned
    all-gathers of activations into BatchNorm, the weights' gathers and their gradients' reduce-scatters, and no
    others (eager DTensor alone gathered the residual too: +44%)."""
    plan = auto_plan("resnet:build", "resnet:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8, tp=2)
    nbytes, counts, _ = step_collectives(plan)
    assert counts == plan.operators.comm_counts and nbytes == plan.operators.comm_bytes


@pytest.mark.parametrize("model, tp", [("llama", 2), ("hf_llama", 4)])
def test_a_decoders_backward_reduces_where_the_plan_prices_and_gathers_no_weight(model, tp):
    """Megatron's pattern on both Llamas: the norm's output, replicated, is read as it is by the column-split q/k/v
    (w1/w3) and each returns a Partial gradient. Summed at the value and all-reduced there once (the plan's
    gradient-sum node), the residual stream's gradient reaches the row-split wo/w2 replicated; left pending, it
    reached their matmul backward as Partial, which DTensor has no Partial x Shard rule for, so it all-gathered
    each row-split weight (reference Llama tp2: 2432 KiB = 6 all_reduce + 7 all_gather + 2 reduce_scatter against
    the plan's 1280 KiB = 9 all_reduce + 1 all_gather). A weight gather coming back adds all-gathers here."""
    plan = auto_plan(f"decoders:{model}", "decoders:tokens", CLUSTER_PRESETS["local-cpu"], global_batch=4, tp=tp)
    assert plan.operators.params["model.model.layers.0.mlp.down_proj.weight" if model == "hf_llama"
                                 else "model.layers.0.feed_forward.w2.weight"] == "S1"
    nbytes, counts, _ = step_collectives(plan)
    assert counts == plan.operators.comm_counts and nbytes == plan.operators.comm_bytes
    assert counts.get("all_gather", 0) <= 1  # the one gather is not a weight's: none of the 4 row-split weights


def test_readers_partial_gradients_are_summed_then_reduced_once():
    """A replicated value read by three column-split linears (q, k, v): autograd adds the three Partial gradients
    on the value and one all-reduce turns the sum Replicate, not three, and the value's producer (here the batch)
    receives it Replicate. The fake group moves no data: counts and placements, not values."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plait.execute.operators import PlannedReads
    from plait.execute.dryrun import CollectiveCounter

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        split = [distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]) for _ in range(3)]
        x = DTensor.from_local(torch.randn(3, 4), mesh, [Replicate()], run_check=False).requires_grad_()
        seen = []
        x.register_hook(lambda grad: seen.append(grad.placements) or grad)
        counter = CollectiveCounter()
        with counter:
            with PlannedReads(mesh, {}):  # no planned reads: the forward's values as DTensor leaves them
                normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))  # the norm, as the decoders' blocks
                q, k, v = (F.linear(normed, w) for w in split)  # [3, 8] each, split by columns
            (q * k * v).to_local().sum().backward()  # a loss of the local shard: its backward issues nothing
    finally:
        dist.destroy_process_group()
    assert counter.counts == {"all_reduce": 1}  # the three readers' gradients summed, then one all-reduce
    assert seen == [(Replicate(),)]


def test_a_fused_table_is_priced_as_its_weights_alone_and_fits_at_five_times_a_ranks_budget():
    """The 4 MiB table on 8 ranks under 0.75 MiB each: with AdamW (weights, gradient, two moments) no placement
    fits; with the fused row-wise SGD a rank holds an eighth of the weights and nothing else for the table."""
    from plait.errors import ConfigError

    cluster, limit = CLUSTER_PRESETS["local-cpu"], 0.75 * 2**20
    with pytest.raises(ConfigError, match="no placement fits 0.75 MiB per device.*--table-optimizer sgd"):
        auto_plan("dlrm:build", "dlrm:batch", cluster, global_batch=8, tp=8, memory_limit=limit)
    plan = auto_plan("dlrm:build", "dlrm:batch", cluster, global_batch=8, tp=8, memory_limit=limit,
                     table_optimizer="sgd")
    table = 32768 * 32 * 4
    assert plan.operators.fused_tables == {"table.weight": "sgd"} and plan.operators.params["table.weight"] != "R"
    assert table / 8 < plan.operators.peak_memory_bytes <= limit < table / 5


def test_the_fused_lookup_updates_rows_as_dense_sgd_does():
    """One process: the fused lookup's in-place row update (duplicate ids included) equals autograd's dense
    gradient of nn.Embedding followed by SGD; the table keeps no gradient."""
    import torch

    from plait.execute.embedding_tables import FusedTables

    torch.manual_seed(0)
    dense, fused = torch.nn.Embedding(50, 6).double(), torch.nn.Embedding(50, 6).double()
    fused.load_state_dict(dense.state_dict())
    before = dense.weight.detach().clone()
    FusedTables(lr=0.1).apply(torch.nn.ModuleDict({"t": fused}), {"t.weight": "sgd"})
    ids = torch.tensor([[1, 7, 7], [3, 1, 49]])
    target = torch.randn(2, 3, 6, dtype=torch.float64)
    ((dense(ids) - target) ** 2).sum().backward()
    ((fused(ids) - target) ** 2).sum().backward()
    torch.optim.SGD(dense.parameters(), lr=0.1).step()
    assert fused.weight.grad is None
    assert torch.allclose(fused.weight, dense.weight, rtol=0, atol=1e-12)
    moved = (fused.weight.detach() != before).any(dim=1)
    assert moved[[1, 3, 7, 49]].all() and moved.sum() == 4  # the looked-up rows, and only they


@pytest.mark.parametrize("settings, message", [
    (['data.batch="dlrm:batch"'], "set model.module"),
    (['data.batch="dlrm:batch"', 'model.module="dlrm:build"', "plan.pins={cp=2}"],
     "plan.pins key 'cp' does not apply to a per-operator run"),
    (['data.batch="dlrm:batch"', 'model.module="dlrm:build"', "plan.pins={tp=3}"], "tp = 3 must be a whole number"),
    (['data.batch="dlrm:batch"', 'model.module="dlrm:build"', "plan.pins={pp=2}"], "has no repeated blocks"),
])
def test_plait_train_refuses_a_bad_per_operator_config_in_one_line(tmp_path, capsys, settings, message):
    from plait.cli import main as cli_main

    config = tmp_path / "run.toml"
    config.write_text("")
    argv = ["train", str(config), "--set", f'log.dir="{tmp_path}"']
    for item in settings:
        argv += ["--set", item]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_pending_sum_read_into_split_work_has_its_gradient_reduced_where_the_plan_prices(monkeypatch):
    """Blocks that read their input straight into a column-split linear (tests/split_readers.py, Megatron's pattern
    pinned), pp2 x tp2, each stage built as its pipeline rank builds it. On the first stage the first block's
    row-split output, a pending sum, is all-reduced for the second block's first linear, whose backward returns a
    Partial gradient: the plan prices its all-reduce on that edge (3 all-reduces: 2 forward, 1 backward); DTensor's
    redistribute handed the pending sum back to the row-split linear, whose backward gathered its weight and
    reduce-scattered its gradient (2 all_reduce + 2 all_gather + 1 reduce_scatter, 6x the bytes; 5.7x at pp1). The
    second stage's first linear reads the hidden states it received: their Partial gradient is reduced once, where
    DTensor.from_local made them replicated (its backward), as that stage's plan prices."""
    from plait.execute.operators_pipeline import stage_collectives

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from split_readers import MEGATRON

    plan = auto_plan("split_readers:build", "split_readers:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8,
                     tp=2, pp=2, pins=MEGATRON)
    assert [stage.comm_counts for stage in plan.operators.stages] == [{"all_reduce": 3}, {"all_reduce": 4}]
    for (nbytes, counts, _), stage in zip(stage_collectives(plan), plan.operators.stages):
        assert counts == stage.comm_counts and nbytes == stage.comm_bytes


def test_the_fake_tensor_parallel_mesh_leaves_no_process_group_behind():
    """step_collectives and stage_collectives count on one fake mesh of 1 x tp ranks; it is gone after the block, an
    error inside included (a group left behind would make the next count's init_process_group fail)."""
    import torch.distributed as dist

    from plait.execute.operators import fake_tensor_parallel_mesh

    with pytest.raises(RuntimeError, match="inside"):
        with fake_tensor_parallel_mesh(4) as mesh:
            assert mesh.mesh_dim_names == ("dp", "tp") and mesh["tp"].size() == 4 and dist.get_world_size() == 4
            raise RuntimeError("inside")
    assert not dist.is_initialized()
