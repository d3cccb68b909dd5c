"""What the first GPU runs (benchmarks/gpu_check.py on an H200) changed in the cost model: host time that hides
under kernels on a GPU and adds to them on CPU processes, autocast's 16-bit weight copies, the optimizer's memory
bandwidth per preset, and the h200-141g preset."""

from __future__ import annotations

import dataclasses

import pytest

from plait import Plan, TrainSpec
from plait.cost import predict
from plait.cost.compute import ADAM_BYTES_PER_PARAM, MACHINE_BALANCE, layer_cost, optimizer_time, pass_time
from plait.spec.cluster import Efficiency, HostOverheads
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.models import MODEL_PRESETS

H200 = CLUSTER_PRESETS["h200-141g"]
CPU = CLUSTER_PRESETS["local-cpu"]
LLAMA_8B = MODEL_PRESETS["llama3-8b"]


def test_a_gpu_pass_takes_the_longer_of_kernels_and_host_and_a_cpu_pass_their_sum():
    assert pass_time(H200, 2e-3, 1e-3) == 2e-3 and pass_time(H200, 1e-4, 1e-3) == 1e-3
    assert pass_time(CPU, 2e-3, 1e-3) == pytest.approx(3e-3)


def test_small_layers_are_host_bound_on_a_gpu_and_large_ones_kernel_bound():
    host = H200.host.layer_overhead_s
    small = layer_cost(MODEL_PRESETS["tiny-llama"], H200, 128, 1, 1, False)
    assert small.fwd == host and small.bwd == 2 * host
    large = layer_cost(LLAMA_8B, H200, 8192, 1, 1, False)
    without_host = layer_cost(LLAMA_8B, dataclasses.replace(H200, host=HostOverheads()), 8192, 1, 1, False)
    assert large.fwd == without_host.fwd > host and large.bwd == without_host.bwd
    assert large.recompute["full"] == without_host.recompute["full"]
    # the selective rerun recomputes half the GEMMs behind a Python decision per op: host-bound even here
    assert large.recompute["selective"] > without_host.recompute["selective"]


def test_selective_recompute_pays_its_policy_on_the_forward_and_the_rerun():
    tiny = MODEL_PRESETS["tiny-llama"]
    h = H200.host
    cost = layer_cost(tiny, H200, 128, 1, 1, False)
    rerun = h.layer_overhead_s + h.recompute_layer_overhead_s
    assert cost.recompute["full"] == pytest.approx(rerun)
    assert cost.recompute["selective"] == pytest.approx(rerun + 2 * h.selective_layer_overhead_s)
    assert cost.recompute["selective"] > cost.recompute["full"]  # what the H200 grid measured at small sizes


def _one_gpu(precision: str, **plan) -> Plan:
    return Plan.of(model=MODEL_PRESETS["llama3-8b"].replace(num_layers=4), cluster=H200.with_devices(1),
                   micro_batch=1, train=TrainSpec(global_batch=1, seq_len=1024, precision=precision), **plan)


def test_autocast_keeps_a_16_bit_copy_of_every_weight_through_the_step():
    bf16, fp32 = predict(_one_gpu("bf16")), predict(_one_gpu("fp32"))
    params = _one_gpu("bf16").model.num_params
    assert bf16.memory_parts["params"] == pytest.approx(6 * params)  # fp32 parameter + its bf16 copy
    assert fp32.memory_parts["params"] == pytest.approx(4 * params)


def test_the_optimizer_step_runs_at_the_presets_memory_bandwidth():
    params = 1.4e9
    assert optimizer_time(H200, params) == pytest.approx(ADAM_BYTES_PER_PARAM * params * 309 / 989e12)
    default = dataclasses.replace(H200, efficiency=Efficiency(matmul=0.76))
    assert optimizer_time(default, params) == pytest.approx(ADAM_BYTES_PER_PARAM * params * MACHINE_BALANCE["cuda"]
                                                            / 989e12)
    with pytest.raises(ValueError, match="memory_balance"):
        Efficiency(memory_balance=-1.0)


def test_every_gpu_preset_carries_plaits_host_time_and_its_bandwidth_but_published_runs_do_not():
    from published import their_software
    from plait.spec.clusters import GPU_HOST

    assert CPU.host == HostOverheads() and CPU.efficiency.memory_balance == 0.0
    for name, preset in CLUSTER_PRESETS.items():
        if preset.device_type == "cuda":
            assert preset.host == GPU_HOST, name
            assert their_software(preset).host == HostOverheads(), name
            assert preset.efficiency.memory_balance > MACHINE_BALANCE["cuda"], name


def test_cuda_ranks_default_to_expandable_segments_unless_the_user_chose(monkeypatch):
    from plait.runtime.launch import cuda_allocator_defaults

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cuda_allocator_defaults()
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    cuda_allocator_defaults()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
