"""The per-operator search over mesh shapes (plait.operators.search): the free search is no worse than any pinned
shape, pins of any degree hold, a budget nothing fits is refused naming what would fit, and the solver's status and
proven gap reach the plan (tier 1: no processes; DTensor's rules on a fake process group)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from plait.cli import main as cli_main
from plait.errors import ConfigError
from plait.operators.planner import auto_plan
from plait.operators.search import DegreePins, search, shapes
from plait.plan import Plan
from plait.spec.clusters import CLUSTER_PRESETS

CPU = CLUSTER_PRESETS["local-cpu"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "operators"
SEARCHED = {"mlp": (2, 4, 8), "vit": (2, 4), "mixer": (2, 4), "resnet": (2, 4, 8), "dlrm": (2, 4, 8),
            "dual_encoder": (2, 4)}
"""examples/operators's modules the free-against-pinned test plans, and on how many devices (ViT and the Mixer, whose
blocks pipeline, at 8 devices too in benchmarks/per_operator.py --search, with the zoo's U-Net, graph network and
DLRM of several tables: each new micro-batch size asks DTensor its strategies again, seconds a shape)."""
BUDGET_MIB = {"dlrm": 2.3, "dual_encoder": 40.0}
"""Budgets some shapes do not fit: the tables' (their fused SGD keeps their weights alone)."""


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _search(model: str, devices: int, **kwargs):
    budget = BUDGET_MIB.get(model)
    return search(f"{model}:build", f"{model}:batch", CPU, devices=devices, global_batch=devices,
                  memory_limit=budget * 2**20 if budget else None,
                  table_optimizer="sgd" if model in BUDGET_MIB else None, **kwargs)


@pytest.mark.parametrize("model", SEARCHED)
def test_the_free_search_is_no_worse_than_any_pinned_shape(model):
    """For world sizes 2, 4 and 8 (SEARCHED): every dp x tp x pp pinned (planned on its own as the pinned path plans it,
    auto_plan, pp micro-batches under a pipeline) is priced no lower than the free search's best, and the free search
    finds a plan whenever a pinned shape fits."""
    budget = BUDGET_MIB.get(model)
    for devices in SEARCHED[model]:
        free = _search(model, devices)
        best = free.plans[0].predicted.step_time_s
        fitted = 0
        for shape in shapes(devices, devices, 8, DegreePins()):
            if shape.num_micro_batches != shape.pp:
                continue
            try:
                pinned = auto_plan(f"{model}:build", f"{model}:batch", CPU, global_batch=devices, dp=shape.dp,
                                   tp=shape.tp, pp=shape.pp, memory_limit=budget * 2**20 if budget else None,
                                   table_optimizer="sgd" if budget else None)
            except ConfigError as e:  # no blocks to pipeline, or this mesh fits no placement
                assert any(w in str(e) for w in ("repeated blocks", "stages", "fits")), str(e)
                continue
            fitted += 1
            assert best <= pinned.predicted.step_time_s * (1 + 1e-9), (model, devices, shape)
        assert fitted >= 1 and len(free.plans) >= fitted, (model, devices)


def test_the_issue_case_fits_without_pins_where_pinned_shapes_do():
    """A two-tower model with tables of odd row counts at 40 MiB per device on 4 devices: the free search plans (it
    once said nothing fits although tp4 and dp2 x tp2 did), ranked no worse than either pinned."""
    free = _search("dual_encoder", 4)
    for dp, tp in ((1, 4), (2, 2)):
        pinned = _search("dual_encoder", 4, degrees=DegreePins(dp=dp, tp=tp))
        assert free.plans[0].predicted.step_time_s <= pinned.plans[0].predicted.step_time_s * (1 + 1e-9)
    assert all(p.predicted.peak_memory_bytes <= 40 * 2**20 for p in free.plans)
    assert any(r.needs_bytes > 40 * 2**20 for r in free.refused)  # a shape it does not fit is refused, named


