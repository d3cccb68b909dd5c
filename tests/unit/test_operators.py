"""Per-operator sharding: capture, DTensor's strategies on the installed torch, costs, the solver kernel against
its slow reference, pins, and the Plan field (tier 1: no processes; DTensor's rules on a fake process group)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from plait.cli import main as cli_main
from plait.commands.operators import parse_pins
from plait.cost import comm
from plait.cost import operators as price
from plait.errors import ConfigError
from plait.operators.capture import capture
from plait.operators.strategies import strategy_oracle
from plait.plan import Plan
from plait.search import sharding
from plait.operators.planner import apply_pins, auto_plan, build_problem, plan_module, solve
from plait.spec.clusters import CLUSTER_PRESETS

CPU = CLUSTER_PRESETS["local-cpu"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "operators"


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


class Block(nn.Module):
    """An MLP block wide enough that splitting it beats replicating it on local-cpu's links."""

    def __init__(self, width: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x + self.down(torch.relu(self.up(self.norm(x))))
        return ((h - y) ** 2).mean()


def meta_block_and_batch(batch: int = 4, tokens: int = 64, width: int = 256):
    with torch.device("meta"):
        model = Block(width)
    x = torch.empty(batch, tokens, width, device="meta")
    return model, (x, torch.empty_like(x))


def test_capture_records_each_call_with_its_module_and_flops():
    model, batch = meta_block_and_batch()
    graph = capture(model, batch)
    addmm = [c for c in graph.calls if c.op is torch.ops.aten.addmm.default]
    assert [c.module for c in addmm] == ["up", "down"]
    assert addmm[0].flops == 2 * 4 * 64 * 256 * 1024  # 2·m·k·n
    up_weight = graph.params["up.weight"].value
    assert any(ref.value == up_weight for c in graph.calls for ref in c.inputs)
    assert set(graph.module_outputs) == {"norm", "up", "down"}
    assert graph.output is not None and graph.output.shape == ()


def test_dtensor_gives_megatron_strategies_for_mm_on_the_installed_torch():
    """The private propagator (plait/operators/strategies.py) answers as the solver expects: replicated first,
    column-parallel (R, S1) -> S1 and row-parallel (S1, S0) -> P among the rest."""
    model, batch = meta_block_and_batch(batch=2, tokens=4, width=8)
    graph = capture(model, batch)
    mm = next(c for c in graph.calls if c.op is torch.ops.aten.addmm.default)
    with strategy_oracle(2) as oracle:
        strategies, has_rule = oracle.strategies(mm)
    assert not torch.distributed.is_initialized()  # planning leaves no process group behind
    pairs = {(s.inputs, s.outputs) for s in strategies}
    assert has_rule and strategies[0].inputs == ("R", "R", "R")
    assert (("S0", "R", "S1"), ("S1",)) in pairs      # bias, input, weight.t(): column parallel
    assert (("P", "S1", "S0"), ("P",)) in pairs       # row parallel: a pending sum


def random_problem(rng, nodes: int, strategies: int = 3, memory: bool = False) -> sharding.ShardingProblem:
    costs = [rng.uniform(0, 1, rng.integers(1, strategies + 1)) for _ in range(nodes)]
    edges = [(u, v, rng.uniform(0, 1, (len(costs[u]), len(costs[v]))))
             for u, v in itertools.combinations(range(nodes), 2) if rng.uniform() < 0.5]
    mem = [rng.uniform(0, 1, len(c)) for c in costs] if memory else None
    limit = 0.6 * sum(m.max() for m in mem) if memory else math.inf
    return sharding.ShardingProblem(costs, edges, mem, limit)


@pytest.mark.parametrize("seed", range(12))
def test_program_matches_the_brute_force_reference(seed):
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, nodes=6, memory=seed % 2 == 1)
    try:
        reference = sharding.solve_brute_force(problem)
    except sharding.Infeasible:
        with pytest.raises(sharding.Infeasible):
            sharding.solve_program(problem)
        return
    program = sharding.solve_program(problem)
    assert program.cost == pytest.approx(reference.cost, rel=1e-6, abs=1e-9)
    assert sharding.total_memory(problem, program.choice) <= problem.memory_limit + 1e-9
    heuristic = sharding.solve_propagation(problem)
    assert heuristic.cost >= program.cost - 1e-9
    assert heuristic.cost == pytest.approx(sharding.total_cost(problem, heuristic.choice))


