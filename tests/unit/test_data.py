"""The byte tokenizer, token sources and the sharded, resumable loader."""

import dataclasses
import json

import numpy as np
import pytest

from plait.errors import ConfigError
from plait.train.data import BatchLoader, ByteTokenizer, check_vocab, load_tokens, token_dtype


def _stream(n: int = 5000) -> np.ndarray:
    return np.arange(n, dtype=np.int64) % 251


def test_tokenizer_round_trips_text_and_survives_cut_characters():
    tok = ByteTokenizer()
    text = "Now is the winter of our discontent — été"
    ids = tok.encode(text)
    assert ids.max() < tok.vocab_size and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # half of 'é'


def test_shipped_text_is_there_and_long_enough():
    tokens = load_tokens("shipped")
    assert len(tokens) > 200_000
    assert "First Citizen" in ByteTokenizer().decode(tokens[:100])


def test_dp_shards_are_disjoint_blocks_of_the_single_process_batch():
    tokens = _stream()
    whole = BatchLoader(tokens, global_batch=8, seq_len=16, seed=3)
    shards = [BatchLoader(tokens, global_batch=8, seq_len=16, seed=3, dp_rank=r, dp_degree=4) for r in range(4)]
    for _ in range(5):
        x, y = whole.next_batch()
        parts = [s.next_batch() for s in shards]
        assert all(p[0].shape == (2, 16) for p in parts)
        assert np.array_equal(np.concatenate([p[0].numpy() for p in parts]), x.numpy())
        assert np.array_equal(np.concatenate([p[1].numpy() for p in parts]), y.numpy())
        assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())  # targets are tokens shifted by one


def test_order_is_deterministic_from_seed_and_differs_between_seeds():
    tokens = _stream()
    a = BatchLoader(tokens, global_batch=4, seq_len=16, seed=1).next_batch()[0]
    b = BatchLoader(tokens, global_batch=4, seq_len=16, seed=1).next_batch()[0]
    c = BatchLoader(tokens, global_batch=4, seq_len=16, seed=2).next_batch()[0]
    assert np.array_equal(a.numpy(), b.numpy()) and not np.array_equal(a.numpy(), c.numpy())


def test_resume_continues_exactly_across_epochs():
    tokens = _stream(700)  # 43 windows of 16 -> 5 batches of 8 per epoch
    run = BatchLoader(tokens, global_batch=8, seq_len=16, seed=0)
    reference = [run.next_batch()[0].numpy() for _ in range(12)]
    first = BatchLoader(tokens, global_batch=8, seq_len=16, seed=0)
    for _ in range(7):
        first.next_batch()
    state = first.state_dict()
    assert state["epoch"] == 1
    resumed = BatchLoader(tokens, global_batch=8, seq_len=16, seed=0, dp_rank=1, dp_degree=2)
    resumed.load_state_dict(state)
    for step in range(7, 12):
        assert np.array_equal(resumed.next_batch()[0].numpy(), reference[step][4:])


def test_resume_refuses_another_batch_shape():
    loader = BatchLoader(_stream(), global_batch=8, seq_len=16)
    state = loader.state_dict() | {"global_batch": 4}
    with pytest.raises(ConfigError, match="global_batch=4"):
        loader.load_state_dict(state)


@pytest.mark.parametrize("dtype,name", [("uint16", "train.u16.bin"), ("uint32", "train.uint32.bin")])
def test_token_file_dtype_from_suffix(tmp_path, dtype, name):
    ids = (np.arange(1000) * 7 % 300).astype(dtype)
    path = tmp_path / name
    ids.tofile(path)
    tokens = load_tokens("tokens", str(path))
    assert tokens.dtype == np.dtype(dtype) and np.array_equal(np.asarray(tokens), ids)


