"""What a Hugging Face class keeps for backward, priced from the class measured on meta (plait.models.saved_bytes),
against (1) what its source says it keeps beyond plait's reference layer of the same shape, at the published sizes,
and (2) what PyTorch's memory tracker sees a scaled-down block keep on CPU, at several sequence lengths: linear in
the sequence, since the run's attention is the fused kernel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.cost.activations import Dtypes, activation_bytes
from plait.cost.model import reference_twin
from plait.models.adapter import get_module
from plait.spec import ModelSpec
from plait.spec.load import load_model
from plait.torch_internals import MemTracker, tree_leaves

HF = Path(__file__).resolve().parents[2] / "examples" / "hf"
HALF = Dtypes(compute=2, residual=2)  # fully_shard's mixed precision
AUTOCAST = Dtypes(compute=2, residual=4)  # one replica, DDP: 16-bit matmuls over fp32 parameters


def class_extra_per_token(family: str, model: ModelSpec, mode: str, dtypes: Dtypes) -> float:
    """Bytes per token one layer of the class keeps beyond plait's reference layer, read off transformers' source.

    * RMSNorm (Llama, Mistral, Qwen2/3): `hidden_states.to(float32)` is kept by its pow and mul: from a 16-bit input
      an fp32 copy (4h) and, normalized, `.to(input_dtype)` (2h) and its fp32 statistic, where plait's norm keeps the
      input alone (2h): 4h + 4 more per norm. Over an fp32 residual both keep the same, but the norm's output stays
      fp32 and each linear that reads it casts its own 16-bit copy (q, k, v; gate, up): 2 + 1 more copies.
      Qwen3's q/k norms over head_dim keep the same upcasts of their (q + kv)-wide input.
    * GemmaRMSNorm normalizes in fp32 and scales before casting back: it keeps its fp32 normalized output too.
    * GPT-2's gelu_new, 0.5·x·(1 + tanh(c·(x + 0.044715·x³))), keeps its tanh output, 0.5·x and 1 + tanh (3f); its
      fused q|k|v GEMM is the first GEMM selective recompute saves, 3h wide where the reference layer saves q (h).
    """
    h, c = model.hidden_size, dtypes.compute
    if family == "gpt2":
        return 3 * model.ffn_hidden_size * c if mode == "none" else h * c if mode == "selective" else 0.0
    if mode != "none":
        return 0.0
    qk = 4 * (model.q_size + model.kv_size) + 4 * (model.num_heads + model.num_kv_heads) if model.qk_norm else 0
    if dtypes.residual == 4:
        return 3 * h * c + qk
    norm = 6 * h + 4 if family == "gemma-7b" else 4 * h + 4
    return 2 * norm + qk


@pytest.mark.parametrize("family", ["llama-3-8b", "mistral-7b", "qwen2-0.5b", "qwen3-8b", "gemma-7b", "gpt2"])
def test_the_class_keeps_what_its_source_says(family):
    model = load_model(str(HF / family))
    twin = reference_twin(model)
    assert twin is not None
    seq = 8192
    for mode in ("none", "selective"):
        for dtypes in (HALF, AUTOCAST):
            beyond = (activation_bytes(model, 1, seq, 1, False, mode, dtypes)
                      - activation_bytes(twin, 1, seq, 1, False, mode, dtypes)) / seq
            expected = class_extra_per_token(family, model, mode, dtypes)
            assert beyond == pytest.approx(expected, abs=1e-6 * activation_bytes(twin, 1, 1, 1, False, mode, dtypes)), \
                (mode, dtypes)


TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=128, max_position_embeddings=512)
TINY_GPT2 = dict(n_embd=64, n_inner=None, n_layer=1, n_head=4, vocab_size=128, n_positions=512)
TINY_MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def tiny_config(family: str, directory: Path) -> Path:
    """The published config.json of `family` at a tiny width (its class, its activation, its norms)."""
    config = json.loads((HF / family / "config.json").read_text())
    config.update(TINY_GPT2 if family == "gpt2" else TINY)
    if config.get("num_local_experts") or config.get("num_experts"):
        config.update({k: v for k, v in TINY_MOE.items() if k in config})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def tracked_bytes(directory: Path, seq: int, precision: str) -> float:
    """Bytes a forward of the class's first layer on CPU leaves held, as MemTracker counts them: its output and
    (under autocast) the weights' cached 16-bit copies left out; the rotary tables its model hands it made outside,
    its input inside (as benchmarks/memory_accuracy.py counts a stack of blocks)."""
    from plait.hf.adapter import HFAdapter
    from plait.hf.structure import around_layers

    torch.manual_seed(0)
    adapter = HFAdapter(ModelSpec(name="tiny", source=f"hf:{directory}", num_layers=1, hidden_size=1, num_heads=1,
                                  vocab_size=1))
    model = adapter.build("cpu")
    dtype = torch.bfloat16 if precision == "16bit" else torch.float32
    model.to(dtype)
    block = get_module(model, adapter.blocks_path)[0]
    hidden = int(adapter.hf_config().hidden_size)
    calls, _ = around_layers(adapter.model_class, model, blocks_path=adapter.blocks_path, num_layers=1,
                             pre=adapter.pre, positions=torch.arange(seq),
                             hidden=torch.zeros(1, seq, hidden, dtype=dtype), stop_at=0,
                             causal_mask=adapter.needs_causal_mask)
    _, args, kwargs = calls[0]
    x = torch.randn(1, seq, hidden, dtype=dtype, requires_grad=True)
    tracker = MemTracker()
    tracker.track_external(model, x, *[t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast")
    with tracker, autocast:
        before = tracker.get_tracker_snapshot()
        y = x * 1.0  # made inside: held only where the layer keeps its input
        out = block(y, *args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        del y  # held now only if the layer keeps it
        after = tracker.get_tracker_snapshot()
    device = next(iter(after))
    copies = 2 * sum(p.numel() for p in block.parameters() if p.dim() >= 2) if precision == "autocast" else 0
    return after[device]["Total"] - before[device].get("Total", 0) - out.nbytes - copies


PRECISIONS = {"fp32": Dtypes(4, 4), "16bit": HALF, "autocast": AUTOCAST}


@pytest.mark.parametrize("family", ["llama-3-8b", "qwen2-0.5b", "qwen3-8b", "gemma-7b", "gpt2"])
def test_a_scaled_down_block_keeps_what_is_priced(family, tmp_path):
    directory = tiny_config(family, tmp_path)
    model = load_model(str(directory))
    for precision, dtypes in PRECISIONS.items():
        measured = {seq: tracked_bytes(directory, seq, precision) for seq in (64, 128, 256)}
        for seq, held in measured.items():
            priced = activation_bytes(model, 1, seq, 1, False, "none", dtypes)
            assert priced == pytest.approx(held, rel=0.02), (precision, seq)
        assert measured[256] == pytest.approx(2 * measured[128], rel=0.02) == pytest.approx(4 * measured[64], rel=0.02)


@pytest.mark.parametrize("family", ["llama-3-8b", "qwen3-8b", "gemma-7b", "gpt2", "mixtral-8x7b"])
def test_measured_bytes_per_token_do_not_grow_with_the_sequence(family):
    """On meta SDPA takes its math path, which keeps the s x s probabilities; the run takes the fused kernel, and so
    does the measurement: a block keeps the same bytes per token at 2K and at 128K tokens, in every precision."""
    model = load_model(str(HF / family))
    assert all(block.activation_bytes_per_token_position == 0 for block in model.blocks)
    for dtypes in PRECISIONS.values():
        short, long = (activation_bytes(model, 1, seq, 1, False, "none", dtypes) / seq for seq in (2048, 131072))
        assert long == pytest.approx(short, rel=1e-9)


def test_cpu_sdpa_takes_the_kernel_the_measurement_takes():
    """What the measurement sends SDPA to on meta is what a CPU run dispatches to (torch 2.13): the fused CPU kernel,
    keys and values kept at their own head count."""
    q = torch.randn(1, 4, 32, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 32, 16, requires_grad=True) for _ in range(2))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"


@pytest.mark.parametrize("precision", ["fp32", "16bit"])
def test_experts_measured_batched_keep_what_the_eager_loop_saves(precision, tmp_path):
    """transformers' experts are measured in their batched form on meta (the eager loop needs real routing) and
    corrected to the eager loop the run takes (plait.hf.spec._eager_loop_bytes); on a scaled-down Mixtral run
    for real on CPU, the eager loop's saved tensors (each storage once, weights and the model's tables left out) are
    the bytes priced, to the byte."""
    from plait.hf.adapter import HFAdapter
    from plait.hf.structure import around_layers

    directory = tiny_config("mixtral-8x7b", tmp_path)
    model = load_model(str(directory))
    adapter = HFAdapter(ModelSpec(name="tiny", source=f"hf:{directory}", num_layers=1, hidden_size=1, num_heads=1,
                                  vocab_size=1))
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "16bit" else torch.float32
    built = adapter.build("cpu").to(dtype)
    block = get_module(built, adapter.blocks_path)[0]
    seq, hidden = 64, model.hidden_size
    calls, _ = around_layers(adapter.model_class, built, blocks_path=adapter.blocks_path, num_layers=1,
                             pre=adapter.pre, positions=torch.arange(seq), hidden=torch.zeros(1, seq, hidden, dtype=dtype),
                             stop_at=0, causal_mask=False)
    _, args, kwargs = calls[0]
    outside = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *tree_leaves((args, kwargs))]
               if isinstance(t, torch.Tensor)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in outside:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(torch.randn(1, seq, hidden, dtype=dtype, requires_grad=True), *args, **kwargs)
    assert sum(kept.values()) == activation_bytes(model, 1, seq, 1, False, "none", PRECISIONS[precision])


class _Scores(torch.nn.Module):
    """Attention written out: it keeps its s x s probabilities (or, `chunk`-wise, each chunk's square only)."""

    def __init__(self, chunk: int | None = None) -> None:
        super().__init__()
        self.proj, self.chunk = torch.nn.Linear(16, 16), chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x)
        if self.chunk:
            q = q.reshape(q.shape[0], -1, self.chunk, q.shape[-1])
        probs = torch.softmax(q @ q.transpose(-1, -2), dim=-1)
        return (probs @ q).reshape(x.shape)


def test_bytes_that_keep_growing_are_priced_growing_and_a_chunked_square_flat():
    """A block keeping its s x s scores grows per token with the sequence and is priced so at any length; one keeping
    a fixed chunk's square grows only up to the chunk: priced flat at its longest measured length, not extrapolated."""
    from plait.models.measure import measure_block

    quadratic, chunked = (measure_block(_Scores(chunk).to("meta"), 16) for chunk in (None, 64))
    # per position: one probability (fp32, or 16 bits); per token at 64: its input, q and 64 probabilities
    assert quadratic.activation_bytes_per_token_position == 4.0
    assert quadratic.half_activation_bytes_per_token_position == 2.0
    assert quadratic.activation_bytes_per_token == 4 * (16 + 16 + 64)
    assert chunked.activation_bytes_per_token_position == chunked.half_activation_bytes_per_token_position == 0
    assert chunked.activation_bytes_per_token == 4 * (16 + 16 + 64)  # each chunk's square, at every length
    assert chunked.half_activation_bytes_per_token == 2 * (16 + 16 + 64)