def test_window_moves_make_a_joint_move_no_pair_of_nodes_can():
    """A chain of 8 nodes where every node is cheaper on strategy 1 but any boundary between the two strategies costs
    more than two nodes save: from all-0, single and pair moves stay put; re-solving a window of the whole chain
    moves all of it (the shape of an attention block moving onto heads)."""
    costs = [np.array([1.0, 0.5]) for _ in range(8)]
    mismatch = np.array([[0.0, 2.0], [2.0, 0.0]])
    problem = sharding.ShardingProblem(costs, [(i, i + 1, mismatch) for i in range(7)])
    neighbours, masked = sharding._adjacency(problem)
    stuck = sharding._improve_pairs(problem, masked, neighbours, [0] * 8, sweeps=8)
    assert stuck == [0] * 8
    assert sharding._improve_windows(problem, [0] * 8, size=8) == [1] * 8
    assert sharding.solve_propagation(problem).cost == pytest.approx(4.0)


def test_simplify_keeps_the_total_exact():
    rng = np.random.default_rng(7)
    problem = random_problem(rng, nodes=7)
    problem.allowed[2] = np.eye(len(problem.node_cost[2]), dtype=bool)[0]  # node 2 pinned
    small, forced = sharding.simplify(problem)
    assert forced[2] == 0 and small.num_nodes < problem.num_nodes
    for choice in itertools.islice(itertools.product(*[range(len(c)) for c in small.node_cost]), 50):
        full = sharding._expand(problem, small, forced, choice)
        assert sharding.total_cost(small, choice) + small.offset == pytest.approx(sharding.total_cost(problem, full))


def test_solver_picks_megatrons_pattern_for_a_wide_mlp():
    model, batch = meta_block_and_batch()
    plan = plan_module(model, batch, batch_source="x:y", tp=2, dp=1, cluster=CPU)
    assert plan.params["up.weight"] == "S0" and plan.params["down.weight"] == "S1"   # column, then row
    assert plan.comm_counts == {"all_reduce": 2}                                       # one forward, one backward
    assert plan.step_time_s < plan.data_parallel_step_time_s
    heuristic = plan_module(model, batch, batch_source="x:y", tp=2, dp=1, cluster=CPU, solver="propagation")
    assert heuristic.step_time_s <= plan.step_time_s * 1.05


