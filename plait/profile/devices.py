"""Measure one device: GEMM, attention and transformer-block throughput, and free memory.

Every rank runs the same measurement at the same moment (a barrier starts each one and the rank
counts agree), because CPU processes share cores: what matters to a plan is the rate each rank gets
while all of them compute, not the rate of one process alone.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.profile.fit import ComputeSample

# Public dense 16-bit peak FLOP/s by device name (datasheets, without sparsity). CPUs have no such
# figure that plait can trust, so there the fitted large-GEMM asymptote stands in for the peak.
CUDA_PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L4": 121e12,
    "L40S": 362e12,
    "V100": 125e12,
    "T4": 65e12,
}


@dataclass(frozen=True)
class Device:
    """Where and in which precision this rank computes."""

    device: torch.device
    dtype: torch.dtype

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        # CUDA kernels run asynchronously: a wall-clock timer must wait for them.
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def local_device() -> Device:
    """The rank's accelerator in bf16 if there is one, else the CPU in fp32."""
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return Device(torch.device("cuda", index), torch.bfloat16)
    return Device(torch.device("cpu"), torch.float32)


def datasheet_peak_flops(device: Device) -> float | None:
    """Dense 16-bit peak of a known GPU; None for CPUs and GPUs not in the table."""
    if not device.is_cuda:
        return None
    name = torch.cuda.get_device_name(device.device)
    for key, flops in CUDA_PEAK_FLOPS.items():
        if key in name:
            return flops
    return None


# ---- timing -------------------------------------------------------------------------------------

