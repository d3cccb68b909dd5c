"""Cluster presets from public specifications, and the cost model's fitted constants.

Links (reference/published.md, section 5; not fitted): nccl-tests bus bandwidth on 8x A100
NVLink ~230 GB/s, 8x H100 NVLink ~370 GB/s. Between DGX A100 nodes nccl-tests reach ~192 GB/s
per node with 8 HDR 200 Gb/s adapters, i.e. 24 GB/s per GPU; for H100 nodes (8x NDR 400 Gb/s)
the same 96% of the line rate gives 48 GB/s per GPU. Latencies: a few microseconds per ring
step inside a node (NVSwitch), ~10 us across InfiniBand.

Fitted constants (`Efficiency`, three per device type; see plait/cost/compute.py for the formulas):

* ``matmul`` (0.66): fraction of peak reached by large GEMMs,
* ``matmul_half_dim`` (800): hidden size at which GEMMs reach half of that
  (rate = peak · matmul · h / (h + matmul_half_dim)),
* ``overhead`` (0.05): a layer's non-GEMM work (norms, softmax, GeLU, dropout, residuals) as a
  fraction of its GEMM time.

A100 (both memory sizes: same chip): fitted jointly on all 10 rows of Narayanan et al. 2021,
Table 1 (TFLOP/s per GPU, priced as plait.cost.published describes) and the 5 rows of one
22B-model layer's forward/backward time from Korthikanti et al. 2022, minimizing the worst
error relative to the tolerance (10% and 15%). `python benchmarks/cost_accuracy.py --fit`
redoes the grid search; the result: worst 6.5% on Megatron rows, 9.8% on the 22B layer rows.

H100: no published rows in reference/published.md to fit on. The constants are the A100's,
assuming the same software stack reaches the same fraction of a larger peak (989 TFLOP/s).
That is optimistic for small models (H100 GEMMs need larger shapes to saturate): run
`plait profile` / `plait tune` on real H100s to replace it.
"""

from __future__ import annotations

from plait.spec.cluster import ClusterSpec, Efficiency, LinkSpec

GB = 1e9
GiB = 2**30

# Fitted constants, per device type: see the module docstring for the rows they were fitted on.
A100_EFFICIENCY = Efficiency(matmul=0.66, matmul_half_dim=800.0, overhead=0.05)
H100_EFFICIENCY = A100_EFFICIENCY  # no published H100 rows: assumed equal (see above)

_A100_LINKS = dict(
    intra_node=LinkSpec(latency_s=5e-6, bandwidth=230 * GB),
    inter_node=LinkSpec(latency_s=10e-6, bandwidth=24 * GB),
)

CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    "a100-80g": ClusterSpec(name="a100-80g", num_devices=1024, devices_per_node=8, memory_bytes=80 * GiB,
                            peak_flops=312e12, efficiency=A100_EFFICIENCY, **_A100_LINKS),
    "a100-40g": ClusterSpec(name="a100-40g", num_devices=1024, devices_per_node=8, memory_bytes=40 * GiB,
                            peak_flops=312e12, efficiency=A100_EFFICIENCY, **_A100_LINKS),
    "h100-80g": ClusterSpec(name="h100-80g", num_devices=1024, devices_per_node=8, memory_bytes=80 * GiB,
                            peak_flops=989e12, efficiency=H100_EFFICIENCY,
                            intra_node=LinkSpec(latency_s=5e-6, bandwidth=370 * GB),
                            inter_node=LinkSpec(latency_s=10e-6, bandwidth=48 * GB)),
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