class ThreeReaders(nn.Module):
    """One normalised input read by three column-split projections (attention's q, k and v), summed by one row-split
    projection."""

    def __init__(self, width: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return ((x + self.out(self.q(h) * self.k(h) + self.v(h)) - y) ** 2).mean()


def test_the_gradient_of_a_value_three_split_readers_share_is_all_reduced_once():
    """Autograd adds the three Partial gradients of the replicated input before DTensor reduces them: one backward
    all-reduce for the value, not one per reading projection (price.joins_gradient_sum), in the plan's cost and its
    counts; the count is the one the executor's run makes (the examples' ViT, benchmarks/per_operator.py)."""
    with torch.device("meta"):
        model = ThreeReaders()
    x = torch.empty(4, 64, 256, device="meta")
    pins = {"q.weight": "S0", "k.weight": "S0", "v.weight": "S0", "out.weight": "S1"}
    plan = plan_module(model, (x, torch.empty_like(x)), batch_source="x:y", tp=2, dp=1, cluster=CPU, pins=pins)
    assert plan.comm_counts == {"all_reduce": 2}          # out's forward all-reduce, the input's gradient once
    built = build_problem(capture(model, (x, torch.empty_like(x))), 2, 1, CPU)
    apply_pins(built, pins)
    separate = list(solve(built).choice)
    summed = separate.copy()
    for node in built.gradient_sums.values():
        separate[node] = 0
    one_all_reduce = price.redistribution("P", "R", x.numel() * 4, comm.Group(2, 1), CPU).seconds
    assert sharding.total_cost(built.problem, tuple(separate)) - sharding.total_cost(built.problem, tuple(summed)) \
        == pytest.approx(2 * one_all_reduce)


def test_pins_are_honoured_and_impossible_ones_refused():
    model, batch = meta_block_and_batch()
    pinned = plan_module(model, batch, batch_source="x:y", tp=2, dp=1, cluster=CPU, pins={"up.weight": "R"})
    assert pinned.params["up.weight"] == "R" and pinned.pins == {"up.weight": "R"}
    with pytest.raises(ConfigError, match="pin 'up.weight' = 'S2'"):
        plan_module(model, batch, batch_source="x:y", tp=2, dp=1, cluster=CPU, pins={"up.weight": "S2"})
    with pytest.raises(ConfigError, match="pin 'nope'"):
        plan_module(model, batch, batch_source="x:y", tp=2, dp=1, cluster=CPU, pins={"nope": "R"})
    with pytest.raises(ConfigError, match="'up.weight' is given twice"):
        parse_pins(["up.weight=S0", "up.weight=S1"])


def test_contradictory_pin_exits_2_with_one_line(capsys):
    code = cli_main(["plan", "--model", "module:mlp:build", "--batch", "mlp:batch", "--cluster", "local-cpu",
                     "--devices", "2", "--tp", "2", "--global-batch", "4", "--seq-len", "1",
                     "--pin", "ups.0.weight=S0", "--pin", "ups.0.weight=S1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "ups.0.weight" in err[0]


def test_plan_json_round_trips_the_per_operator_placements():
    plan = auto_plan("mlp:build", "mlp:batch", CPU, global_batch=4, dp=1, tp=2, pins={"ups.0.weight": "S0"})
    back = Plan.from_json(plan.to_json())
    assert back.operators == plan.operators and back.operators.params["ups.0.weight"] == "S0"
    assert back.operators.costliest and back.operators.batch == "mlp:batch"


def test_a_table_bigger_than_the_budget_is_split_and_a_pin_that_keeps_it_whole_is_refused():
    import dlrm

    budget = 10 * 2**20
    table_state = 4 * dlrm.ROWS * dlrm.DIM * 4   # weights, gradients, AdamW's two moments, fp32
    assert table_state >= 1.5 * budget
    plan = auto_plan("dlrm:build", "dlrm:batch", CPU, global_batch=8, tp=2, memory_limit=budget)
    assert plan.operators.params["table.weight"] in ("S0", "S1")
    assert plan.operators.peak_memory_bytes <= budget
    assert not plan.operators.replicated_ops  # index.Tensor's list of indices asked as DTensor's dispatch asks it
    with pytest.raises(ConfigError, match="no placement fits .* with pins"):
        auto_plan("dlrm:build", "dlrm:batch", CPU, global_batch=8, tp=2, memory_limit=budget,
                  pins={"table.weight": "R"})


def test_batch_norm_under_data_parallelism_is_synchronised_over_dp():
    """The plan says which BatchNorms sum their statistics over the dp ranks: all of them under dp > 1, none when
    the tp ranks alone split the work (they see the whole micro-batch)."""
    names = ("bn", "blocks.0.bn1", "blocks.0.bn2", "blocks.1.bn1", "blocks.1.bn2")
    planned = auto_plan("resnet:build", "resnet:batch", CPU, global_batch=8, dp=2, tp=1)
    assert planned.operators.synchronised_norms == names
    assert auto_plan("resnet:build", "resnet:batch", CPU, global_batch=8, tp=2).operators.synchronised_norms == ()


def test_an_operator_without_a_dtensor_rule_is_named_and_priced_replicated():
    class Renorm(nn.Module):  # aten.renorm has no DTensor rule in torch 2.13
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.renorm(self.fc(x), 2, 0, 1.0).sum()
    with torch.device("meta"):
        model = Renorm()
    plan = plan_module(model, (torch.empty(4, 8, device="meta"),), batch_source="x:y", tp=2, dp=1, cluster=CPU)
    (name,) = plan.replicated_ops
    assert "renorm" in name and any(c.name == name and c.placements == "R -> R" for c in plan.costliest)


def test_plan_command_shows_the_costliest_operators_and_writes_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = cli_main(["plan", "--model", "module:mlp:build", "--batch", "mlp:batch", "--cluster", "local-cpu",
                     "--devices", "2", "--tp", "2", "--global-batch", "4", "--seq-len", "1",
                     "--pin", "ups.0.weight=S0", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "costliest operators" in printed and "ups.0.weight" in printed
    assert Plan.from_json(out).operators.params["ups.0.weight"] == "S0"
    code = cli_main(["check", "--plan", str(out), "--dry-run"])  # its first step, built and run here
    assert code == 0 and "BUILDS" in capsys.readouterr().out


def test_a_view_that_would_leave_a_strided_shard_is_not_offered():
    """Flattening [b, t, d] to [b*t, d] with t split leaves torch's _StridedShard, which is neither a shard nor
    replicated: read as replicated it priced a gather the run then made unpriced (the Mixer's patches)."""
    class Flatten(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1, x.shape[-1]).sum()

    graph = capture(Flatten(), (torch.empty(8, 16, 48, device="meta"),))
    view = next(call for call in graph.calls if "view" in call.name)
    with strategy_oracle(2) as oracle:
        strategies, has_rule = oracle.strategies(view)
    reads = {s.inputs[0]: s.outputs[0] for s in strategies}
    assert has_rule and reads["S0"] == "S0" and reads["R"] == "R"
    assert "S1" not in reads
