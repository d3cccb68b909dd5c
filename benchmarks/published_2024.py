"""Published H100 and FSDP2 runs (docs/published-runs.md, section 6) and the cost model's prediction of each.

Used by tests/unit/test_cost_accuracy.py (tolerances) and benchmarks/cost_accuracy.py (tables, and the fit of
the H100 presets' Efficiency constants in plait/spec/clusters.py). Every run used fused attention
(ModelSpec.attention = "fused", plait's default) and bf16.

* Megatron-LM's H100 SXM weak scaling (section 6.1): pinned as published -- model, t, p, d, global batch,
  s = 4096, V = 131,072 untied -- with Megatron's distributed optimizer (ZeRO-1, what `--overlap-param-gather`
  needs) and sequence parallelism under t > 1; the unstated choices (micro-batch, schedule among Megatron's 1F1B
  and interleaved 1F1B, interleaving, recompute) are left to plait's search, with the micro-batch at 1 as
  Megatron's scaling scripts set it.
  TFLOP/s per GPU as the README counts them: 72·B·L·s·h²·(1 + s/(6h) + V/(12·h·L)) per iteration.
* torchtitan's FSDP2 runs (section 6.2): pinned as published -- FSDP (ZeRO-3) over every GPU, local batch as
  micro-batch, one micro-batch per step, the recompute of the run. "Per-layer selective (every 2nd layer
  checkpointed)" has no plait equivalent (plait's modes are per pipeline rank): it is priced as the mean step
  time of the same plan with no recompute and with full recompute, which is exact for the layers' compute
  (each layer's time adds up) and nearly so for the exposed communication. torchtitan's "selective" on the
  H100 rows is its per-op policy, which is plait's selective on the fused path (plait.execute.recompute).
  Memory is torchtitan's maximum reserved memory: the cost model's peak, reserve included.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.cost.model import predict
from published import their_software
from plait.plan import Plan, Prediction
from plait.spec import ClusterSpec, ModelSpec, TrainSpec
from plait.spec.models import MODEL_PRESETS

GiB = 2**30


@dataclass(frozen=True)
class MegatronH100Row:
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    batch: int
    tflops: float
    """Published TFLOP/s per GPU."""

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp


MEGATRON_H100_ROWS = (
    MegatronH100Row(1.7, 16, 2048, 24, 1, 1, 48, 192, 408.8),
    MegatronH100Row(16, 48, 6144, 32, 4, 1, 48, 192, 489.1),
    MegatronH100Row(70, 64, 8192, 84, 8, 2, 48, 384, 419.7),
    MegatronH100Row(177, 96, 12288, 96, 8, 6, 48, 1152, 432.8),
    MegatronH100Row(462, 144, 18432, 112, 8, 16, 48, 3072, 459.9),
)
H100_SEQ_LEN, H100_VOCAB = 4096, 131072


def megatron_h100_model(row: MegatronH100Row) -> ModelSpec:
    return ModelSpec(name=f"gpt-{row.params_b:g}b", arch="gpt", num_layers=row.layers, hidden_size=row.hidden,
                     num_heads=row.heads, vocab_size=H100_VOCAB, max_seq_len=H100_SEQ_LEN)


def megatron_h100_plan(row: MegatronH100Row, cluster: ClusterSpec) -> Plan:
    """plait's best plan with the published choices pinned (see the module docstring)."""
    from plait.search import plan as search

    train = TrainSpec(global_batch=row.batch, seq_len=H100_SEQ_LEN, precision="bf16")
    # Megatron-Core r0.8.0 ran 1F1B or its interleaved form: the zero-bubble V schedules plait also searches are
    # left out (with one stage the schedule means nothing)
    schedules = ("1f1b", "interleaved") if row.pp > 1 else (None,)
    plans = [search(megatron_h100_model(row), their_software(cluster).with_devices(row.devices), train, top=1, dp=row.dp, tp=row.tp,
                    pp=row.pp, zero=1, micro_batch=1, sequence_parallel=row.tp > 1, schedule=schedule)[0]
             for schedule in schedules]
    return min(plans, key=lambda plan: plan.predicted.step_time_s)


def megatron_h100_flops(row: MegatronH100Row) -> float:
    """72·B·L·s·h²·(1 + s/(6h) + V/(12·h·L)): the README's FLOPs per iteration."""
    h, s, L = row.hidden, H100_SEQ_LEN, row.layers
    return 72.0 * row.batch * L * s * h * h * (1 + s / (6 * h) + H100_VOCAB / (12 * h * L))


def megatron_h100_tflops(row: MegatronH100Row, cluster: ClusterSpec, plan: Plan | None = None) -> float:
    plan = plan or megatron_h100_plan(row, cluster)
    step = predict(plan.replace(cluster=their_software(cluster).with_devices(row.devices), predicted=None)).step_time_s
    return megatron_h100_flops(row) / (row.devices * step) / 1e12


@dataclass(frozen=True)
class TorchtitanRow:
    model: str
    """A plait preset of the same shapes."""
    devices: int
    local_batch: int
    recompute: str
    """plait's mode, or "alternate" (torchtitan's every-2nd-layer full recompute: see the module docstring)."""
    tokens_per_s: float
    """Published tokens/s per GPU."""
    memory_gib: float | None = None
    """Published maximum reserved memory (GiB), where given."""
    config: str = ""
    """The model's published config.json, as a folder of examples/hf (`published_config`): the run priced again from
    it, as a user names the model."""

    @property
    def seq_len(self) -> int:
        return MODEL_PRESETS[self.model].max_seq_len  # 8192 for Llama 3, 4096 for Llama 2, as torchtitan ran them


