"""Chat fine-tuning data ([data] chat = true): conversations rendered with the tokenizer's chat template, the loss
on the assistant's tokens only.

Each row (a JSON line, or a row of an "hf" dataset) holds a list of messages, ``[{"role": "user", "content":
...}, {"role": "assistant", "content": ...}, ...]``, under [data] text_key. The tokenizer's own template
(``chat_template`` in its tokenizer_config.json, applied by transformers) renders a conversation; an assistant
turn's tokens are those the template adds for it after the generation prompt of the turns before it (rendering
a prefix, then the prefix with the turn), so the answer and its end-of-turn token are trained, and every
role marker, system and user token is not.

The mask travels inside the token stream: a token the model must not be trained to predict carries
`NO_LOSS` (the top bit of a uint32 id), so packing, the cache, shuffling and windowing keep it without a
second array; the batch loader turns flagged targets into the loss's ignore index (-100).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from plait.errors import ConfigError
from plait.models.adapter import IGNORE_INDEX

MASK_RULE = "assistant-turns-1"
"""Names the rule that picks a conversation's trained tokens (conversation_ids); part of the token cache's key, so
a change of the rule tokenizes again. Change it with the rule."""
NO_LOSS = np.uint32(1 << 31)
"""Flag on a token that is input only (never a trained target)."""
ID_BITS = np.uint32((1 << 30) - 1)
"""A token's id, without NO_LOSS and plait.train.documents.DOC_START."""


def conversation_ids(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, trained) of one conversation: the template's tokens, and True on each assistant-turn token."""
    ids = _render(tokenizer, messages)
    trained = np.zeros(len(ids), dtype=bool)
    for turn, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:turn], generation_prompt=True)
        through = _render(tokenizer, messages[:turn + 1])
        if ids[:len(through)].tolist() != through.tolist() or through[:len(before)].tolist() != before.tolist():
            raise ConfigError("the tokenizer's chat template does not render a conversation's turns as prefixes of "
                              "each other, so plait cannot tell the assistant's tokens apart; use a template that "
                              "does (most do), or train on plain text")
        trained[len(before):len(through)] = True
    return ids, trained


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> np.ndarray:
    if not messages:
        return np.zeros(0, dtype=np.int64)
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):  # a BatchEncoding in some versions
        rendered = rendered["input_ids"]
    return np.asarray(rendered, dtype=np.int64)


def chat_tokenizer(folder: Path, needed_by: str = "data.chat = true", otherwise: str = "data.chat = false") -> Any:
    """transformers' tokenizer of `folder`, which must hold a chat template (`needed_by` says who asks for it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{needed_by} needs a chat template, and the tokenizer in {str(folder)!r} has none "
                          f"(chat_template.jinja, or chat_template in tokenizer_config.json); use a chat model's "
                          f"tokenizer, or {otherwise}")
    return tokenizer


def prompt_ids(tokenizer: Any, text: str) -> np.ndarray:
    """The ids of a one-message conversation from the user, rendered by the template up to the assistant's turn."""
    return _render(tokenizer, [{"role": "user", "content": text}], generation_prompt=True)


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the template closes an assistant turn with (ChatML's <|im_end|>, Llama 3's <|eot_id|>,
    Gemma's <end_of_turn>, or EOS itself): the first special token of a rendered answer, found by rendering a
    conversation as conversation_ids does. None where the template renders none or cannot render the probe."""
    probe = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]
    try:
        before = _render(tokenizer, probe[:1], generation_prompt=True)
        through = _render(tokenizer, probe)
    except Exception:  # a template with rules of its own (a system turn first, say): no end of turn is known
        return None
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items()
                                                if getattr(t, "special", False)}
    return next((int(i) for i in through[len(before):] if int(i) in special), None)


def pack_conversations(conversations: Iterator[Any], tokenizer: Any, eos_id: int | None, where: str) -> tuple[np.ndarray, int]:
    """One uint32 stream of every conversation, EOS between two (input only), NO_LOSS on untrained tokens, the first
    token of each flagged as a document's start (plait.train.documents)."""
    from plait.train.documents import flag_start

    pieces: list[np.ndarray] = []
    count = 0
    for number, messages in enumerate(conversations, start=1):
        _check_messages(messages, number, where)
        ids, trained = conversation_ids(tokenizer, messages)
        if count:
            if eos_id is None:
                raise ConfigError(f"{where}: the tokenizer has no EOS token to put between conversations")
            pieces.append(np.array([eos_id], dtype=np.uint32) | NO_LOSS)
        pieces.append(flag_start(ids.astype(np.uint32) | np.where(trained, np.uint32(0), NO_LOSS)))
        count += 1
    if not count:
        raise ConfigError(f"{where} holds no conversation; give rows with a list of messages")
    return np.concatenate(pieces), count


def _check_messages(messages: Any, number: int, where: str) -> None:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise ConfigError(f"{where} row {number} is not a conversation: give a list of {{\"role\": ..., \"content\": "
                          f"...}} messages under data.text_key")


def json_conversations(file: Path, key: str) -> Iterator[Any]:
    with file.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                try:
                    record = json.loads(raw)
                except ValueError as e:
                    raise ConfigError(f"data file {str(file)!r} line {number} is not valid JSON ({e})") from None
                yield record.get(key) if isinstance(record, dict) else None


def split_flags(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Windows of a stream that may carry NO_LOSS flags -> (ids, targets): ids without flags (NO_LOSS and
    DOC_START), and the next-token targets with NO_LOSS ones set to IGNORE_INDEX. A stream without flags gives the
    plain shifted targets."""
    rows = rows.astype(np.int64)
    flagged = rows >= int(NO_LOSS)
    ids = rows & int(ID_BITS)
    targets = np.where(flagged[:, 1:], IGNORE_INDEX, ids[:, 1:])
    return ids[:, :-1], targets


def unanswered(rows: np.ndarray) -> int:
    """Windows (rows of seq_len + 1 tokens) of a flagged stream none of whose targets is trained: a window that falls
    wholly inside prompts, which weighs nothing in the step's token mean (plait.execute.step_loss)."""
    return int((rows[:, 1:] >= NO_LOSS).all(axis=1).sum()) if rows.dtype == np.uint32 else 0


def unanswered_note(count: int) -> str:
    return (f"{count} window(s) trained on held no assistant token (prompts only): they weighed nothing (the loss is "
            f"the mean over each step's trained tokens); a longer train.seq_len, or shorter prompts, puts answers in "
            f"every window")
