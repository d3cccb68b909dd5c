"""Per-operator plans under a pipeline (tier 1: no processes): the stages a loss-returning module is cut into
compute what the whole module does, the plan carries each stage's placements and the pipeline's price from the
cost model, and what cannot be cut is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from plait.cost import operators as price
from plait.cost.schedule import bubble_closed_form
from plait.errors import ConfigError
from plait.operators.planner import auto_plan
from plait.operators.stages import build_stage, find_layout
from plait.plan import Plan
from plait.spec.clusters import CLUSTER_PRESETS

CPU = CLUSTER_PRESETS["local-cpu"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "operators"


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _example(name: str):
    import importlib

    module, _, factory = name.partition(":")
    return getattr(importlib.import_module(module), factory)


@pytest.mark.parametrize("model, batch, blocks, pre, post", [
    ("decoders:llama", "decoders:tokens", "model.layers", ("model.tok_embeddings",), ("model.norm", "model.output")),
    ("decoders:hf_llama", "decoders:tokens", "model.model.layers", ("model.model.embed_tokens",),
     ("model.lm_head", "model.model.norm")),
    ("vit:build", "vit:batch", "blocks", ("patch", "pos"), ("norm", "head")),
])
def test_stages_chained_compute_the_whole_module_loss_and_gradients(model, batch, blocks, pre, post):
    """Stage 0 (embedding side, block 0) then stage 1 (block 1, head and loss, the batch handed in again) give one
    process's loss and the same gradient for every parameter, each parameter held by exactly one stage."""
    build, make = _example(model), _example(batch)
    torch.manual_seed(0)
    whole = build().double()
    data = tuple(t.double() if t.is_floating_point() else t for t in make(2, torch.Generator().manual_seed(1)))
    with torch.device("meta"):
        meta = build()
    layout = find_layout(meta, tuple(t.to("meta") for t in data))
    assert (layout.blocks_path, layout.num_blocks, layout.pre, layout.post) == (blocks, 2, pre, post)
    first = build_stage(whole, layout, range(0, 1), first=True, last=False)
    last = build_stage(whole, layout, range(1, 2), first=False, last=True)
    names = [n for n, _ in first.named_parameters()] + [n for n, _ in last.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())  # each parameter on one stage
    hidden = first(*data)
    sent = hidden.detach().requires_grad_()
    loss = last(sent, **{str(i): t for i, t in enumerate(data)})
    loss.backward()
    hidden.backward(sent.grad)
    reference = whole(*data)
    reference.backward()
    assert torch.allclose(loss, reference, rtol=1e-12, atol=0)
    grads = {n: p.grad for stage in (first, last) for n, p in stage.named_parameters()}
    for name, param in whole.named_parameters():
        assert torch.allclose(grads[name], param.grad, rtol=1e-9, atol=1e-12), name


def test_a_pp2_plan_carries_each_stage_and_the_pipelines_price():
    plan = auto_plan("decoders:llama", "decoders:tokens", CPU, global_batch=8, tp=2, pp=2)
    ops = plan.operators
    assert plan.pp == 2 and plan.num_micro_batches == 2 and plan.micro_batch == 4 and plan.layers_per_stage == (1, 1)
    assert ops.blocks == "model.layers" and len(ops.stages) == 2 and "2 pipeline stages" in ops.describe()
    assert "model.tok_embeddings.weight" in ops.stages[0].params and "model.output.weight" in ops.stages[1].params
    assert all(stage.function_reads for stage in ops.stages)
    assert ops.params == {**ops.stages[0].params, **ops.stages[1].params}
    # every projection of both blocks split as Megatron's pattern (the whole module's block solution, reused)
    for layer in (0, 1):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            assert ops.params[f"model.layers.{layer}.{name}.weight"] == "S0"
        for name in ("attention.wo", "feed_forward.w2"):
            assert ops.params[f"model.layers.{layer}.{name}.weight"] == "S1"
    # the step: the stages' times on the schedule simulator, not below the slowest stage's m micro-batches
    assert ops.step_time_s >= plan.num_micro_batches * max(s.step_time_s for s in ops.stages) * 0.999
    assert 0 < plan.predicted.bubble_fraction < 0.5
    assert Plan.from_json(plan.to_json()) == plan


