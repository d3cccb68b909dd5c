"""Cluster presets from public specifications, and the cost model's fitted constants.

Links (docs/published-runs.md, section 5; not fitted): nccl-tests bus bandwidth on 8x A100
NVLink ~230 GB/s, 8x H100 NVLink ~370 GB/s. Between DGX A100 nodes nccl-tests reach ~192 GB/s
per node with 8 HDR 200 Gb/s adapters, i.e. 24 GB/s per GPU; for H100 nodes (8x NDR 400 Gb/s)
the same 96% of the line rate gives 48 GB/s per GPU. Latencies: a few microseconds per ring
step inside a node (NVSwitch), ~10 us across InfiniBand.

Fitted constants (`Efficiency`, three per device type; see plait/cost/compute.py for the formulas):

* ``matmul``: fraction of peak reached by large GEMMs,
* ``matmul_half_dim``: hidden size at which GEMMs reach half of that
  (rate = peak · matmul · h / (h + matmul_half_dim)),
* ``overhead``: a layer's non-GEMM work (norms, softmax, GeLU, dropout, residuals) as a
  fraction of its GEMM time.

Published step times barely separate ``matmul`` from ``overhead`` (a layer's time goes with
(1 + overhead) / matmul): the fits below are minimax choices along that valley, and a pair with the
same ratio prices whole layers alike.

A100 (both memory sizes: same chip): fitted jointly on all 10 rows of Narayanan et al. 2021,
Table 1 (TFLOP/s per GPU, priced as published describes) and the 5 rows of one
22B-model layer's forward/backward time from Korthikanti et al. 2022, minimizing the worst
error relative to the tolerance (10% and 15%): ``matmul`` 0.82, ``matmul_half_dim`` 800,
``overhead`` 0.30 (2021's unfused softmax and dropout). `python benchmarks/cost_accuracy.py --fit` redoes
every grid search; the result: worst 6.1% on Megatron rows, 9.5% on the 22B layer rows.

H100 SXM (``h100-80g``, 700 W): fitted by the same grid search on the five rows of Megatron-LM's H100
weak-scaling table (docs/published-runs.md, section 6.1; priced as published_2024 describes):
``matmul`` 0.76, ``matmul_half_dim`` 1600, ``overhead`` 0.0; worst error 8.7% (tolerance 10%). The larger
half-width than the A100's is the known need of H100 GEMMs for larger shapes to saturate; no overhead is
left once Transformer Engine's fused kernels run the non-GEMM work (within the valley above).

H100 96GB HBM2e at a 500 W power limit (``h100-96g-500w``; Meta's Grand Teton, torchtitan's H100 rows in
section 6.2): not an SXM part at full power, so a preset of its own. The same chip (the SXM datasheet peak,
989 TFLOP/s, is what torchtitan's MFU is counted against), so ``matmul_half_dim`` and ``overhead`` are the
SXM's; ``matmul`` (0.47) is fitted on the two rows without torch.compile (Llama 3.1 8B, FSDP over 8 and 128
GPUs, 5,762 and 5,605 tokens/s per GPU; worst 1.5%): the power limit and HBM2e hold it to about 60% of
the SXM's GEMM rate. Links: NVLink as on any H100 node, one 400 Gb/s RDMA port per GPU (48 GB/s at 96% of line rate).

H200 SXM (``h200-141g``): the H100's chip (989 TFLOP/s) with 141 GB of HBM3e (139.8 GiB usable: the total
capacity torch.cuda reports) at 4.8 TB/s. Measured on one H200 (2026-11-26, torch 2.11, `benchmarks/gpu_check.py`'s grid of 41
single-GPU plans of a 1.4B Llama, micro-batch 1-8, sequence 1K-8K, each recompute mode): the H100's ``matmul`` and
``matmul_half_dim`` price the grid's kernel-bound rows within 2% (a least-squares scale of 0.98 on them), so they are
kept; NVLink and the fabric as on an H100 node (one GPU cannot measure links).

GPU host time (`GPU_HOST`, every GPU preset): plait's executor is eager PyTorch, and a small model's layers wait
on the host, not the kernels. Fitted on every saved grid of benchmarks/results/gpu/ together (the H200's 44 rows and
two runs of 41 rows on one H100 machine, 2026-11-26; robust least squares on step time, `pass_time`'s max(kernels,
host) per layer pass): ``layer_overhead_s`` 0.53 ms (forward; backward twice it), ``recompute_layer_overhead_s``
1.44 ms, ``selective_layer_overhead_s`` 1.50 ms (the per-op policy's dispatch mode, per forward and per recompute),
``step_overhead_s`` 25 ms. Software figures, not the GPU's, so every GPU preset carries them (A100 hosts were not
measured). `python benchmarks/gpu_refit.py --held-out` refits them and gives, per run, the median step-time error
in-sample / leave-one-shape-out / fitted on the other GPU kind only: H200 4.5% / 4.5% / 5.4%, H100 runs 4.5% /
5.5% / 8.3% and 4.4% / 5.3% / 9.2% (saved: benchmarks/results/gpu_refit.txt; tests/unit/test_gpu_refit.py keeps
the shipped figures within 2% of their refit). Published runs of other software (Megatron-LM's, torchtitan's) are
priced without them (`published.their_software`).

Optimizer bandwidth (``memory_balance``), refit by the same command from each kind's rows (the median measured over
predicted optimizer step): the H200's AdamW step runs at 3.20 TB/s, 67% of its 4.8 TB/s datasheet (balance 309);
the H100's at 2.55 TB/s, 76% of its 3.35 TB/s (balance 388, ``h100-80g``). GPUs not measured take 66% of their
datasheet bandwidth (A100 80GB 2.04 TB/s, 40GB 1.56 TB/s, H100 96GB HBM2e 3.35 TB/s), in place of the A100-derived
150 FLOP per byte that priced every GPU before.
"""

