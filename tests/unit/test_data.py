"""The byte tokenizer, token sources and the sharded, resumable loader."""

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