def test_the_pipeline_step_is_the_schedule_simulators():
    """Uniform stages on 1F1B: (m + p - 1) stage times plus the hops, the bubble its closed form."""
    step, bubble = price.pipeline_step([3.0, 3.0], [0.5, 0.25], pp=2, num_micro_batches=4, schedule="1f1b", p2p_s=0.0)
    assert step == pytest.approx((4 + 2 - 1) * 3.0 + 0.5)
    assert bubble == pytest.approx(bubble_closed_form(2, 4))
    slower, _ = price.pipeline_step([3.0, 3.0], [0.0, 0.0], pp=2, num_micro_batches=4, schedule="gpipe", p2p_s=0.1)
    assert slower > (4 + 2 - 1) * 3.0


def test_more_micro_batches_shrink_the_bubble():
    two = auto_plan("vit:build", "vit:batch", CPU, global_batch=8, tp=1, pp=2, num_micro_batches=2)
    four = auto_plan("vit:build", "vit:batch", CPU, global_batch=8, tp=1, pp=2, num_micro_batches=4)
    assert four.predicted.bubble_fraction < two.predicted.bubble_fraction
    assert four.operators.stages[0].peak_memory_bytes != two.operators.stages[0].peak_memory_bytes


class NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        return ((self.b(self.a(x)) - y) ** 2).mean()


def no_blocks() -> nn.Module:
    return NoBlocks()


def pairs(batch_size: int, generator: torch.Generator):
    return torch.randn(batch_size, 8, generator=generator), torch.randn(batch_size, 8, generator=generator)


@pytest.mark.parametrize("source, batch, kwargs, message", [
    (f"{__name__}:no_blocks", f"{__name__}:pairs", {}, "has no repeated blocks"),
    ("mlp:build", "mlp:batch", {}, "several lists of repeated blocks"),
    ("decoders:llama", "decoders:tokens", {"pp": 4}, "fewer than the plan's 4 pipeline stages"),
    ("decoders:llama", "decoders:tokens", {"schedule": "zbv"}, "gpipe or 1f1b"),
    ("decoders:llama", "decoders:tokens", {"pins": {"model.layers.0": "S1"}}, "travel replicated; pin R"),
    ("decoders:llama", "decoders:tokens", {"layers_per_stage": (2, 0)}, "at least 1 block"),
])
def test_what_a_pipeline_cannot_cut_is_refused_in_one_line(source, batch, kwargs, message):
    options = {"pp": 2, **kwargs}
    with pytest.raises(ConfigError, match=message) as refused:
        auto_plan(source, batch, CPU, global_batch=8, **options)
    assert "\n" not in str(refused.value)


def test_a_plan_whose_stages_do_not_match_pp_is_refused():
    plan = auto_plan("decoders:llama", "decoders:tokens", CPU, global_batch=8, pp=2)
    plan.operators.check_stages(2)
    import dataclasses

    broken = dataclasses.replace(plan.operators, stages=plan.operators.stages[:1])
    with pytest.raises(ConfigError, match="holds? 1 stage plans"):
        broken.check_stages(2)


@pytest.mark.parametrize("model", ["vit", "mixer"])
def test_every_stage_runs_what_it_was_priced_at_on_one_tensor_rank(model):
    """At tp1 every placement costs the same, so the whole module's block choice may read the stage's received
    (replicated) input in a placement DTensor's dispatch would postpone: such a stage is solved freely instead."""
    plan = auto_plan(f"{model}:build", f"{model}:batch", CPU, global_batch=8, tp=1, pp=2)
    assert all(stage.step_time_s < price.UNRUNNABLE_S for stage in plan.operators.stages)
    assert plan.operators.step_time_s < plan.operators.data_parallel_step_time_s * 4


def test_each_stage_runs_its_planned_reads_and_the_communication_priced():
    """The Mixer at pp2 x tp2, every stage built as its pipeline rank builds it and chained on a fake process group:
    each stage's forward meets every torch-level call its plan redistributes, and issues the collectives its plan
    priced, byte for byte."""
    from plait.execute.operators_pipeline import stage_collectives

    plan = auto_plan("mixer:build", "mixer:batch", CPU, global_batch=8, tp=2, pp=2)
    measured = stage_collectives(plan)
    assert len(measured) == 2
    for (nbytes, counts, matched), stage in zip(measured, plan.operators.stages):
        assert matched == len(stage.function_reads) > 0
        assert counts == stage.comm_counts and nbytes == pytest.approx(stage.comm_bytes)