def test_token_file_dtype_from_flag_and_unknown_suffix(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(100, dtype=np.uint32).tofile(path)
    assert np.array_equal(np.asarray(load_tokens("tokens", str(path), "uint32")), np.arange(100))
    with pytest.raises(ConfigError, match="data.dtype"):
        load_tokens("tokens", str(path))
    with pytest.raises(ConfigError, match="dtype"):
        assert token_dtype(path, "auto")


def test_token_file_of_odd_size_is_refused(tmp_path):
    path = tmp_path / "t.u32.bin"
    path.write_bytes(b"\x00" * 10)
    with pytest.raises(ConfigError, match="multiple of 4"):
        load_tokens("tokens", str(path))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokens("text", str(tmp_path / "nope.txt"))
    with pytest.raises(ConfigError, match="needs data.path"):
        load_tokens("text", None)


def test_too_short_says_how_many_tokens_are_needed():
    with pytest.raises(ConfigError, match="needs at least 1025 tokens"):
        BatchLoader(_stream(1000), global_batch=8, seq_len=128)


def test_ids_beyond_the_vocabulary_are_refused():
    with pytest.raises(ConfigError, match="token id 299"):
        check_vocab(np.array([1, 299]), 256)


def test_user_text_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello plait " * 100)
    x, y = BatchLoader(load_tokens("text", str(path)), global_batch=2, seq_len=8).next_batch()
    assert ByteTokenizer().decode(x[0]).strip(" helopait") == ""


# ---- tokenizers, JSON lines, packing and the token cache ------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained here (nothing downloaded): ids 0 <s> (prepended), 1 </s>."""
    from plait.hf.tiny import train_tokenizer
    from plait.train.data import shipped_text_path

    text = shipped_text_path().read_text(encoding="utf-8")[:30_000]
    return train_tokenizer([text], 300, tmp_path_factory.mktemp("tokenizer"))


def _model(vocab_size: int = 300, source: str = "plait"):
    from plait.spec.models import MODEL_PRESETS

    return MODEL_PRESETS["tiny-gpt"].replace(vocab_size=vocab_size, source=source)


def _config(tmp_path, **data):
    from plait.train.config import config_from_dict

    return config_from_dict({"data": data, "log": {"dir": str(tmp_path / "log")}})


def _jsonl(path, *docs, key="text"):
    path.write_text("".join(json.dumps({key: d}) + "\n" for d in docs))
    return path


def test_tokenizer_json_round_trips_and_gives_transformers_ids(tokenizer_dir):
    from transformers import AutoTokenizer

    from plait.train.data import load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    text = "Now is the winter of our discontent — été\n\tDONE"
    ids = tok.encode_documents([text])[0]
    assert (tok.vocab_size, tok.eos_id, ids[0]) == (300, 1, 0)  # <s> starts the document, </s> ends documents
    assert tok.decode(ids[1:]) == text, "byte-level BPE is lossless"
    assert ids.tolist() == AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)(text).input_ids


def test_documents_are_packed_with_eos_between(tmp_path, tokenizer_dir):
    from plait.train.data import cached_tokens, load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    path = _jsonl(tmp_path / "d.jsonl", "First Citizen:", "", "Before we proceed")  # the empty one is skipped
    path.write_text(path.read_text() + "\n   \n")  # blank lines too
    tokens = np.asarray(cached_tokens(path, "jsonl", tok, tmp_path / "cache"))
    first, second = tok.encode_documents(["First Citizen:", "Before we proceed"])
    from plait.train.chat import ID_BITS
    from plait.train.documents import DOC_START, document_starts

    assert (tokens & ID_BITS).tolist() == [*first, tok.eos_id, *second]
    assert document_starts(tokens).tolist() == [0, len(first) + 1]  # each document's first token flagged
    assert int(tokens[0]) & DOC_START and not int(tokens[len(first)]) & DOC_START  # the EOS ends the first


def test_byte_tokenizer_separates_documents_with_nul_and_leaves_text_files_as_they_are(tmp_path):
    from plait.train.data import training_tokens

    path = _jsonl(tmp_path / "d.jsonl", "ab", "cé")
    tokens = training_tokens(_config(tmp_path, source="jsonl", path=str(path)), _model())
    assert bytes(np.asarray(tokens, dtype=np.uint8)) == "ab\0cé".encode()
    text = tmp_path / "t.txt"
    text.write_bytes(b"raw \xff bytes")  # not UTF-8: the byte tokenizer takes any file, and caches nothing
    config = _config(tmp_path, source="text", path=str(text), cache_dir=str(tmp_path / "c2"))
    assert bytes(np.asarray(training_tokens(config, _model()), dtype=np.uint8)) == b"raw \xff bytes"
    assert not (tmp_path / "c2").exists()


def test_cache_is_reused_and_follows_content_and_tokenizer(tmp_path, tokenizer_dir, monkeypatch):
    from plait.train import data
    from plait.train.data import training_tokens

    path = _jsonl(tmp_path / "d.jsonl", "To be, or not to be", "that is the question")
    config = _config(tmp_path, source="jsonl", path=str(path), tokenizer=str(tokenizer_dir))
    first = np.asarray(training_tokens(config, _model())).copy()
    entries = sorted((tmp_path / "log" / "tokens").glob("*.npy"))
    assert len(entries) == 1 and json.loads(entries[0].with_suffix(".json").read_text())["documents"] == 2

    real_pack = data.pack_documents
    monkeypatch.setattr(data, "pack_documents", lambda *a, **k: pytest.fail("tokenized again"))
    assert np.array_equal(training_tokens(config, _model()), first), "read from the cache"

    monkeypatch.setattr(data, "pack_documents", real_pack)
    _jsonl(path, "To be, or not to be", "that is NOT the question")  # new content: a new entry
    changed = np.asarray(training_tokens(config, _model()))
    assert len(sorted((tmp_path / "log" / "tokens").glob("*.npy"))) == 2 and not np.array_equal(changed, first)
    bytes_config = config.replace(data=dataclasses.replace(config.data, tokenizer="byte"))
    as_bytes = np.array(training_tokens(bytes_config, _model()))
    assert len(sorted((tmp_path / "log" / "tokens").glob("*.npy"))) == 3 and (as_bytes & ((1 << 30) - 1)).max() < 256

    entry = next(p for p in (tmp_path / "log" / "tokens").glob("*.npy")
                 if json.loads(p.with_suffix(".json").read_text())["tokenizer"] == "byte")
    entry.write_bytes(entry.read_bytes()[:20])  # a damaged entry (a copy cut short) is tokenized again
    assert np.array_equal(training_tokens(bytes_config, _model()), as_bytes)
    assert len(entry.read_bytes()) > 20