def test_a_budget_nothing_fits_names_the_smallest_budget_and_device_count_that_fit():
    with pytest.raises(ConfigError) as refused:
        search("dlrm:build", "dlrm:batch", CPU, devices=2, global_batch=8, memory_limit=1.0 * 2**20,
               table_optimizer="sgd")
    message = str(refused.value)
    assert "\n" not in message and "at any of 4 shapes" in message  # dp2 at ZeRO 0, 1 and 2; dp1 x tp2
    smallest = float(message.split("the smallest budget that fits one is ")[1].split(" MiB")[0])
    assert smallest > 1.0
    devices = int(message.split(", or ")[1].split(" devices")[0])
    assert devices > 2
    # the figures are what they say: that budget fits on 2 devices, and that device count fits 1 MiB
    fits = search("dlrm:build", "dlrm:batch", CPU, devices=2, global_batch=8, memory_limit=(smallest + 0.01) * 2**20,
                  table_optimizer="sgd")
    assert fits.plans
    assert search("dlrm:build", "dlrm:batch", CPU, devices=devices, global_batch=8, memory_limit=1.0 * 2**20,
                  table_optimizer="sgd").plans


@pytest.mark.parametrize("argv, message", [
    (["--pin", "nothing.weight=S0"], "pin 'nothing.weight' names no parameter or module"),
    (["--schedule", "interleaved"], "gpipe or 1f1b"),
    (["--recompute", "selective"], "--recompute selective: a per-operator plan recomputes whole repeated blocks"),
    (["--recompute", "full", "--tp", "2"], "the module has no one list of repeated blocks to recompute"),
    (["--cp", "2"], "--cp does not apply to a per-operator plan"),
    (["--pp", "2"], "has several lists of repeated blocks"),
    (["--tp", "3"], "no dp x tp x pp of 4 devices"),
])
def test_bad_input_is_refused_in_one_line_before_planning(argv, message, capsys):
    code = cli_main(["plan", "--model", "module:mlp:build", "--batch", "mlp:batch", "--cluster", "local-cpu",
                     "--devices", "4", "--global-batch", "8", "--seq-len", "1", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err, err


def test_plan_prints_the_ranking_and_writes_plans_that_load(tmp_path, capsys):
    out = tmp_path / "plans.json"
    code = cli_main(["plan", "--model", "module:mlp:build", "--batch", "mlp:batch", "--cluster", "local-cpu",
                     "--devices", "4", "--global-batch", "8", "--seq-len", "1", "--top", "3", "--json", str(out),
                     "--report", str(tmp_path / "report")])
    text = capsys.readouterr().out
    assert code == 0 and "why #1 beats #2" in text and "#1 step" in text and "proven optimal" in text
    plans = json.loads(out.read_text())["plans"]
    assert len(plans) == 3
    loaded = [Plan.from_dict(p) for p in plans]
    steps = [p.predicted.step_time_s for p in loaded]
    assert steps == sorted(steps) and len({(p.dp, p.tp, p.pp, p.num_micro_batches) for p in loaded}) == 3
    best = loaded[0]
    assert best.operators.solver_status in ("optimal", "tied", "forced")
    assert math.isclose(sum(best.predicted.step_time_parts.values()), best.predicted.step_time_s, rel_tol=1e-9)
    assert math.isclose(sum(best.predicted.memory_parts.values()), best.predicted.peak_memory_bytes, rel_tol=1e-9)
    assert {p.name for p in (tmp_path / "report").iterdir()} >= {"candidates.png", "memory.png"}


def test_a_plan_file_written_before_the_solver_status_still_loads():
    plan = Plan.from_json((Path(__file__).resolve().parents[1] / "data" / "operator_plan_v0.json").read_text())
    assert plan.operators.solver_status == "" and plan.operators.proven_gap is None


def test_a_table_no_degree_divides_splits_by_rows_and_the_executor_moves_what_was_priced():
    """200,003 user rows over tp2 (DTensor's Shard gives rank 0 one row more): the pin the planner once refused
    holds, the memory is the larger shard's, and one forward and backward through the executor on a fake process
    group issues exactly the planned collectives (the looked-up rows, never the table)."""
    import torch
    from torch.distributed.tensor.experimental import implicit_replication

    from plait.execute.operators import apply_operator_sharding, build_module, fake_tensor_parallel_mesh, make_batch
    from plait.execute.dryrun import CollectiveCounter

    plan = auto_plan("dual_encoder:build", "dual_encoder:batch", CPU, global_batch=8, tp=2, table_optimizer="sgd",
                     pins={"user_table.weight": "S0", "item_table.weight": "S1"})
    from dual_encoder import DIM, ITEMS, USERS

    assert plan.operators.params["user_table.weight"] == "S0" and USERS % 2 == 1
    assert plan.operators.memory_parts["params"] >= (USERS + 1) // 2 * DIM * 4 + ITEMS * DIM // 2 * 4
    with fake_tensor_parallel_mesh(plan.tp) as mesh:
        model = apply_operator_sharding(build_module(plan.model.source, seed=0, dtype=torch.float32), plan, mesh)
        counter = CollectiveCounter()
        with counter:
            loss = model(*make_batch(plan.operators.batch, plan.train.global_batch, 0, 0, torch.float32))
            with implicit_replication():
                loss.backward()
    assert counter.counts == plan.operators.comm_counts and counter.nbytes == plan.operators.comm_bytes
    assert counter.nbytes < USERS * DIM * 4 / 100  # kilobytes of rows, not the 24 MiB table


def test_activations_are_what_autograd_keeps_for_the_backward():
    """Linear -> ReLU -> transpose -> Linear: the ReLU's output is kept (its backward needs it), the first linear's
    output is not (ReLU's result suffices), and the transposed view of the kept tensor costs nothing more."""
    import torch
    from torch import nn

    from plait.cost import operators as price
    from plait.operators.capture import capture

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(64, 128), nn.Linear(4, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)).transpose(1, 2)).square().mean()

    with torch.device("meta"):
        net = Net()
    graph = capture(net, (torch.empty(4, 4, 64, device="meta"),))
    by_op = {call.op.__name__.split(".")[0]: call for call in graph.calls}
    assert by_op["relu"].saved == (True,)
    assert by_op["addmm"].saved == (False,) or by_op["_unsafe_view"].saved == (False,)
    assert by_op["transpose"].saved == (False,)  # a view of the kept ReLU output
    kept = sum(price.activation_bytes(c.outputs, ["R"] * len(c.outputs), 1, c.saved) for c in graph.calls)
    every = sum(price.activation_bytes(c.outputs, ["R"] * len(c.outputs), 1) for c in graph.calls)
    relu = 4 * 4 * 128 * 4
    assert relu <= kept < every and graph.transient_bytes >= relu