TORCHTITAN_A100_ROWS = (
    TorchtitanRow("llama3-8b", 64, 1, "alternate", 2904, config="llama-3-8b"),
    TorchtitanRow("llama3-70b", 64, 1, "full", 331, config="llama-3-70b"),
    TorchtitanRow("llama2-13b", 64, 2, "none", 2162, config="llama-2-13b"),
    TorchtitanRow("llama2-70b", 64, 2, "full", 353, config="llama-2-70b"),
)
TORCHTITAN_H100_ROWS = (
    TorchtitanRow("llama3-8b", 8, 2, "selective", 5762, 82.4, "llama-3-8b"),  # Llama 3.1 8B: Llama 3 8B's shapes
    TorchtitanRow("llama3-8b", 128, 2, "selective", 5605, 67.0, "llama-3-8b"),
)


def published_config(name: str) -> str:
    """The path of a published config.json folder of the repository (examples/hf/`name`)."""
    from pathlib import Path

    return str(Path(__file__).resolve().parents[1] / "examples" / "hf" / name)


def torchtitan_plan(row: TorchtitanRow, cluster: ClusterSpec, recompute: str | None = None,
                    model: ModelSpec | None = None) -> Plan:
    """The row's plan, its model the preset (or `model`: the same model named otherwise, its config.json)."""
    train = TrainSpec(global_batch=row.devices * row.local_batch, seq_len=row.seq_len, precision="bf16")
    return Plan.of(dp=row.devices, zero=3, micro_batch=row.local_batch, num_micro_batches=1,
                   recompute=(recompute or row.recompute,), model=model or MODEL_PRESETS[row.model], train=train,
                   cluster=their_software(cluster).with_devices(row.devices))


def torchtitan_prediction(row: TorchtitanRow, cluster: ClusterSpec, model: ModelSpec | None = None
                          ) -> tuple[float, Prediction]:
    """(predicted tokens/s per GPU, the prediction of the plan as run; for "alternate", its full-recompute half)."""
    if row.recompute == "alternate":
        halves = [predict(torchtitan_plan(row, cluster, mode, model)) for mode in ("none", "full")]
        step = sum(p.step_time_s for p in halves) / 2
        prediction = halves[1]
    else:
        prediction = predict(torchtitan_plan(row, cluster, model=model))
        step = prediction.step_time_s
    return row.devices * row.local_batch * row.seq_len / step / row.devices, prediction


@dataclass(frozen=True)
class MegatronMoERow:
    """Megatron-Core's reference mapping for Mixtral 8x7B (megatron/core/transformer/moe/README.md, "Reference Best
    Parallel Mapping", MCore v0.8: dropless, all-to-all dispatcher, bf16, 64 H100 80GB, InfiniBand 8x400 Gbit/s,
    s = 4096, TP1 EP8 PP4 "VP 8", micro-batch 1, global batch 256) and the throughput the same README reports for
    Mixtral 8x7B bf16 training with MCore v0.9 (468 TFLOP/s per GPU). "VP 8" reads two ways (8 layers per virtual
    stage, i.e. plain 1F1B with 8 layers a rank, the example script's --num-layers-per-virtual-pipeline-stage 8;
    or 8 chunks of one layer a rank), so both are priced. Megatron's distributed optimizer: ZeRO-1. A check of
    expert parallelism's pricing, not fitted on."""

    model: str = "mixtral-8x7b"
    devices: int = 64
    tp: int = 1
    ep: int = 8
    pp: int = 4
    batch: int = 256
    seq_len: int = 4096
    tflops: float = 468.0
    config: str = "mixtral-8x7b"
    """Its published config.json (examples/hf)."""


MEGATRON_MIXTRAL = MegatronMoERow()


def megatron_moe_flops(row: MegatronMoERow) -> float:
    """Megatron-Core's num_floating_point_operations (megatron/training/training.py, 2024-10): 12·B·s·L·h²·(
    (1 + g/a + s/h)·q/h + f/h·k·3/2 + V/(2·L·h)) for SwiGLU experts, GQA with g query groups, top-k routing."""
    m = MODEL_PRESETS[row.model]
    h, s, L = m.hidden_size, row.seq_len, m.num_layers
    attention = (1 + m.num_kv_heads / m.num_heads + s / h) * m.q_size / h
    mlp = m.moe_ffn_hidden_size / h * m.experts_per_token * 1.5
    return 12.0 * row.batch * s * L * h * h * (attention + mlp + m.vocab_size / (2 * L * h))


def megatron_moe_plan(row: MegatronMoERow, cluster: ClusterSpec, interleave: int, router_imbalance: float,
                      model: ModelSpec | None = None) -> Plan:
    model = (model or MODEL_PRESETS[row.model]).replace(router_imbalance=router_imbalance)
    dp = row.devices // (row.tp * row.pp)
    chunks = row.pp * interleave
    return Plan.of(dp=dp, tp=row.tp, pp=row.pp, ep=row.ep, zero=1, micro_batch=1, num_micro_batches=row.batch // dp,
                   schedule="interleaved" if interleave > 1 else "1f1b", interleave=interleave,
                   layers_per_stage=(model.num_layers // chunks,) * chunks, recompute=("none",) * row.pp, model=model,
                   train=TrainSpec(global_batch=row.batch, seq_len=row.seq_len, precision="bf16"),
                   cluster=their_software(cluster).with_devices(row.devices))


def megatron_moe_prediction(row: MegatronMoERow, cluster: ClusterSpec, interleave: int,
                            router_imbalance: float, model: ModelSpec | None = None) -> tuple[float, Prediction]:
    """(predicted TFLOP/s per GPU as Megatron counts them, the prediction; `model`: the row's model named otherwise)."""
    prediction = predict(megatron_moe_plan(row, cluster, interleave, router_imbalance, model))
    return megatron_moe_flops(row) / (row.devices * prediction.step_time_s) / 1e12, prediction
