"""Host time per layer pass and per parameter tensor: measured by timing a few small plans end to end.

Microbenchmarks price FLOPs and bytes; they miss the time the host spends per operation (Python,
autograd, DTensor's sharding propagation, a collective's bookkeeping). On GPUs that time hides under
the kernels; on CPU processes it is a large part of a small model's step, and it is per micro-batch,
not per token, so it decides how many micro-batches a plan should use. The cost model charges it as
HostOverheads fields (ClusterSpec.host; plait/cost/compute.py and model.py): `layer_overhead_s` per layer pass, and more
under tensor parallelism (`tp_layer_overhead_s`) and fully_shard (`fsdp_layer_overhead_s`);
`dtensor_param_overhead_s` per parameter tensor and step where parameters are DTensors (TP, or data
parallelism on fully_shard), and more under TP (`tp_param_overhead_s`); `pipeline_overhead_s` per
pipeline stage and micro-batch pass; `step_overhead_s` once per step.

`probe_plans` lists plans chosen so that each of these moves their step time on its own: data
parallelism on DDP with 1 and 4 micro-batches (the per-pass time), the same on fully_shard (the
per-parameter time), and, where the world is even, tensor parallelism with 1 and 4 micro-batches and
a 2-stage 1F1B pipeline with 2 and 8 (`pipeline_overhead_s`, per stage and micro-batch pass). They
use a small GPT at a short sequence, so host time is a large share of every step. `plait profile`
times them (plait.profile.tune) and `calibrate` fits the three fields through the cost model
(`fit_terms` with HOST_TERMS), on top of the compute and link fits. `plait tune` refines them later on
the planned model itself.
"""

from __future__ import annotations

import math
import statistics

from plait.plan import Plan
from plait.spec import ClusterSpec, Efficiency, LinkSpec, TrainSpec

PROBE_MODEL = "tiny-gpt"
"""The model the probe plans train (4 layers, h=128, byte vocabulary)."""
PROBE_SEQ_LEN = 32
"""Short sequences: the GEMMs take about as long as the host's dispatch of them."""
PROBE_MICRO_BATCHES = (1, 4)
PIPELINE_MICRO_BATCHES = (2, 8)
"""A pipeline of 2 stages needs at least 2 micro-batches; 8 makes its per-micro-batch time stand out."""


def probe_plans(world_size: int) -> list[Plan]:
    """The plans `plait profile` times to measure host time on `world_size` ranks (one node or more)."""
    from plait.search import plan as search

    stand_in = ClusterSpec(name="probe", num_devices=world_size, devices_per_node=world_size, memory_bytes=2**40,
                           peak_flops=1e12, efficiency=Efficiency(), intra_node=LinkSpec(latency_s=1e-5, bandwidth=1e9),
                           inter_node=LinkSpec(latency_s=1e-5, bandwidth=1e9))
    layouts = [dict(dp=world_size, tp=1, pp=1, zero=0), dict(dp=world_size, tp=1, pp=1, zero=2)]
    if world_size % 2 == 0:
        layouts.append(dict(dp=world_size // 2, tp=2, pp=1, zero=0))
        layouts.append(dict(dp=world_size // 2, tp=1, pp=2, zero=0, schedule="1f1b"))
    plans = []
    for layout in layouts:
        for m in PIPELINE_MICRO_BATCHES if layout["pp"] > 1 else PROBE_MICRO_BATCHES:
            train = TrainSpec(global_batch=layout["dp"] * m, seq_len=PROBE_SEQ_LEN, precision="fp32")
            plans += search(PROBE_MODEL, stand_in, train, num_devices=world_size, top=1, micro_batch=1,
                            recompute="none", **layout)
    return plans


def steady_probe_times(step_times: list[list[float]], sweeps: int = 10) -> list[float]:
    """Each probe's step time with the rounds' shared slowdown taken out, from `step_times[probe][round]`: the
    probes are stepped round-robin (plait.profile.tune.time_plans), so a burst of other work on the cores slows the
    probes of the rounds it lasts alike. Tukey's median polish of log times, log t[p, r] = level + probe[p] +
    round[r] + residual, reads each probe against the others within its rounds (a probe's own median over rounds
    moves with whichever rounds its middle steps fell in); a step that met a burst alone is a residual the medians
    ignore. Returns exp(level + probe[p]): each probe at the median round.

    Probes with fewer rounds than the others are read on the rounds they share (the first ones)."""
    rounds = min(len(times) for times in step_times)
    if rounds == 0:
        raise ValueError("every probe needs at least one timed step")
    table = [[math.log(t) for t in times[:rounds]] for times in step_times]
    level, probe, by_round = 0.0, [0.0] * len(table), [0.0] * rounds
    for _ in range(sweeps):
        rows = [statistics.median(row) for row in table]
        table = [[v - m for v in row] for row, m in zip(table, rows)]
        probe = [p + m for p, m in zip(probe, rows)]
        shift = statistics.median(by_round)
        by_round, level = [b - shift for b in by_round], level + shift
        columns = [statistics.median(column) for column in zip(*table)]
        table = [[v - m for v, m in zip(row, columns)] for row in table]
        by_round = [b + m for b, m in zip(by_round, columns)]
        shift = statistics.median(probe)
        probe, level = [p - shift for p in probe], level + shift
        if max(map(abs, rows)) < 1e-12 and max(map(abs, columns)) < 1e-12:
            break
    centre = statistics.median(by_round)
    return [math.exp(level + centre + p) for p in probe]