def test_an_operator_whose_backward_has_no_rule_runs_replicated_both_ways():
    """The U-Net's GroupNorm and average pooling have DTensor rules forward but none for their backward kernels
    (torch 2.13): planned split, every rank died in the backward. They are planned replicated, named, and the
    executor's step on a fake process group (backward included) issues exactly the planned collectives."""
    import torch
    from torch.distributed.tensor.experimental import implicit_replication

    from plait.execute.operators import apply_operator_sharding, build_module, fake_tensor_parallel_mesh, make_batch
    from plait.execute.dryrun import CollectiveCounter
    from plait.operators.strategies import missing_backward_rules

    assert missing_backward_rules(torch.ops.aten.avg_pool2d.default)
    assert not missing_backward_rules(torch.ops.aten.convolution.default)
    plan = auto_plan("unet:build", "unet:batch", CPU, global_batch=8, tp=2)
    replicated = {name.split(":")[1].split("#")[0] for name in plan.operators.replicated_ops}
    assert {"native_group_norm.default", "avg_pool2d.default"} <= replicated
    with fake_tensor_parallel_mesh(plan.tp) as mesh:
        model = apply_operator_sharding(build_module(plan.model.source, seed=0, dtype=torch.float32), plan, mesh)
        counter = CollectiveCounter()
        with counter:
            loss = model(*make_batch(plan.operators.batch, plan.train.global_batch, 0, 0, torch.float32))
            with implicit_replication():
                loss.backward()
    assert counter.counts == plan.operators.comm_counts and counter.nbytes == plan.operators.comm_bytes