@pytest.mark.parametrize("lines, message", [
    (['{"text": "a"}', '{"text": "b"}', '{"text": "c"'], "line 3 is not valid JSON"),
    (['{"text": "a"}', '{"body": "b"}'], "line 2 has no key 'text' .*'body'.*data.text_key"),
    (['{"text": 3}'], "line 1: 'text' is a int, not a string"),
    (['["text"]'], "line 1 has no key 'text' .*JSON list"),
    (["", "  "], "holds no text"),
])
def test_json_lines_errors_name_the_line(tmp_path, lines, message):
    from plait.train.data import training_tokens

    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=message) as error:
        training_tokens(_config(tmp_path, source="jsonl", path=str(path)), _model())
    assert str(path) in str(error.value) and error.value.exit_code == 2


def test_text_key_is_configurable_and_missing_or_empty_files_are_named(tmp_path):
    from plait.train.data import training_tokens

    path = _jsonl(tmp_path / "d.jsonl", "hello", key="body")
    tokens = training_tokens(_config(tmp_path, source="jsonl", path=str(path), text_key="body"), _model())
    assert bytes(np.asarray(tokens, dtype=np.uint8)) == b"hello"
    with pytest.raises(ConfigError, match="does not exist"):
        training_tokens(_config(tmp_path, source="jsonl", path=str(tmp_path / "none.jsonl")), _model())
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="empty.jsonl.*is empty"):
        training_tokens(_config(tmp_path, source="jsonl", path=str(tmp_path / "empty.jsonl")), _model())
    with pytest.raises(ConfigError, match="needs data.path"):
        training_tokens(_config(tmp_path, source="jsonl"), _model())


def test_data_shorter_than_one_batch_is_named_before_launch(tmp_path, tokenizer_dir):
    from plait.train.resolve import check_data

    path = _jsonl(tmp_path / "d.jsonl", "a few words", "and a few more")
    config = _config(tmp_path, source="jsonl", path=str(path), tokenizer=str(tokenizer_dir))
    with pytest.raises(ConfigError, match=r"d.jsonl.*needs at least \d+ tokens"):
        check_data(config, _model())


def test_tokenizer_and_model_vocabularies_must_fit(tmp_path, tokenizer_dir):
    from plait.train.data import training_tokens

    path = _jsonl(tmp_path / "d.jsonl", "hello")
    with pytest.raises(ConfigError, match="vocabulary of 300, the model's is 256"):
        training_tokens(_config(tmp_path, source="jsonl", path=str(path), tokenizer=str(tokenizer_dir)),
                        _model(256))
    with pytest.raises(ConfigError, match="not \"byte\" nor a folder holding tokenizer.json"):
        training_tokens(_config(tmp_path, source="jsonl", path=str(path), tokenizer=str(tmp_path)), _model())


def test_a_hugging_face_model_defaults_to_its_own_tokenizer(tmp_path, tokenizer_dir):
    import shutil

    from plait.hf.tiny import write_tiny_config
    from plait.spec.load import load_model
    from plait.train.data import load_tokenizer, training_tokens

    folder = write_tiny_config("llama", tmp_path / "model", vocab_size=300)
    spec = load_model(str(folder))
    config = _config(tmp_path, source="shipped")
    with pytest.raises(ConfigError, match="does not fit the model's vocabulary of 67.*set data.tokenizer .now 'byte'"):
        training_tokens(config, spec.replace(vocab_size=67))  # no tokenizer.json there: bytes, which do not fit
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    tokens = training_tokens(config, spec)
    assert tokens[0] == 0 and tokens.max() < 300 and len(tokens) < len(load_tokens("shipped"))
    assert load_tokenizer(None, folder).decode(tokens[1:]) == load_tokens("shipped").tobytes().decode()


def test_dp_shards_of_tokenized_data_union_to_the_single_process_batch(tmp_path, tokenizer_dir):
    from plait.train.data import training_tokens

    docs = [f"Document {i}: " + "the quality of mercy is not strained " * (i % 5 + 1) for i in range(60)]
    path = _jsonl(tmp_path / "d.jsonl", *docs)
    tokens = training_tokens(_config(tmp_path, source="jsonl", path=str(path), tokenizer=str(tokenizer_dir)),
                             _model())
    assert isinstance(tokens, np.memmap) or isinstance(getattr(tokens, "base", None), np.memmap)
    whole = BatchLoader(tokens, global_batch=4, seq_len=16, seed=7)
    shards = [BatchLoader(tokens, global_batch=4, seq_len=16, seed=7, dp_rank=r, dp_degree=2) for r in range(2)]
    for _ in range(3):
        x, _ = whole.next_batch()
        assert np.array_equal(np.concatenate([s.next_batch()[0].numpy() for s in shards]), x.numpy())
