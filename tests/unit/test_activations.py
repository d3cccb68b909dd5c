"""plait.cost.activations against what autograd really saves in plait's reference block (CPU, fp32 and bf16, tiny
shapes): the cost model's list of kept tensors is the executor's, byte for byte."""

from __future__ import annotations

import pytest
import torch

from plait.cost.activations import Dtypes, activation_bytes
from plait.models.reference import TransformerBlock, rope_tables
from plait.spec import ModelSpec

FP32 = Dtypes(compute=4, residual=4)
BF16 = Dtypes(compute=2, residual=2)  # fully_shard's mixed precision: bf16 parameters and residual stream
SPECS = {
    "gpt": ModelSpec(arch="gpt", num_layers=1, hidden_size=64, num_heads=8, ffn_hidden_size=96, vocab_size=64),
    "llama-gqa": ModelSpec(arch="llama", num_layers=1, hidden_size=64, num_heads=8, num_kv_heads=2,
                           ffn_hidden_size=96, vocab_size=64),
    "qwen3-like": ModelSpec(arch="llama", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=24,
                            qk_norm=True, bias="qkv", ffn_hidden_size=96, vocab_size=64),
    "gemma-like": ModelSpec(arch="llama", mlp="geglu", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=1,
                            ffn_hidden_size=96, vocab_size=64),
}


def saved_bytes(spec: ModelSpec, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> float:
    """Bytes of the distinct storages autograd keeps over one block's forward, parameters and the rotary tables
    (one per pipeline stage, shared by its blocks) left out."""
    torch.manual_seed(0)
    block = TransformerBlock(spec).to(dtype)
    x = torch.randn(batch, seq, spec.hidden_size, dtype=dtype, requires_grad=True)
    rope = rope_tables(torch.arange(seq), spec.head_dim, spec.rope_theta) if spec.positions == "rope" else None
    shared = {p.untyped_storage().data_ptr() for p in block.parameters()}
    shared |= {t.untyped_storage().data_ptr() for t in rope or ()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in shared:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rope) if rope is not None else block(x)
    return float(sum(kept.values()))


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("attention", ["fused", "math"])
def test_block_keeps_what_the_cost_model_counts(name, attention):
    spec = SPECS[name].replace(attention=attention)
    batch, seq = 2, 48
    assert saved_bytes(spec, batch, seq) == pytest.approx(activation_bytes(spec, batch, seq, 1, False, "none", FP32))


@pytest.mark.parametrize("name", sorted(set(SPECS) - {"gpt"}))
def test_bf16_block_keeps_what_the_cost_model_counts(name):
    """In bf16 the RMSNorms keep their 16-bit input alone (no fp32 copy, no normalized tensor, no statistic):
    what the cost model prices for torchtitan's Llama 2 13B row. (Not GPT: CPU's bf16 LayerNorm keeps its two
    statistics in bf16, CUDA's, which the cost model prices, in fp32.)"""
    spec = SPECS[name]
    assert saved_bytes(spec, 2, 48, torch.bfloat16) == pytest.approx(activation_bytes(spec, 2, 48, 1, False, "none", BF16))


def test_the_math_path_keeps_the_probabilities_and_the_fused_one_does_not():
    """The fused block keeps bytes linear in s; the math path adds the s x s probabilities (and keys and values
    repeated to every query head), less the fused kernel's logsumexp."""
    spec = SPECS["llama-gqa"]
    a, q, kv = spec.num_heads, spec.q_size, spec.kv_size
    for seq in (32, 64):
        fused, math = saved_bytes(spec, 1, seq), saved_bytes(spec.replace(attention="math"), 1, seq)
        assert math - fused == seq * 4 * (a * seq + 2 * (q - kv) - a)
    assert saved_bytes(spec, 1, 64) == 2 * saved_bytes(spec, 1, 32)


AUTOCAST = Dtypes(compute=2, residual=4)  # one replica / DDP: bf16 autocast over fp32 parameters


def autocast_saved(spec: ModelSpec, batch: int, seq: int) -> tuple[float, float]:
    """(activation bytes, bf16 weight copies) a fp32 block keeps for backward under CPU autocast to bf16."""
    torch.manual_seed(0)
    block = TransformerBlock(spec)
    x = torch.randn(batch, seq, spec.hidden_size, requires_grad=True)
    rope = rope_tables(torch.arange(seq), spec.head_dim, spec.rope_theta) if spec.positions == "rope" else None
    shared = {p.untyped_storage().data_ptr() for p in block.parameters()}
    shared |= {t.untyped_storage().data_ptr() for t in rope or ()}
    weights = {shape for p in block.parameters() if p.dim() == 2 for shape in (tuple(p.shape), tuple(p.shape)[::-1])}
    kept: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in shared:  # a weight's autocast copy: 2-D, bf16, a weight's shape
            copy = t.dtype == torch.bfloat16 and tuple(t.shape) in weights  # saved as is or transposed
            kept[storage.data_ptr()] = (storage.nbytes(), copy)
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rope) if rope is not None else block(x)
    return (float(sum(n for n, copy in kept.values() if not copy)), float(sum(n for n, copy in kept.values() if copy)))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_autocast_block_keeps_one_copy_of_each_norm_output(name):
    """Under autocast (bf16 over fp32 parameters: the executor's one-replica and DDP path) the norms hand the
    linears one 16-bit output (plait.models.reference.to_compute_dtype): found on an H200, q, k and v had each kept
    their own cast of the fp32 norm output, 6 bytes per hidden unit and token over the cost model's count. The
    weights' 16-bit copies are what plait.cost.memory.autocast_copy_bytes counts: 2 bytes per matmul weight."""
    spec = SPECS[name]
    activations, copies = autocast_saved(spec, 2, 40)  # 80 tokens: no activation of a weight's shape
    assert activations == pytest.approx(activation_bytes(spec, 2, 40, 1, False, "none", AUTOCAST))
    block = TransformerBlock(spec)
    assert copies == 2 * sum(p.numel() for p in block.parameters() if p.dim() == 2)
