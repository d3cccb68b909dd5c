"""Executor tiers 1-2: the legality rules (pure) and meshes/sharding at 8-64 ranks with the `fake` backend."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plait import legality
from plait.axes import Degrees
from plait.errors import ConfigError
from plait.plan import Plan
from plait.spec import ModelSpec, TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS

SPEC = ModelSpec(arch="llama", num_layers=8, hidden_size=64, num_heads=8, num_kv_heads=4, ffn_hidden_size=128,
                 vocab_size=128, max_seq_len=64)


def plan(**kw) -> Plan:
    kw.setdefault("micro_batch", 1), kw.setdefault("num_micro_batches", 4)
    model = kw.pop("model", SPEC)
    seq = kw.pop("seq_len", 32)
    batch = kw.get("dp", 1) * kw["micro_batch"] * kw["num_micro_batches"]
    return Plan.of(model=model, train=TrainSpec(global_batch=batch, seq_len=seq, precision="fp32"),
                   cluster=CLUSTER_PRESETS["local-cpu"], **kw)


@pytest.mark.parametrize("kwargs,world,rule,message", [
    (dict(tp=8), 8, "tp-divides-num_kv_heads", "num_kv_heads=4 is not divisible by tp=8"),
    (dict(tp=3, model=SPEC.replace(num_heads=6, num_kv_heads=6, hidden_size=48)), 3, "tp-divides-ffn_hidden_size",
     "ffn_hidden_size=128 is not divisible by tp=3"),
    (dict(tp=4, sequence_parallel=True, seq_len=30), 4, "sp-divides-seq", "seq_len=30 (per context rank: 30)"),
    (dict(pp=4, interleave=3, schedule="interleaved", num_micro_batches=4), 4, "stages-fit-layers",
     "fewer than the plan's 12"),
    (dict(pp=2, schedule="1f1b", num_micro_batches=1), 2, "1f1b-needs-micro-batches", "needs num_micro_batches >= pp"),
    (dict(pp=4, layers_per_stage=(3, 0, 3, 2)), 4, "middle-stages-hold-layers", "stages [1] have no layers"),
    (dict(dp=2), 4, "world-size", "world has 4"),
    (dict(seq_len=128, model=SPEC.replace(arch="gpt")), 1, "seq-len-fits-positions", "exceeds"),
    (dict(dp=2, tp=2, data_parallel="ddp"), 4, "ddp-needs-plain-replicas", "DDP takes no DTensor"),
    (dict(ep=2, dp=2), 2, "ep-needs-experts", "needs a mixture-of-experts model"),
])
def test_refuses_plans_that_cannot_run(kwargs, world, rule, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")) as caught:
        legality.check(plan(**kwargs), world)
    assert caught.value.violations[0].rule == rule
    assert f"[rule {rule}]" in str(caught.value)


@pytest.mark.parametrize("kwargs", [
    dict(dp=2, tp=2, pp=2, sequence_parallel=True, zero=3),
    dict(pp=2, layers_per_stage=(8, 0)),  # empty end stage: it still holds norm and output
    dict(pp=4, interleave=2, schedule="interleaved", layers_per_stage=(1, 1, 1, 1, 1, 1, 1, 1)),
    dict(tp=4, sequence_parallel=True),
    dict(tp=2, model=SPEC.replace(vocab_size=127)),  # an uneven vocabulary is sharded unevenly
    dict(tp=2, pp=2, model=SPEC.replace(tied_embeddings=True)),  # tied embeddings run under every plan
])
def test_accepts_plans_that_fit(kwargs):
    p = plan(**kwargs)
    assert legality.plan_problems(p, p.num_devices) == []


def test_data_parallel_mode_is_one_rule_for_plan_and_cost_layout():

    cases = {(Degrees(dp=4), 1): ("ddp", False, 1), (Degrees(dp=4), 3): ("fully_shard", True, 3),
             (Degrees(dp=2, tp=2), 0): ("fully_shard", False, 0), (Degrees(dp=2, pp=2), 3): ("fully_shard", False, 2),
             (Degrees(tp=2), 2): ("none", False, 0)}
    for (degrees, zero), expected in cases.items():
        mode = legality.data_parallel_mode(degrees, zero)
        assert (mode.carrier, mode.reshard_after_forward, mode.held_zero) == expected
        p = plan(zero=zero, **{a: degrees[a] for a in ("dp", "tp", "pp")})
        assert p.data_parallel == mode.carrier and p.layout.dp_mode == p.dp_mode == mode


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plait.execute.mesh import forget_meshes

    def start(rank: int, world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_meshes()


@pytest.mark.parametrize("rank", [0, 23, 63])
def test_mesh_puts_tp_innermost_and_pp_outermost(fake_world, rank):
    from plait.execute.mesh import build_mesh

    fake_world(rank, 64)
    degrees = Degrees(pp=4, dp=4, tp=4)
    mesh = build_mesh(degrees, "cpu")
    assert mesh.root.mesh_dim_names == ("pp", "edp", "ep", "cp", "tp")
    coords = degrees.coordinates(rank)
    assert (mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()) == \
        (rank // 16, rank // 4 % 4, rank % 4) == (coords["pp"], coords["dp"], coords["tp"])
    # tensor-parallel peers are adjacent ranks (one node on real clusters)
    assert mesh["tp"].mesh.tolist() == [rank // 4 * 4 + i for i in range(4)]


@pytest.mark.parametrize("rank", [0, 5, 15])
def test_shards_on_meta_at_16_ranks(fake_world, rank):
    """Split -> TP/SP -> AC -> FSDP on the meta device as rank `rank` of pp2 x dp2 x tp4 sees it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from plait.execute.mesh import build_mesh
    from plait.execute.parallelize import shard_stage
    from plait.execute.pipeline import split_model
    from plait.models import adapter_for

    fake_world(rank, 16)
    p = plan(dp=2, tp=4, pp=2, sequence_parallel=True, zero=3, recompute=("full", "selective"),
             layers_per_stage=(3, 5))
    mesh = build_mesh(p.degrees, "cpu")
    pp_rank = mesh["pp"].get_local_rank()
    adapter = adapter_for(SPEC)
    stages, parts = split_model(adapter, adapter.build("meta"), p, pp_rank)
    part = shard_stage(parts[0], p, mesh, pp_rank, None)
    assert stages == [pp_rank]
    assert sorted(int(k) for k in part.layers.keys()) == list(p.stage_layers(pp_rank))
    assert (part.tok_embeddings is not None) == (pp_rank == 0)
    assert (part.output is not None) == (pp_rank == 1)
    params = dict(part.named_parameters())
    assert all(isinstance(t, DTensor) for t in params.values())
    name, wq = next((n, t) for n, t in params.items() if n.endswith("attention.wq.weight"))
    assert wq.shape == (64, 64)  # the global shape is kept ...
    assert wq.to_local().shape == (64 // 4 // 2, 64)  # ... each rank holds 1/tp of the rows, split again over dp
    # full recompute wraps whole blocks, and so does selective on the fused attention path (a per-op policy over
    # the block: plait.execute.recompute); on the math path selective wraps the attention core alone
    assert "_checkpoint_wrapped_module" in name
    wrapped = [m for m in part.layers.values() if isinstance(m, CheckpointWrapper)]
    assert len(wrapped) == len(p.stage_layers(pp_rank))
    has_policy = [m.checkpoint_fn.keywords.get("context_fn") is not None for m in wrapped]
    assert has_policy == [pp_rank == 1] * len(wrapped)
    math = p.replace(model=SPEC.replace(attention="math"))
    _, math_parts = split_model(adapter_for(math.model), adapter_for(math.model).build("meta"), math, pp_rank)
    math_part = shard_stage(math_parts[0], math, mesh, pp_rank, None)
    cores = [m for n, m in math_part.named_modules() if n.endswith("attention.core")]
    assert len(cores) == len(p.stage_layers(pp_rank))
    assert all(isinstance(m, CheckpointWrapper) for m in cores) == (pp_rank == 1)


def test_stage_support_on_a_torch_without_plaits_stage_hooks():
    """torch 2.11's PipelineStage (a GPU machine's) lacks the internals the pooled buffers and a reordered pipeline
    override: plait then runs torch's own buffers, and refuses, naming the fix, a pipeline out of rank order."""
    from torch.distributed.pipelining import PipelineStage

    from plait.execute.pipeline import STAGE_HOOKS, check_stage_support, stage_hooks_missing

    class OldStage:  # the attributes torch 2.11's stage has of these: none
        pass

    assert stage_hooks_missing(PipelineStage) == []  # the torch plait is built against
    assert stage_hooks_missing(OldStage) == list(STAGE_HOOKS)
    assert check_stage_support([0, 1, 2], PipelineStage) is True
    assert check_stage_support([2, 0, 1], PipelineStage) is True
    assert check_stage_support([0, 1, 2], OldStage) is False  # in order: torch's own buffers
    with pytest.raises(RuntimeError, match=r"out of rank order \(\[2, 0, 1\]\).*torch>=2.13"):
        check_stage_support([2, 0, 1], OldStage)