class Logits:
    """A module whose forward returns logits, not a loss (built lazily: torch imported inside)."""

    def __new__(cls):
        from torch import nn

        class Head(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(64, 8)

            def forward(self, x, y):
                return self.fc(x)

        return Head()


def pairs(batch_size, generator):
    import torch

    return torch.randn(batch_size, 64, generator=generator), torch.randn(batch_size, 8, generator=generator)


def no_generator(batch_size):
    return pairs(batch_size, None)


@pytest.mark.parametrize("model, batch, message", [
    (f"module:{__name__}:Logits", f"{__name__}:pairs", "forward returned a tensor of shape [4, 8]"),
    ("module:mlp:build", f"{__name__}:no_generator", "must take (batch_size, generator)"),
])
def test_a_forward_without_a_loss_or_a_factory_without_a_generator_is_refused_in_one_line(model, batch, message,
                                                                                           capsys):
    code = cli_main(["plan", "--model", model, "--batch", batch, "--cluster", "local-cpu", "--devices", "2",
                     "--global-batch", "8", "--seq-len", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err, err


def test_a_stages_memory_bound_never_exceeds_what_its_solve_needs():
    """plait.operators.pipeline.stage_memory_lower_bound refuses a pipeline shape before its stages are captured;
    it must never refuse one that fits: on the Mixer at pp2 (4 micro-batches) each stage's least memory from the
    whole module's problem is at most the stage's planned peak, and a budget just above the planned peak plans."""
    import torch

    from plait.operators import pipeline, planner
    from plait.operators.stages import find_layout

    plan = auto_plan("mixer:build", "mixer:batch", CPU, global_batch=8, tp=2, pp=2, num_micro_batches=4)
    with torch.device("meta"):
        model = __import__("mixer").build()
    batch = planner.meta_batch("mixer:batch", plan.micro_batch)
    whole = planner.build_problem(planner.capture(model, batch), 2, 1, CPU, math.inf)
    settings = pipeline.PipelineSettings(2, 4)
    ranges = [plan.stage_layers(s) for s in range(2)]
    flight = pipeline._in_flight(settings, 1, 2, plan.micro_batch)
    stage, needs = pipeline.stage_memory_lower_bound(whole, find_layout(model, batch), ranges, flight)
    assert 0 < needs <= plan.operators.stages[stage].peak_memory_bytes
    fits = auto_plan("mixer:build", "mixer:batch", CPU, global_batch=8, tp=2, pp=2, num_micro_batches=4,
                     memory_limit=plan.predicted.peak_memory_bytes * 1.001)
    assert fits.predicted.peak_memory_bytes <= plan.predicted.peak_memory_bytes * 1.001


def test_zero_stages_are_priced_as_their_carriers_hold_and_move_the_weights():
    """Per parameter, what each ZeRO stage's carrier holds (plait.cost.memory.state_bytes, the decoder path's owner)
    and moves: one replica 4 copies (weights, gradients, AdamW's two moments); DDP 5 (its gradient buckets);
    ZeRO-1 shards the moments; fully_shard on one unit keeps the gathered weights and the whole gradients beside
    its shards (2 + 4 / dp); ZeRO-3 holds a block's gathered weights and gradients two blocks at a time. DDP
    all-reduces, ZeRO-1 gathers the updated shards too, ZeRO-3 gathers a block's weights again in the backward."""
    from plait.cost import comm
    from plait.cost import operators as price

    carries = {zero: price.data_parallel_carry(4, 1, zero, CPU, blocks="layers", num_blocks=8) for zero in range(4)}
    assert price.data_parallel_carry(1, 1, 0, CPU).copies("fc.weight") == 4
    assert [carries[z].copies("head.weight") for z in range(4)] == [5, 3 + 2 / 4, 2 + 4 / 4, 2 + 4 / 4]
    assert carries[3].copies("layers.1.weight") == 4 / 4 + 2 * 2 / 8  # shards, and 2 of 8 blocks gathered, grads whole
    group, megabyte = comm.Group(4, 1), 2.0**20
    sync = {z: carries[z].sync_time(megabyte, "layers.1.weight", CPU, group) for z in range(4)}
    assert sync[0] < sync[1] and sync[2] < sync[3]
    assert carries[3].sync_time(megabyte, "head.weight", CPU, group) == sync[2]  # the root unit: gathered once


def test_micro_batches_accumulate_without_a_pipeline_where_one_does_not_fit():
    """Without a pipeline, a step of one micro-batch per data-parallel rank that does not fit the budget is split
    into the fewest micro-batches that do (gradients accumulated); pinned, the count holds. The graph network at
    dp2 and ZeRO-2 over 16 samples: 7.3 MiB in one micro-batch, 5.0 in two, 3.9 in four."""
    pins = DegreePins(dp=2, zero=2, recompute="none")
    whole = search("gnn:build", "gnn:batch", CPU, devices=2, global_batch=16, degrees=pins).plans[0]
    four = search("gnn:build", "gnn:batch", CPU, devices=2, global_batch=16,
                  degrees=dataclasses.replace(pins, micro_batch=2)).plans[0]
    assert (whole.num_micro_batches, four.num_micro_batches, four.micro_batch) == (1, 4, 2)
    assert four.predicted.peak_memory_bytes < whole.predicted.peak_memory_bytes
    budget = four.predicted.peak_memory_bytes + 0.01 * 2**20
    found = search("gnn:build", "gnn:batch", CPU, devices=2, global_batch=16, degrees=pins, memory_limit=budget)
    assert [p.num_micro_batches for p in found.plans] == [4]
    assert found.plans[0].predicted.peak_memory_bytes == four.predicted.peak_memory_bytes


def test_recompute_holds_the_blocks_inputs_and_pays_their_forward_again():
    """Recompute full of the graph network's layers: less activation memory (each layer's input and one layer's
    activations instead of every layer's), more compute (the layers' forward again: at most a third of the step's
    compute, which counts forward and backward); at tp2 the redistributions into the layers are paid again; under a
    pipeline it is refused, named."""
    none, full = (search("gnn:build", "gnn:batch", CPU, devices=2, global_batch=8,
                         degrees=DegreePins(dp=2, zero=2, recompute=mode)).plans[0] for mode in ("none", "full"))
    assert (none.recompute, full.recompute) == (("none",), ("full",))
    assert full.predicted.memory_parts["activations"] < none.predicted.memory_parts["activations"]
    extra = full.operators.time_parts["compute"] - none.operators.time_parts["compute"]
    assert 0 < extra < none.operators.time_parts["compute"] / 3
    split = [search("gnn:build", "gnn:batch", CPU, devices=2, global_batch=8, degrees=DegreePins(tp=2, recompute=mode),
                    pins={"layers.1.message.weight": "S0"}).plans[0].operators.time_parts for mode in ("none", "full")]
    assert split[1]["tp_comm"] > split[0]["tp_comm"]
    with pytest.raises(ConfigError, match="per-operator recomputation runs without a pipeline"):
        search("gnn:build", "gnn:batch", CPU, devices=2, global_batch=8, degrees=DegreePins(pp=2, recompute="full"))


def test_a_zero_pin_a_pipeline_does_not_run_is_refused_named():
    """A per-operator pipeline's stages carry dp on fully_shard kept gathered (planner.zero_stage): a ZeRO pin
    asking it for another stage is refused for that shape with the reason, not written into a plan that runs
    something else; the stage it runs is accepted."""
    with pytest.raises(ConfigError, match="a per-operator pipeline's stages run ZeRO-3 over dp 2"):
        search("gnn:build", "gnn:batch", CPU, devices=4, global_batch=8, degrees=DegreePins(dp=2, pp=2, zero=1))
    plan = search("gnn:build", "gnn:batch", CPU, devices=4, global_batch=8,
                  degrees=DegreePins(dp=2, pp=2, zero=3)).plans[0]
    assert (plan.dp, plan.pp, plan.zero) == (2, 2, 3)
