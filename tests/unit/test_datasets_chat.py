"""[data] source = "hf" (a save_to_disk folder, a parquet file) into the token cache, and chat mode's masking:
the loss on the assistant's tokens only, checked on a hand-made conversation, kept through packing and batching."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.errors import ConfigError
from plait.train.data import BatchLoader, cached_tokens, load_tokenizer, pack_documents

DOCS = ["To be, or not to be, that is the question.", "Whether 'tis nobler in the mind to suffer",
        "The slings and arrows of outrageous fortune."]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who wrote Hamlet?"},
        {"role": "assistant", "content": "Shakespeare."}, {"role": "user", "content": "When?"},
        {"role": "assistant", "content": "Around 1600."}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from plait.hf.tiny import train_tokenizer

    folder = train_tokenizer([" ".join(DOCS) * 20, "Shakespeare Around 1600 Who wrote Hamlet When Be brief"], 300,
                             tmp_path_factory.mktemp("tok"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


def test_a_saved_dataset_folder_and_a_parquet_file_give_the_packed_documents(tmp_path: Path, tokenizer_dir) -> None:
    import datasets

    tokenizer = load_tokenizer(str(tokenizer_dir))
    expected, _ = pack_documents(iter(DOCS), tokenizer)
    table = datasets.Dataset.from_dict({"body": DOCS, "id": [1, 2, 3]})
    table.save_to_disk(str(tmp_path / "folder"))
    table.to_parquet(str(tmp_path / "train.parquet"))
    datasets.DatasetDict({"train": table.select([0]), "validation": table}).save_to_disk(str(tmp_path / "dict"))
    for path, split in ((tmp_path / "folder", "train"), (tmp_path / "train.parquet", "train"),
                        (tmp_path / "dict", "validation")):
        tokens = cached_tokens(path, "hf", tokenizer, tmp_path / "cache", text_key="body", split=split)
        assert np.array_equal(np.asarray(tokens), expected), path
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 3  # one cache entry per dataset
    with pytest.raises(ConfigError, match="no column 'text'.*body"):
        cached_tokens(tmp_path / "train.parquet", "hf", tokenizer, tmp_path / "cache2")
    with pytest.raises(ConfigError, match="no split 'test'"):
        cached_tokens(tmp_path / "dict", "hf", tokenizer, tmp_path / "cache2", text_key="body", split="test")


def test_chat_mode_trains_on_the_assistant_tokens_only(tmp_path: Path, tokenizer_dir) -> None:
    from plait.train.chat import IGNORE_INDEX, chat_tokenizer, conversation_ids

    tokenizer = load_tokenizer(str(tokenizer_dir))
    chat = chat_tokenizer(tokenizer_dir)

    def text(ids) -> str:
        return chat.decode([int(i) for i in ids], skip_special_tokens=False)

    ids, trained = conversation_ids(chat, CHAT)
    assert text(ids) == "".join(f"<|{m['role']}|>{m['content']}</s>" for m in CHAT)
    assert text(ids[trained]) == "Shakespeare.</s>Around 1600.</s>"  # the answers and their end marks, nothing else
    # packed (two conversations, EOS between) and batched: only those tokens are targets
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(2)))
    stream = np.asarray(cached_tokens(path, "jsonl", tokenizer, tmp_path / "cache", text_key="messages", chat=True))
    loader = BatchLoader(stream, global_batch=1, seq_len=len(stream) - 1)
    inputs, targets = loader.next_batch()
    assert inputs[0].tolist() == [*ids.tolist(), tokenizer.eos_id, *ids.tolist()][:-1]
    assert text(targets[targets != IGNORE_INDEX]) == "Shakespeare.</s>Around 1600.</s>" * 2
    # and the loss plait computes is the mean over exactly those positions
    from plait.models import adapter_for
    from plait.spec.models import MODEL_PRESETS

    logits = torch.randn(1, targets.shape[1], 300)
    loss = adapter_for(MODEL_PRESETS["tiny-gpt"]).loss(logits, targets)
    kept = targets[0] != IGNORE_INDEX
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(logits[0, kept], targets[0, kept]).item())


def test_chat_mode_needs_a_chat_template(tmp_path: Path, tokenizer_dir) -> None:
    from plait.hf.tiny import train_tokenizer

    plain = train_tokenizer(DOCS, 280, tmp_path / "plain")
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    with pytest.raises(ConfigError, match="needs a chat template"):
        cached_tokens(path, "jsonl", load_tokenizer(str(plain)), tmp_path / "cache", text_key="messages", chat=True)


def test_a_window_with_no_assistant_token_trains_nothing_and_is_counted(tmp_path: Path, tokenizer_dir) -> None:
    from plait.models import adapter_for
    from plait.spec.models import MODEL_PRESETS
    from plait.train.chat import IGNORE_INDEX

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    stream = np.asarray(cached_tokens(path, "jsonl", load_tokenizer(str(tokenizer_dir)), tmp_path / "cache",
                                      text_key="messages", chat=True))
    loader = BatchLoader(stream, global_batch=1, seq_len=3)  # windows of 3: several fall inside the prompts
    adapter = adapter_for(MODEL_PRESETS["tiny-gpt"])
    empty = 0
    for _ in range(loader.steps_per_epoch):
        _, targets = loader.next_batch()
        logits = torch.randn(1, targets.shape[1], 300, requires_grad=True)
        loss = adapter.loss(logits, targets)
        loss.backward()
        kept = targets[0] != IGNORE_INDEX
        if kept.any():
            assert loss.item() == pytest.approx(
                torch.nn.functional.cross_entropy(logits[0, kept], targets[0, kept]).item())
        else:
            empty += 1
            assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0  # not NaN: nothing to learn
        assert torch.isfinite(logits.grad).all()
    assert empty > 0 and loader.unanswered_windows == empty
