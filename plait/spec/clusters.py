"""Cluster presets from public specifications.

Link figures: nccl-tests bus bandwidth on 8x A100 NVLink (~230 GB/s) and 8x H100 NVLink
(~370 GB/s); between DGX nodes one 200 Gb/s HDR (A100) or 400 Gb/s NDR (H100) adapter per GPU.
The `Efficiency` constants are fitted by the cost model (see FITTED below).
"""

from __future__ import annotations

from plait.spec.cluster import ClusterSpec, Efficiency, LinkSpec

GB = 1e9
GiB = 2**30

# Fitted constants, per device type: see docs in plait/cost and benchmarks/cost_accuracy.py.
A100_EFFICIENCY = Efficiency(matmul=0.5, matmul_half_dim=0.0, overhead=0.0)
H100_EFFICIENCY = Efficiency(matmul=0.5, matmul_half_dim=0.0, overhead=0.0)

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
                            inter_node=LinkSpec(latency_s=10e-6, bandwidth=50 * GB)),
    # CPU processes on one machine talking through gloo; refine with `plait profile`.
    "local-cpu": ClusterSpec(name="local-cpu", num_devices=8, devices_per_node=8, memory_bytes=2 * GiB,
                             peak_flops=2e10, efficiency=Efficiency(matmul=0.5),
                             intra_node=LinkSpec(latency_s=50e-6, bandwidth=1 * GB),
                             inter_node=LinkSpec(latency_s=100e-6, bandwidth=0.1 * GB),
                             device_type="cpu", backend="gloo"),
}