def test_stages_on_one_tensor_rank_issue_no_collective():
    """At tp1 a stage's tensors stay plain (nothing placed, no planned reads): stage_collectives counts nothing and
    meets no planned call, as the stages were priced (the zoo's pipelined rows read it)."""
    from plait.execute.operators_pipeline import stage_collectives

    plan = auto_plan("mixer:build", "mixer:batch", CPU, global_batch=8, tp=1, pp=2)
    measured = stage_collectives(plan)
    assert [(nbytes, sum(counts.values()), matched) for nbytes, counts, matched in measured] == [(0, 0, 0)] * 2
    assert all(stage.comm_bytes == 0 for stage in plan.operators.stages)


def test_the_executor_finds_the_blocks_the_plan_cut_once_for_every_stage_and_refuses_others():
    """plait.execute.operators_pipeline.stage_layout, which a pipeline rank and the stage collectives' count both
    build their stages from: the repeated blocks and the parts around them the planner found for this module, and a
    ConfigError naming both paths for a plan whose stages cut other blocks."""
    import dataclasses

    from plait.execute.operators_pipeline import stage_layout

    plan = auto_plan("mixer:build", "mixer:batch", CPU, global_batch=8, pp=2)
    layout = stage_layout(plan)
    assert layout.blocks_path == plan.operators.blocks and layout.num_blocks == sum(plan.layers_per_stage)
    assert layout.pre and layout.post  # the patch embedding before the blocks, the head after them
    other = plan.replace(operators=dataclasses.replace(plan.operators, blocks="mixers"))
    with pytest.raises(ConfigError, match=f"cut 'mixers', the module's blocks are '{layout.blocks_path}'"):
        stage_layout(other)


def test_a_pipeline_no_placement_fits_is_refused_as_a_whole_module_is():
    """plait.operators.planner.solve_or_refuse, the one refusal both paths ask: under a budget nothing fits, pp2 is
    refused in the same line as pp1, naming the budget and the pins."""
    for pp in (1, 2):
        with pytest.raises(ConfigError, match=r"^no placement fits 0\.01 MiB per device with pins "
                                              r"\{'blocks.0.channel1.weight': 'S0'\}"):
            auto_plan("mixer:build", "mixer:batch", CPU, global_batch=8, tp=2, pp=pp, memory_limit=0.01 * 2**20,
                      pins={"blocks.0.channel1.weight": "S0"})


def test_blocks_held_in_a_module_dict_are_found_and_cut_under_their_keys():
    """A ModuleDict of identical blocks is a list of blocks too (stages._blocks, the one reading of both containers):
    found by find_blocks, and each stage keeps the blocks it holds under their keys, the others stood in for."""
    from plait.operators.stages import find_blocks

    class Keyed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.blocks = nn.ModuleDict({name: nn.Linear(8, 8) for name in ("a", "b", "c")})
            self.out = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for block in self.blocks.values():
                x = torch.relu(block(x))
            return self.out(x).square().mean()

    torch.manual_seed(0)
    model, x = Keyed().double(), torch.randn(3, 4, dtype=torch.float64)
    assert find_blocks(model) == "blocks"
    layout = find_layout(Keyed().to("meta"), (x.to("meta"),))
    first = build_stage(model, layout, range(0, 2), first=True, last=False)
    last = build_stage(model, layout, range(2, 3), first=False, last=True)
    assert [n for n, _ in first.named_parameters() if n.startswith("blocks")] == \
        ["blocks.a.weight", "blocks.a.bias", "blocks.b.weight", "blocks.b.bias"]
    assert torch.allclose(last(first(x), **{"0": x}), model(x), rtol=1e-12, atol=0)


def test_a_parameter_tied_across_stages_is_recorded_for_its_stages_to_sum():
    """An output layer sharing the embedding's weight: the first and the last stage each train a copy, and the
    layout names the tie (both names, the weight's shape), which the executor sums the copies' gradients over
    (plait.execute.module_model.TiedAcrossStages; `plait check` EQUAL: tests/dist/test_train_modules.py); untied,
    nothing is recorded."""

    class Tied(nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
            self.head = nn.Linear(16, 32, bias=False)
            if tie:
                self.head.weight = self.embed.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.blocks:
                x = torch.tanh(block(x))
            return self.head(x).logsumexp(-1).mean()

    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with torch.device("meta"):
        tied, untied = Tied(tie=True), Tied(tie=False)
    [tie] = find_layout(tied, (tokens,)).tied
    assert tie.names == ("embed.weight", "head.weight") and tie.shape == (32, 16)
    layout = find_layout(untied, (tokens,))
    assert layout.post == ("head",) and layout.tied == ()
