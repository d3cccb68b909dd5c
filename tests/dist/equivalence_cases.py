"""The plan cases the multi-process equivalence tests run, grouped by world size.

Tiny models (4 layers, hidden 32, seq 16) so that one launch per world size runs every case in a few seconds
each on a 2-core machine. A case is the keyword arguments of a Plan plus its model: plait's reference
decoder of a tiny spec ("gpt", "llama", or "gpt-tied") or a tiny Hugging Face model ("hf:llama", "hf:gpt2", ...,
written by plait.hf.tiny into PLAIT_TEST_HF_DIR). `clip` turns on gradient clipping (at a norm below
the real one, so clipping acts) to prove the global norm across shards. Every case is judged by the same
verdict as `plait check` (plait.execute.equivalence.Tolerance)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from plait.hf.tiny import FAMILIES
from plait.plan import Plan
from plait.spec import ModelSpec, TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.load import load_model

SEQ_LEN = 16
CLIP = 0.5
HF_DIR_ENV = "PLAIT_TEST_HF_DIR"


def tiny_spec(arch: str, num_layers: int = 4) -> ModelSpec:
    """gpt: 4 heads (MHA); llama: 4 query heads over 2 kv heads (GQA), SwiGLU ffn 64; gpt-tied: tied, vocab 67;
    moe: the llama with 4 experts of width 32, top-2 (plait.models.moe) in place of its MLP
    (a "-math" suffix on a case's model: the same spec on the unfused attention path)."""
    if arch == "moe":
        return tiny_spec("llama", num_layers).replace(name="tiny-moe-test", num_experts=4, experts_per_token=2,
                                                      moe_ffn_hidden_size=32)
    tied = arch == "gpt-tied"
    arch = "gpt" if tied else arch
    return ModelSpec(name=f"tiny-{arch}-test", arch=arch, num_layers=num_layers, hidden_size=32, num_heads=4,
                     num_kv_heads=2 if arch == "llama" else None, ffn_hidden_size=64,
                     vocab_size=67 if tied else 64, max_seq_len=32, tied_embeddings=tied)


FACTORY = "module:tiny_decoder:build"
"""examples/custom/tiny_decoder.py: a user's own module (not a transformers class), blocks of unequal width."""


def model_of(case: dict) -> ModelSpec:
    return _spec(case["model"], case.get("layers", 4))


@functools.cache
def _spec(model: str, layers: int) -> ModelSpec:
    """Loaded once per process (a ModelSpec is frozen): measuring a Hugging Face class or the factory's blocks on
    meta takes about a second, and every rank of a launch, and the test process, plans several cases of each."""
    if model.endswith("-math"):  # the unfused attention path (its selective recompute checkpoints the core)
        return _spec(model.removesuffix("-math"), layers).replace(attention="math")
    if model == "factory":
        from tiny_decoder import TP_PLAN

        return load_model(FACTORY).replace(tp_plan=TP_PLAN)
    if model.startswith("hf:"):
        return load_model(str(Path(os.environ[HF_DIR_ENV]) / model.removeprefix("hf:")))
    return tiny_spec(model, layers)


def make_plan(case: dict) -> Plan:
    kwargs = {k: v for k, v in case.items() if k not in ("name", "model", "clip", "world", "layers", "broken", "chat")}
    kwargs.setdefault("micro_batch", 1)
    kwargs.setdefault("num_micro_batches", 2)
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    global_batch = kwargs.get("dp", 1) * kwargs["micro_batch"] * kwargs["num_micro_batches"]
    return Plan.of(model=model_of(case), train=TrainSpec(global_batch=global_batch, seq_len=SEQ_LEN, precision="fp32"),
                   cluster=CLUSTER_PRESETS["local-cpu"], **kwargs)


def _case(name: str, model: str, world: int, clip: bool = True, **plan) -> dict:
    return {"name": name, "model": model, "world": world, "clip": clip, **plan}


CASES: list[dict] = [
    # ---- 2 ranks: every technique alone --------------------------------------------
    _case("ddp", "gpt", 2, dp=2),
    _case("ddp-accumulate-noclip", "llama", 2, clip=False, dp=2, micro_batch=2, num_micro_batches=3),
    _case("zero1", "gpt", 2, dp=2, zero=1),
    _case("zero2", "llama", 2, dp=2, zero=2),
    _case("zero3-fsdp", "gpt", 2, dp=2, zero=3, micro_batch=2),
    # gradients reduced after every accumulation micro-batch (Plan.grad_sync): sharded on fully_shard, DDP in full
    _case("zero3-sync-every-micro-batch", "llama", 2, dp=2, zero=3, num_micro_batches=3, grad_sync="micro_batch"),
    _case("ddp-sync-every-micro-batch", "gpt", 2, clip=False, dp=2, num_micro_batches=3, grad_sync="micro_batch"),
    _case("zero1-selective", "llama", 2, dp=2, zero=1, recompute=["selective"]),
    _case("zero2-full", "gpt", 2, dp=2, zero=2, recompute=["full"]),
    _case("zero3-selective", "llama", 2, dp=2, zero=3, recompute=["selective"]),
    _case("tp", "llama", 2, tp=2, micro_batch=2),
    _case("tp-sp", "gpt", 2, tp=2, sequence_parallel=True, micro_batch=2),
    _case("tp-sp-llama-full", "llama", 2, tp=2, sequence_parallel=True, recompute=["full"]),
    _case("pp-gpipe-uneven", "gpt", 2, pp=2, schedule="gpipe", layers_per_stage=[3, 1]),
    _case("pp-1f1b-recompute-per-stage", "llama", 2, pp=2, schedule="1f1b", num_micro_batches=4,
          layers_per_stage=[1, 3], recompute=["full", "selective"]),
    _case("pp-interleaved-uneven-empty-end", "gpt", 2, pp=2, schedule="interleaved", interleave=2,
          num_micro_batches=4, layers_per_stage=[2, 1, 1, 0]),
    _case("pp-1f1b-empty-first", "gpt", 2, pp=2, schedule="1f1b", layers_per_stage=[0, 4]),
    _case("tp-sp-math-selective", "llama-math", 2, tp=2, sequence_parallel=True, recompute=["selective"]),
    _case("hf-llama-math-selective", "hf:llama-math", 2, dp=2, zero=2, recompute=["selective"]),
    _case("cp2-all-gather", "llama", 2, cp=2, context_parallel="all_gather"),
    _case("cp2-all-to-all-selective", "gpt", 2, cp=2, context_parallel="all_to_all", recompute=["selective"]),
    _case("ep2-dp2", "moe", 2, dp=2, ep=2, zero=2),
    _case("hf-llama-cp2-all-to-all", "hf:llama", 2, cp=2, context_parallel="all_to_all"),
    _case("pp2-zbv", "llama", 2, pp=2, schedule="zbv", interleave=2, num_micro_batches=4),
    _case("pp2-dualpipev", "gpt", 2, pp=2, schedule="dualpipev", interleave=2, num_micro_batches=4),
    # chat-masked targets (rows training different numbers of tokens, one none), one global batch of 4 cut three
    # ways: the step's loss is its token mean under each, the same as one process's (plait.execute.step_loss)
    _case("chat-hf-llama-dp2", "hf:llama", 2, chat=True, dp=2),
    _case("chat-hf-llama-tp2", "hf:llama", 2, chat=True, tp=2, micro_batch=2),
    _case("chat-hf-llama-pp2", "hf:llama", 2, chat=True, pp=2, schedule="1f1b", num_micro_batches=4),
    # a Hugging Face model's chat batches pack conversations too, each attending to itself only; context parallelism
    # counts the trained tokens over its ranks and numbers the documents along the sequence across them (the second
    # with Qwen2's windows on its last layers)
    _case("chat-hf-llama-cp2-all-gather", "hf:llama", 2, chat=True, cp=2, context_parallel="all_gather"),
    _case("chat-hf-qwen2-window-cp2-all-to-all", "hf:qwen2-window", 2, chat=True, cp=2, context_parallel="all_to_all"),
    # sliding windows (6 tokens) shorter than the sequence (16), as the class declares them, against the class's own
    # masks on one process; context parallelism applies the window itself
    _case("window-starcoder2-dp2", "hf:starcoder2-window", 2, dp=2),
    _case("window-mistral-tp2-sp", "hf:mistral-window", 2, tp=2, sequence_parallel=True),
    _case("window-gemma2-pp2", "hf:gemma2-window", 2, pp=2, schedule="1f1b", num_micro_batches=4),
    _case("window-starcoder2-cp2-all-gather", "hf:starcoder2-window", 2, cp=2, context_parallel="all_gather"),
    # a plan whose gradient reduction is dropped on purpose: the verdict must call it DIFFERENT
    _case("broken-dp-no-grad-sync", "gpt", 2, clip=False, dp=2, broken=True),
    # ---- 4 ranks: the combinations that matter --------------------------------------
    _case("fsdp-tp-sp", "llama", 4, dp=2, tp=2, zero=3, sequence_parallel=True),
    _case("ddp-tp", "gpt", 4, dp=2, tp=2, zero=0),
    _case("zero1-tp-selective", "gpt", 4, dp=2, tp=2, zero=1, recompute=["selective"]),
    _case("tp-sp-pp", "gpt", 4, tp=2, pp=2, sequence_parallel=True, schedule="1f1b", layers_per_stage=[1, 3]),
    _case("dp-pp-zero1-interleaved", "llama", 4, dp=2, pp=2, zero=1, schedule="interleaved", interleave=2,
          num_micro_batches=4, layers_per_stage=[1, 1, 2, 0], recompute=["selective", "none"]),
    _case("dp-pp-zero0-1f1b", "gpt", 4, dp=2, pp=2, zero=0, schedule="1f1b", num_micro_batches=2),
    _case("dp4-zero3-full", "gpt", 4, dp=4, zero=3, recompute=["full"], num_micro_batches=1),
    _case("pp4-gpipe-uneven", "llama", 4, pp=4, schedule="gpipe", layers=6, layers_per_stage=[1, 2, 2, 1]),
    _case("tp4-sp", "gpt", 4, tp=4, sequence_parallel=True),
    _case("cp2-dp2-fsdp", "llama", 4, dp=2, cp=2, zero=3, context_parallel="all_to_all"),
    _case("cp2-tp2-sp", "llama", 4, cp=2, tp=2, sequence_parallel=True, context_parallel="all_gather"),
    _case("ep4-dp4", "moe", 4, dp=4, ep=4, zero=1),
    _case("ep2-dp2-pp2", "moe", 4, dp=2, ep=2, pp=2, zero=1, schedule="1f1b", num_micro_batches=2),
    # experts sharded over their copies (edp = dp / ep = 2) by fully_shard, as the dense weights over dp
    _case("ep2-edp2-zero3", "moe", 4, dp=4, ep=2, zero=3),
    _case("moe-tp2-edp2-zero2-sp", "moe", 4, dp=2, tp=2, zero=2, sequence_parallel=True),
    # ---- 8 ranks: DP x TP x PP = 2 x 2 x 2 -------------------------------------------
    _case("2x2x2-sp-zero1-1f1b", "gpt", 8, dp=2, tp=2, pp=2, sequence_parallel=True, zero=1, schedule="1f1b"),
    _case("2x2x2-fsdp-interleaved-uneven", "llama", 8, dp=2, tp=2, pp=2, zero=3, schedule="interleaved",
          interleave=2, num_micro_batches=4, layers=6, layers_per_stage=[2, 1, 2, 1], recompute=["selective", "full"]),
    _case("2x2x2-ddp-gpipe", "gpt", 8, dp=2, tp=2, pp=2, zero=0, schedule="gpipe", recompute=["full", "none"]),
]

# Every Hugging Face family and plait's own tied model under the plans of the adapter proof; the eight-rank
# composition of dp x tp x pp (family-independent: each family's pieces are proven under every plan above it) for
# plait's two models and two families of different build (rotary and grouped heads; learned positions and Conv1D).
EIGHT_RANK_MODELS = ("gpt-tied", "factory", "hf:llama", "hf:gpt2")
FAMILY_PLANS: list[tuple[str, int, dict]] = [
    ("dp2", 2, dict(dp=2)),
    ("tp2-sp", 2, dict(tp=2, sequence_parallel=True)),
    ("pp2-1f1b", 2, dict(pp=2, schedule="1f1b")),
    ("pp2-interleaved", 2, dict(pp=2, schedule="interleaved", interleave=2)),
    ("fsdp4", 4, dict(dp=4, zero=3, num_micro_batches=1)),
    ("2x2x2", 8, dict(dp=2, tp=2, pp=2, zero=3, sequence_parallel=True, schedule="1f1b")),
]
for _model in ("gpt-tied", "factory", *(f"hf:{f}" for f in FAMILIES)):
    for _plan_name, _world, _plan in FAMILY_PLANS:
        if _world == 8 and _model not in EIGHT_RANK_MODELS:
            continue
        CASES.append(_case(f"{_model}-{_plan_name}", _model, _world, **_plan))


def cases_for(world: int) -> list[dict]:
    return [case for case in CASES if case["world"] == world]
