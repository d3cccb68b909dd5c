"""The attention a Hugging Face class declares, as plait runs it on one process: sliding windows (every layer, the last
layers, every other layer under the class's eager attention) give the class's own logits at a sequence longer than
the window (its "eager" implementation, masks and all), not full causal attention's; plans longer than the window
are legal for such a class, refused for plait's own decoders, which have none."""

from __future__ import annotations

import pytest
import torch

from plait import legality
from plait.models import adapter_for
from plait.hf.tiny import WINDOWED_CONFIGS, write_tiny_config
from plait.plan import Plan
from plait.spec import TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.load import load_model
from plait.spec.models import MODEL_PRESETS

SEQ = 16  # the windows are 6 tokens


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    root = tmp_path_factory.mktemp("windowed")
    return {family: write_tiny_config(family, root / family) for family in WINDOWED_CONFIGS}


def _class_model(folder, state, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder), **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").double()
    model.load_state_dict(state, strict=False)
    return model.eval()


@pytest.mark.parametrize("family", list(WINDOWED_CONFIGS))
def test_windowed_layers_compute_the_class_own_attention_past_the_window(windowed, family):
    spec = load_model(str(windowed[family]))
    assert spec.sliding_window == 6
    adapter = adapter_for(spec)
    model = adapter.build("cpu")
    adapter.initialize(model, seed=0)
    model.double().eval()
    tokens = torch.randint(0, 60, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = adapter.forward(model, tokens)
        own = _class_model(windowed[family], model.state_dict())(input_ids=tokens).logits
        unwindowed = _class_model(windowed[family], model.state_dict(), sliding_window=4096)(input_ids=tokens).logits
    assert (ours - own).abs().max() < 1e-6
    assert (ours - unwindowed).abs().max() > 1e-3, "the window changes the logits: this test would see it missing"


def _plan(model, seq_len: int, **degrees) -> Plan:
    micro_batches = degrees.get("pp", 1)
    return Plan.of(model=model, cluster=CLUSTER_PRESETS["local-cpu"], micro_batch=1, num_micro_batches=micro_batches,
                   train=TrainSpec(global_batch=degrees.get("dp", 1) * micro_batches, seq_len=seq_len,
                                   precision="fp32"), **degrees)


def test_a_class_with_a_window_plans_any_sequence_and_plait_decoders_are_refused_past_theirs(windowed):
    starcoder = load_model(str(windowed["starcoder2-window"]))
    for degrees in ({"dp": 2}, {"tp": 2}, {"pp": 2}, {"cp": 2}):
        legality.check(_plan(starcoder, 64, **degrees))  # the starcoder2: window 6 here, sequence 64
    own = MODEL_PRESETS["tiny-llama"].replace(sliding_window=8)
    problems = legality.plan_problems(_plan(own, 16))
    assert [p.rule for p in problems] == ["seq-len-within-window"]
    assert "use seq_len <= 8" in problems[0].message
    assert not legality.plan_problems(_plan(own, 8))


@pytest.mark.parametrize("seq,window,kv_heads", [(16, 5, 2), (23, 4, 4), (40, 6, 1)])
def test_band_by_band_attention_equals_sdpa_over_the_whole_masked_square(seq, window, kv_heads):
    """Forward and backward, a window with packed documents on top, grouped keys, a sequence not a whole number of
    chunks (its padded queries must not turn a softmax row empty)."""
    import torch.nn.functional as F

    from plait.models.windows import banded_attention

    generator = torch.Generator().manual_seed(seq)
    q = torch.randn(2, 4, seq, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, generator=generator, requires_grad=True)
            for _ in range(2))
    behind = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
    documents = (torch.rand(2, seq, generator=generator) < 0.15).cumsum(1)
    same_document = documents[:, None, :, None] == documents[:, None, None, :]
    mask = ((behind >= 0) & (behind < window))[None, None] & same_document
    groups = 4 // kv_heads
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                           attn_mask=mask).transpose(1, 2)
    banded = banded_attention(q, k, v, mask, window)
    torch.testing.assert_close(banded, dense, rtol=0, atol=1e-13)
    weights = torch.randn(dense.shape, dtype=torch.float64, generator=generator)
    for ours, theirs in zip(torch.autograd.grad((banded * weights).sum(), (q, k, v)),
                            torch.autograd.grad((dense * weights).sum(), (q, k, v))):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-13)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2-window"])
def test_packed_documents_each_give_their_own_logits(tmp_path, family, monkeypatch):
    """Three documents in one row, positions restarting at each: every document's logits are those of it alone (its
    attention stays within it; learned positions (GPT-2) and rotary ones restart; a window inside each document).
    Llama's layers are handed the position ids, so they attend document by document (plait.models.windows)."""
    import plait.hf.adapter as hf_module

    by_document = []
    real = hf_module.attention_by_document
    monkeypatch.setattr(hf_module, "attention_by_document", lambda *a, **k: by_document.append(1) or real(*a, **k))
    adapter = adapter_for(load_model(str(write_tiny_config(family, tmp_path / family))))
    assert adapter.takes_positions
    model = adapter.build("cpu")
    adapter.initialize(model, seed=0)
    model.double().eval()
    lengths = (7, 2, 11)  # the last longer than qwen2-window's 6
    tokens = torch.randint(0, 60, (1, sum(lengths)), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = adapter.forward(model, tokens, positions)
        across = adapter.forward(model, tokens)
        start = 0
        for n in lengths:
            alone = adapter.forward(model, tokens[:, start:start + n])
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=0, atol=1e-10)
            start += n
    assert (packed[:, lengths[0]:] - across[:, lengths[0]:]).abs().max() > 1e-3, "attending across differs"
    if family == "llama":
        assert len(by_document) == adapter.num_layers


@pytest.mark.parametrize("rows,seq,kv_heads", [(2, 16, 2), (3, 37, 4)])
def test_document_by_document_attention_equals_sdpa_over_the_block_diagonal_mask(rows, seq, kv_heads):
    import torch.nn.functional as F

    from plait.models.windows import attention_by_document

    generator = torch.Generator().manual_seed(rows * seq)
    q = torch.randn(rows, 4, seq, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    k, v = (torch.randn(rows, kv_heads, seq, 8, dtype=torch.float64, generator=generator, requires_grad=True)
            for _ in range(2))
    documents = (torch.rand(rows, seq, generator=generator) < 0.2).cumsum(1)
    first = torch.cat([torch.ones(rows, 1, dtype=torch.bool), documents[:, 1:] != documents[:, :-1]], dim=1)
    column = torch.arange(seq).expand(rows, seq)
    positions = column - torch.cummax(torch.where(first, column, 0), dim=1).values
    causal = torch.arange(seq)[:, None] >= torch.arange(seq)[None, :]
    mask = causal[None, None] & (documents[:, None, :, None] == documents[:, None, None, :])
    groups = 4 // kv_heads
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                           attn_mask=mask).transpose(1, 2)
    ours = attention_by_document(q, k, v, positions)
    torch.testing.assert_close(ours, dense, rtol=0, atol=1e-13)
    weights = torch.randn(dense.shape, dtype=torch.float64, generator=generator)
    for a, b in zip(torch.autograd.grad((ours * weights).sum(), (q, k, v)),
                    torch.autograd.grad((dense * weights).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