from __future__ import annotations

import dataclasses

from plait.spec.cluster import ClusterSpec, Efficiency, HostOverheads, LinkSpec

GB = 1e9
GiB = 2**30
TB = 1e12

ACHIEVED_BANDWIDTH = 0.66
"""Fraction of the datasheet memory bandwidth the optimizer step reaches (measured on an H200: module docstring)."""


def _balance(peak_flops: float, datasheet_bandwidth: float) -> float:
    return round(peak_flops / (ACHIEVED_BANDWIDTH * datasheet_bandwidth))


# Fitted constants, per device type: see the module docstring for the rows they were fitted on.
A100_EFFICIENCY = Efficiency(matmul=0.82, matmul_half_dim=800.0, overhead=0.30)
H100_EFFICIENCY = Efficiency(matmul=0.76, matmul_half_dim=1600.0, overhead=0.0,
                             memory_balance=388.0)  # Megatron-LM's H100 rows; gpu_refit.py on the H100 grids (balance)
H100_500W_EFFICIENCY = Efficiency(matmul=0.47, matmul_half_dim=H100_EFFICIENCY.matmul_half_dim,
                                  overhead=H100_EFFICIENCY.overhead,
                                  memory_balance=_balance(989e12, 3.35 * TB))  # torchtitan's H100 96GB rows
H200_EFFICIENCY = Efficiency(matmul=H100_EFFICIENCY.matmul, matmul_half_dim=H100_EFFICIENCY.matmul_half_dim,
                             overhead=H100_EFFICIENCY.overhead, memory_balance=309.0)  # gpu_refit.py, H200 grid
GPU_HOST = HostOverheads(layer_overhead_s=0.53e-3, recompute_layer_overhead_s=1.44e-3,
                         selective_layer_overhead_s=1.50e-3, step_overhead_s=25e-3)  # gpu_refit.py, every saved grid

H100_MEMORY_BYTES = 85_017_493_504
"""An H100 80GB HBM3's capacity as torch.cuda reports it (79.18 GiB; read on the H100 of 2026-11-26), not 80 GiB:
a plan priced up to 80 GiB would not fit. The grid's largest plan there reserved 77.1 GiB and ran."""

_A100_LINKS = dict(
    intra_node=LinkSpec(latency_s=5e-6, bandwidth=230 * GB),
    inter_node=LinkSpec(latency_s=10e-6, bandwidth=24 * GB),
)
_H100_LINKS = dict(
    intra_node=LinkSpec(latency_s=5e-6, bandwidth=370 * GB),
    inter_node=LinkSpec(latency_s=10e-6, bandwidth=48 * GB),
)

CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    "a100-80g": ClusterSpec(name="a100-80g", num_devices=1024, devices_per_node=8, memory_bytes=80 * GiB,
                            peak_flops=312e12, host=GPU_HOST, **_A100_LINKS,
                            efficiency=dataclasses.replace(A100_EFFICIENCY, memory_balance=_balance(312e12, 2.04 * TB))),
    "a100-40g": ClusterSpec(name="a100-40g", num_devices=1024, devices_per_node=8, memory_bytes=40 * GiB,
                            peak_flops=312e12, host=GPU_HOST, **_A100_LINKS,
                            efficiency=dataclasses.replace(A100_EFFICIENCY, memory_balance=_balance(312e12, 1.555 * TB))),
    "h100-80g": ClusterSpec(name="h100-80g", num_devices=1024, devices_per_node=8, memory_bytes=H100_MEMORY_BYTES,
                            peak_flops=989e12, efficiency=H100_EFFICIENCY, host=GPU_HOST, **_H100_LINKS),
    "h100-96g-500w": ClusterSpec(name="h100-96g-500w", num_devices=1024, devices_per_node=8, memory_bytes=96 * GiB,
                                 peak_flops=989e12, efficiency=H100_500W_EFFICIENCY, host=GPU_HOST,
                                 **_H100_LINKS),
    "h200-141g": ClusterSpec(name="h200-141g", num_devices=1024, devices_per_node=8, memory_bytes=139.8 * GiB,
                             peak_flops=989e12, efficiency=H200_EFFICIENCY, host=GPU_HOST, **_H100_LINKS),
    # CPU processes on one machine talking through gloo; refine with `plait profile`. Peak: one
    # core's fp32 FMA rate (~2.5 GHz x 2 AVX2 FMA units x 8 lanes x 2 = 80 GFLOP/s, rounded down
    # to 50 for the clocks cloud cores hold); `plait profile --nproc 2` measured ~38 GFLOP/s per rank
    # here for large GEMMs, and the demo's training reaches ~28.
    "local-cpu": ClusterSpec(name="local-cpu", num_devices=8, devices_per_node=8, memory_bytes=2 * GiB,
                             peak_flops=5e10, efficiency=Efficiency(matmul=0.5),
                             intra_node=LinkSpec(latency_s=50e-6, bandwidth=1 * GB),
                             inter_node=LinkSpec(latency_s=100e-6, bandwidth=0.1 * GB),
                             device_type="cpu", backend="gloo"),
}
