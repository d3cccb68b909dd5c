"""Sliding windows priced as their kernels run (plait.cost.attention): the whole causal half up to the window, the
whole square just past it, ~2·s·W scores band by band far past it, in time and in the math path's probabilities."""

from __future__ import annotations

import pytest

from plait.cost.activations import Dtypes, activation_bytes
from plait.cost.attention import computed_square, layer_windows, window_share
from plait.spec.attention import window_kernel
from plait.cost.compute import layer_cost
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.models import MODEL_PRESETS

W = 512


def test_kernel_and_share_of_the_square_by_sequence_length():
    assert [window_kernel(s, W) for s in (W, W + 1, 2 * W, 3 * W, 8 * W)] == ["causal", "dense", "dense", "banded",
                                                                             "banded"]
    assert window_kernel(10 * W, None) == "causal"
    assert computed_square(W, W) == 0.5 and computed_square(W, W, fused=False) == 1.0
    assert computed_square(2 * W, W) == 1.0
    assert computed_square(8 * W, W) == pytest.approx(8 * 2 * W * W / (8 * W) ** 2)  # 1/4: half the causal half


def test_alternating_layers_share_the_discount():
    llama = MODEL_PRESETS["tiny-llama"]
    windowed = llama.replace(sliding_window=W)
    gemma_like = llama.replace(sliding_window=W, full_attention_layers=(1, 3))
    assert layer_windows(gemma_like) == [W, None, W, None]
    assert window_share(llama, 8 * W) == 1.0 and window_share(windowed, W) == 1.0
    assert window_share(windowed, 8 * W) == pytest.approx(0.5)
    assert window_share(gemma_like, 8 * W) == pytest.approx(0.75)


def test_a_window_far_shorter_than_the_sequence_costs_less_time_and_math_memory():
    cluster = CLUSTER_PRESETS["h100-80g"]
    llama = MODEL_PRESETS["llama3-8b"]  # kernel-bound layers (a tiny model's are host-bound)
    windowed = llama.replace(sliding_window=W)
    for seq, cheaper in ((W, False), (8 * W, True)):
        plain, slid = (layer_cost(m, cluster, seq, 1, 1, False).fwd for m in (llama, windowed))
        assert (slid < plain) if cheaper else slid == plain, (seq, plain, slid)
    llama = MODEL_PRESETS["tiny-llama"]
    math = llama.replace(attention="math")
    dtypes = Dtypes(2, 2)
    plain, slid = (activation_bytes(m, 1, 8 * W, 1, False, "none", dtypes)
                   for m in (math, math.replace(sliding_window=W)))
    probabilities = 1 * 8 * W * llama.num_heads * 8 * W * 2  # tokens x heads x s x bytes
    assert plain - slid == pytest.approx(probabilities * 0.75)


def test_packed_documents_are_priced_over_their_own_squares():
    from plait.spec import TrainSpec

    llama, cluster, seq = MODEL_PRESETS["llama3-8b"], CLUSTER_PRESETS["h100-80g"], 8 * W
    assert window_share(llama, seq, document_len=W) == pytest.approx((W + 1) / seq)
    assert window_share(llama, seq, fused=False, document_len=W) == pytest.approx(W / seq)
    assert window_share(llama, seq, document_len=seq) == 1.0  # one document per row
    from plait.cost.compute import Slicing, sliced_layer_cost

    plain, packed, whole = (sliced_layer_cost(llama, cluster, seq, 1, Slicing(), 2, d).fwd for d in (None, W, seq))
    assert packed < plain == whole
    with pytest.raises(ValueError, match="document_len=0"):
        TrainSpec(global_batch=1, seq_len=8, document_len=0)


def test_plait_train_prices_the_mean_document_of_its_data(tmp_path):
    import json

    from plait.hf.tiny import write_tiny_config
    from plait.spec.load import load_model
    from plait.train.config import config_from_dict
    from plait.train.documents import with_document_len

    model = load_model(str(write_tiny_config("llama", tmp_path / "llama", vocab_size=256)))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in (9, 19, 29)))

    def config(**data):
        return config_from_dict({"data": {"source": "jsonl", "path": str(tmp_path / "d.jsonl"), "tokenizer": "byte",
                                          **data}, "log": {"dir": str(tmp_path / "log")}})

    assert with_document_len(config(), model).train.spec().document_len == (9 + 19 + 29 + 2) // 3  # EOS between
    assert with_document_len(config(packing="stream"), model).train.document_len is None