def time_op(fn: Callable[[], object], device: Device, target_s: float, max_reps: int = 50) -> float:
    """Median seconds per call of `fn`, on every rank at once with the same repetition count."""
    # The warm-up call (allocations, kernel selection) also sizes the repetition count; it runs
    # slower than the rest, so it errs towards fewer repetitions, never towards a long profile.
    start = time.perf_counter()
    fn()
    device.sync()
    once = max(time.perf_counter() - start, 1e-9)
    reps = _agree_on_max(min(max_reps, max(1, math.ceil(target_s / once))), device)
    _barrier(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        device.sync()
        times.append(time.perf_counter() - start)
    _barrier(device)
    return _median(times)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _agree_on_max(value: int, device: Device) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _barrier(device: Device) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(device_ids=[device.device.index]) if device.is_cuda else dist.barrier()


# ---- shapes that planned models use -------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ComputeShape:
    """A GPT-style block of width `hidden_size` on `tokens` = micro-batch · sequence tokens."""

    hidden_size: int
    num_heads: int
    seq_len: int
    tokens: int

    @property
    def batch(self) -> int:
        return max(1, self.tokens // self.seq_len)

    def gemms(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of the block's four weight GEMMs (fused q/k/v, out, fc1, fc2)."""
        h = self.hidden_size
        return {"qkv": (h, 3 * h), "proj": (h, h), "fc1": (h, 4 * h), "fc2": (4 * h, h)}

    def attention_flops(self) -> float:
        """Forward + backward FLOPs of Q·Kᵀ and P·V, counted over the full s×s square as Megatron does."""
        return 3 * 4 * self.batch * self.seq_len**2 * self.hidden_size


def compute_shapes(device: Device, quick: bool) -> list[ComputeShape]:
    """tiny-gpt's width (128) and larger ones, up to what a call of ~1 s allows on the device in hand."""
    if device.is_cuda:
        widths = (1024, 4096) if quick else (1024, 2048, 4096, 8192)
        return [ComputeShape(hidden_size=h, num_heads=h // 128, seq_len=2048, tokens=8192) for h in widths]
    widths = (128, 256) if quick else (128, 256, 512, 1024)
    return [ComputeShape(hidden_size=h, num_heads=max(4, h // 64), seq_len=256, tokens=512 if quick else 2048)
            for h in widths]


# ---- measurements -------------------------------------------------------------------------------

def measure_gemm(shape: ComputeShape, name: str, device: Device, target_s: float) -> ComputeSample:
    """Forward + backward of one linear layer: y = x·Wᵀ, then dx and dW (3 GEMMs, 6·T·in·out FLOPs)."""
    fan_in, fan_out = shape.gemms()[name]
    x = torch.randn(shape.tokens, fan_in, device=device.device, dtype=device.dtype, requires_grad=True)
    w = torch.randn(fan_out, fan_in, device=device.device, dtype=device.dtype, requires_grad=True)
    grad = torch.randn(shape.tokens, fan_out, device=device.device, dtype=device.dtype)

    def step() -> None:
        F.linear(x, w).backward(grad)

    seconds = time_op(step, device, target_s)
    return ComputeSample(name=name, hidden_size=shape.hidden_size, flops=6.0 * shape.tokens * fan_in * fan_out,
                         seconds=seconds)


def measure_attention(shape: ComputeShape, device: Device, target_s: float) -> ComputeSample:
    """Forward + backward of causal scaled_dot_product_attention on [b, heads, s, head_dim]."""
    head_dim = shape.hidden_size // shape.num_heads
    dims = (shape.batch, shape.num_heads, shape.seq_len, head_dim)
    q, k, v = (torch.randn(dims, device=device.device, dtype=device.dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(dims, device=device.device, dtype=device.dtype)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    seconds = time_op(step, device, target_s)
    return ComputeSample(name="attention", hidden_size=shape.hidden_size, flops=shape.attention_flops(),
                         seconds=seconds)


def measure_block(shape: ComputeShape, device: Device, target_s: float) -> ComputeSample:
    """Forward + backward of a whole GPT block (LayerNorm, attention, GeLU MLP, residuals).

    Its time against the GEMMs' and attention's says how much the non-GEMM work costs.
    """
    h, b, s = shape.hidden_size, shape.batch, shape.seq_len
    params = _block_params(h, device)
    x = torch.randn(b, s, h, device=device.device, dtype=device.dtype, requires_grad=True)
    grad = torch.randn(b, s, h, device=device.device, dtype=device.dtype)

    def step() -> None:
        _block_forward(x, params, shape.num_heads).backward(grad)

    seconds = time_op(step, device, target_s)
    gemm_flops = sum(6.0 * b * s * i * o for i, o in shape.gemms().values())
    return ComputeSample(name="block", hidden_size=h, flops=gemm_flops + shape.attention_flops(), seconds=seconds)


def _block_params(h: int, device: Device) -> dict[str, torch.Tensor]:
    def param(*dims: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(dims, device=device.device, dtype=device.dtype) * scale).requires_grad_()

    return {"ln1_w": param(h, scale=1.0), "ln1_b": param(h), "qkv_w": param(3 * h, h), "qkv_b": param(3 * h),
            "proj_w": param(h, h), "proj_b": param(h), "ln2_w": param(h, scale=1.0), "ln2_b": param(h),
            "fc1_w": param(4 * h, h), "fc1_b": param(4 * h), "fc2_w": param(h, 4 * h), "fc2_b": param(h)}


def _block_forward(x: torch.Tensor, p: dict[str, torch.Tensor], num_heads: int) -> torch.Tensor:
    b, s, h = x.shape
    y = F.layer_norm(x, (h,), p["ln1_w"], p["ln1_b"])
    q, k, v = F.linear(y, p["qkv_w"], p["qkv_b"]).split(h, dim=-1)  # each [b, s, h]
    q, k, v = (t.view(b, s, num_heads, h // num_heads).transpose(1, 2) for t in (q, k, v))  # [b, a, s, d]
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
    x = x + F.linear(attn, p["proj_w"], p["proj_b"])
    y = F.layer_norm(x, (h,), p["ln2_w"], p["ln2_b"])
    return x + F.linear(F.gelu(F.linear(y, p["fc1_w"], p["fc1_b"])), p["fc2_w"], p["fc2_b"])


# ---- memory -------------------------------------------------------------------------------------

def available_memory_bytes(device: Device, local_world_size: int) -> float:
    """Memory one rank may use: free GPU memory, or this node's available RAM split over its ranks."""
    if device.is_cuda:
        free, _total = torch.cuda.mem_get_info(device.device)
        return float(free)
    return float(host_available_bytes()) / max(1, local_world_size)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo, capped by a cgroup memory limit if the process runs in one."""
    available = _meminfo_available()
    limit = _cgroup_headroom()
    candidates = [v for v in (available, limit) if v is not None]
    if not candidates:  # no /proc (not Linux): the free physical pages POSIX reports
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(candidates)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_headroom() -> int | None:
    """cgroup v2 memory.max minus memory.current; None when unlimited or not in a cgroup."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(0, int(limit) - current)
