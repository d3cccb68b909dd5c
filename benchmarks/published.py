"""Published measurements (docs/published-runs.md) and the cost model's prediction of each.

Used by tests/unit/test_cost_accuracy.py (tolerances) and benchmarks/cost_accuracy.py
(tables and the fit of the Efficiency constants in plait/spec/clusters.py).

Megatron-LM rows (Narayanan et al. 2021, Table 1) are priced as the paper ran them:
the unfused attention of 2021 (ModelSpec.attention = "math"; so are Korthikanti et al.'s 22B rows),
interleaved 1F1B with full recompute, no sequence parallelism, plain data parallelism,
d = n/(t·p), and the unstated choices made as Megatron's scripts make them: micro-batch 1,
and v = 3 model chunks per device where 3 divides the layers per device (Korthikanti et
al. ran 175B and 530B with 3 chunks), else the divisor of the layers per device nearest
to 3 (2 for 145.6B and 1T). Rows with p = 1 run plain gradient accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.cost.compute import Slicing, sliced_layer_cost
from plait.cost.layout import Setting
from plait.cost.model import predict, predict_layout
from plait.plan import Plan
from plait.spec import ClusterSpec, ModelSpec, TrainSpec
from plait.spec.cluster import HostOverheads


@dataclass(frozen=True)
class MegatronRow:
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    devices: int
    batch: int
    tflops: float
    """Published TFLOP/s per GPU."""


MEGATRON_ROWS = (
    MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    MegatronRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    MegatronRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    MegatronRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)
SEQ_LEN, VOCAB = 2048, 51200


def megatron_chunks(row: MegatronRow) -> int:
    per_device = row.layers // row.pp
    if row.pp == 1:
        return 1
    divisors = [v for v in range(1, per_device + 1) if per_device % v == 0]
    return min(divisors, key=lambda v: (abs(v - 3), v))


def their_software(cluster: ClusterSpec) -> ClusterSpec:
    """A preset as it prices a published run: the hardware figures alone. Host times are plait's eager
    executor's (plait.spec.clusters.GPU_HOST, measured on a GPU); the published runs are Megatron's and
    torchtitan's, whose host time was not measured and which the fitted efficiencies already absorb."""
    return cluster.replace(host=HostOverheads())


def megatron_plan(row: MegatronRow, cluster: ClusterSpec) -> Plan:
    model = ModelSpec(name=f"gpt-{row.params_b}b", arch="gpt", num_layers=row.layers, hidden_size=row.hidden,
                      num_heads=row.heads, vocab_size=VOCAB, max_seq_len=SEQ_LEN, attention="math")
    dp = row.devices // (row.tp * row.pp)
    v = megatron_chunks(row)
    return Plan.of(dp=dp, tp=row.tp, pp=row.pp, zero=0, recompute=("full",), micro_batch=1,
                num_micro_batches=row.batch // dp, schedule="interleaved" if v > 1 else "1f1b", interleave=v,
                model=model, train=TrainSpec(global_batch=row.batch, seq_len=SEQ_LEN, precision="fp16"),
                cluster=their_software(cluster).with_devices(row.devices))


def paper_flops(row: MegatronRow) -> float:
    """F = 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)): the paper's FLOPs per iteration (recompute included)."""
    h, s, L = row.hidden, SEQ_LEN, row.layers
    return 96.0 * row.batch * s * L * h * h * (1 + s / (6 * h) + VOCAB / (16 * L * h))


def predicted_tflops(row: MegatronRow, cluster: ClusterSpec, exact: bool = True) -> float:
    """TFLOP/s per GPU by the paper's formula from the predicted step time (exact=False: closed-form schedule)."""
    plan = megatron_plan(row, cluster)
    if exact:
        step = predict(plan).step_time_s
    else:
        step = predict_layout(Setting(plan.model, plan.cluster, plan.train), plan.layout, plan.layers_per_stage,
                              plan.recompute, exact=False).step_time_s
    return paper_flops(row) / (row.devices * step) / 1e12


# Korthikanti et al. 2022: one layer of the 22B model (a=64, h=6144, t=8, b=4, s=2048), milliseconds.
LAYER_22B_ROWS = (
    # (experiment, sequence parallel, recompute mode, forward, backward, combined)
    ("baseline, no recompute", False, "none", 7.7, 11.9, 19.6),
    ("sequence parallelism", True, "none", 7.2, 11.8, 19.0),
    ("full recompute", False, "full", 7.7, 19.5, 27.2),
    ("selective recompute", False, "selective", 7.7, 13.2, 20.9),
    ("selective recompute + sequence parallelism", True, "selective", 7.2, 13.1, 20.3),
)
MODEL_22B = ModelSpec(name="gpt-22b", arch="gpt", num_layers=48, hidden_size=6144, num_heads=64, vocab_size=VOCAB,
                      max_seq_len=SEQ_LEN, attention="math")


def predicted_layer_ms(cluster: ClusterSpec, sp: bool, mode: str) -> tuple[float, float]:
    """(forward, backward) milliseconds of one 22B layer as the cost model prices it."""
    lc = sliced_layer_cost(MODEL_22B, their_software(cluster), SEQ_LEN, 4, Slicing(tp=8, sp=sp), 2)
    return 1e3 * (lc.fwd + lc.tp_fwd), 1e3 * (lc.bwd + lc.tp_bwd + lc.recompute[mode])


# ZeRO (Rajbhandari et al. 2020): model-state GB per device for Ψ = 7.5e9, by N_d and stage 1/2/3.
ZERO_PSI = 7.5e9
ZERO_ROWS = {1: (120.0, 120.0, 120.0), 4: (52.5, 41.3, 30.0), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88)}
