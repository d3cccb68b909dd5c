"""Packed documents in the token stream and the rows cut from it ([data] packing, plait.train.documents): their
starts flagged by the packers, position ids restarting at each within a window, one document per padded row, and
"documents" refused in one line for a model whose attention cannot keep them apart."""

from __future__ import annotations

import numpy as np
import pytest

from plait.errors import ConfigError
from plait.models.adapter import IGNORE_INDEX
from plait.train.chat import NO_LOSS
from plait.train.data import BatchLoader, pack_documents
from plait.train.documents import DOC_START, document_starts, packing_for, window_positions


class _Letters:
    """One token per character (a..z -> 2..27), EOS 1: documents' lengths are their texts'."""

    name, identity, vocab_size, eos_id = "letters", "letters", 30, 1

    def encode_documents(self, documents):
        return [np.array([ord(c) - 95 for c in doc], dtype=np.int64) for doc in documents]


def _stream(*lengths: int) -> np.ndarray:
    tokens, count = pack_documents(iter("abcdefghijklmnopqrstuvwxyz"[:n] for n in lengths), _Letters())
    assert count == len(lengths)
    return tokens


def test_the_packers_flag_each_document_start_and_one_document_stays_plain():
    tokens = _stream(3, 4, 2)
    assert tokens.dtype == np.uint32 and document_starts(tokens).tolist() == [0, 4, 9]  # EOS ends each but the last
    single = _stream(5)
    assert single.dtype == np.uint16 and document_starts(single).tolist() == [0]


def test_positions_restart_at_each_document_and_at_the_window_start():
    tokens = _stream(3, 4, 2)  # a b c EOS | a b c d EOS | a b
    rows = np.stack([tokens[0:7], tokens[4:11]])  # windows of 6 inputs + 1 target
    assert window_positions(rows).tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 0]]
    assert window_positions(np.stack([tokens[0:4]])) is None  # no document begins inside: plain positions


def test_the_loader_hands_positions_under_documents_only():
    tokens = _stream(*([5] * 40))
    documents = BatchLoader(tokens, global_batch=4, seq_len=8, seed=1, dp_rank=1, dp_degree=2).next_rows()
    whole = BatchLoader(tokens, global_batch=4, seq_len=8, seed=1).next_rows()
    assert documents.positions is not None and documents.positions.tolist() == whole.positions[2:].tolist()
    assert int(documents.tokens.max()) < 30, "the flags are stripped from the ids"
    stream = BatchLoader(tokens, global_batch=4, seq_len=8, seed=1, packing="stream").next_rows()
    assert stream.positions is None and stream.tokens.tolist() == whole.tokens.tolist()


def test_padded_rows_hold_one_document_each_cut_and_padded_untrained():
    tokens = _stream(3, 12, 5, 7)
    loader = BatchLoader(tokens, global_batch=4, seq_len=8, packing="padded", pad_id=0)
    assert loader.num_windows == 4 and loader.steps_per_epoch == 1
    rows = loader.next_rows()
    assert rows.positions is None
    by_first = {int((row != 0).sum()): (row.tolist(), target.tolist())
                for row, target in zip(rows.tokens, rows.targets)}
    tokens3, targets3 = by_first[4]  # "abc" + EOS, then padding
    assert tokens3[:4] == [2, 3, 4, 1] and targets3[:3] == [3, 4, 1] and set(targets3[3:]) == {IGNORE_INDEX}
    assert 8 in by_first and all(t != IGNORE_INDEX for t in by_first[8][1])  # the long one cut at seq_len + 1
    with pytest.raises(ConfigError, match="too few for one batch"):
        BatchLoader(tokens, global_batch=8, seq_len=8, packing="padded")


def test_chat_flags_and_document_flags_live_together():
    flagged = np.array([2 | int(DOC_START), 3 | int(NO_LOSS), 4, 1 | int(NO_LOSS), 5 | int(DOC_START), 6, 7],
                       dtype=np.uint32)
    rows = BatchLoader(flagged, global_batch=1, seq_len=6).next_rows()
    assert rows.tokens.tolist() == [[2, 3, 4, 1, 5, 6]]
    assert rows.targets.tolist() == [[IGNORE_INDEX, 4, IGNORE_INDEX, 5, 6, 7]]
    assert rows.positions.tolist() == [[0, 1, 2, 3, 0, 1]]


def test_documents_are_refused_for_a_model_that_attends_across_them(tmp_path):
    from plait.hf.tiny import write_tiny_config
    from plait.spec.load import load_model
    from plait.spec.models import MODEL_PRESETS
    from plait.train.config import config_from_dict

    def config(packing=None):
        data = {"source": "shipped"} | ({"packing": packing} if packing else {})
        return config_from_dict({"data": data, "log": {"dir": str(tmp_path / "log")}})

    own, hf = MODEL_PRESETS["tiny-gpt"], load_model(str(write_tiny_config("llama", tmp_path / "llama")))
    assert (packing_for(config(), own), packing_for(config(), hf)) == ("stream", "documents")
    assert packing_for(config("padded"), own) == "padded" and packing_for(config("stream"), hf) == "stream"
    with pytest.raises(ConfigError, match='data.packing = "documents"') as refused:
        packing_for(config("documents"), own)
    assert "\n" not in str(refused.value) and '"stream" or "padded"' in str(refused.value)
    with pytest.raises(ConfigError, match="packing"):
        config_from_dict({"data": {"packing": "sorted"}})


def test_context_parallelism_keeps_documents_apart_only_where_the_attention_sees_positions(tmp_path, monkeypatch):
    from plait.models import adapter_for
    from plait.hf.tiny import write_tiny_config
    from plait.plan import Plan
    from plait.spec import TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.spec.load import load_model
    from plait.train.config import config_from_dict
    from plait.train.documents import check_packing

    model = load_model(str(write_tiny_config("llama", tmp_path / "llama")))
    plan = Plan.of(model=model, cluster=CLUSTER_PRESETS["local-cpu"], cp=2, micro_batch=1, num_micro_batches=1,
                   train=TrainSpec(global_batch=1, seq_len=16, precision="fp32"))
    config = config_from_dict({"data": {"source": "shipped"}, "log": {"dir": str(tmp_path / "log")}})
    assert adapter_for(model).attention_sees_positions  # Llama's layers hand them on
    check_packing(config, plan)
    blind = model.replace(source="plait", name="blind")  # plait's own decoders: "stream" by default, refused asked
    check_packing(config, plan.replace(model=blind))
    with pytest.raises(ConfigError, match='data.packing = "documents"'):
        check_packing(config_from_dict({"data": {"packing": "documents"}}), plan.replace(model=blind))
    from plait.hf.adapter import HFAdapter

    monkeypatch.setattr(HFAdapter, "attention_sees_positions", False)  # a class that keeps them from its attention
    with pytest.raises(ConfigError, match="cp=2: .*not handed its tokens' positions") as refused:
        check_packing(config, plan)
    assert '"padded"' in str(refused.value) and "\n" not in str(refused.value)
    check_packing(config, Plan.of(model=model, cluster=CLUSTER_PRESETS["local-cpu"], micro_batch=1,
                                  num_micro_batches=1, train=plan.train))  # without cp it needs nothing
