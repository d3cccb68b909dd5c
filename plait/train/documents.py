"""Documents in a packed token stream, and how a training window treats them ([data] packing).

The packers (plait.train.data.pack_documents, plait.train.chat.pack_conversations) flag the first token of every
document with `DOC_START` (a high bit of a uint32 id, beside chat mode's NO_LOSS), so the cache, shuffling and
windowing keep where documents begin without a second array; a stream of one document, a byte-level text or a
pre-tokenized file carries no flag (one document, or boundaries plait cannot know).

Three ways to cut training rows out of it (`PACKING`):

* "documents" (the default for Hugging Face models): windows of the packed stream, as "stream" cuts them, but each
  token attends only to the tokens of its own document and its position restarts at 0 where its document begins
  within the window (a window that starts inside a document starts it at 0 too). The rows carry these position ids;
  a Hugging Face class reads them as packed sequences (transformers' masking utilities build the block-diagonal
  causal mask from position ids that restart, its sliding window inside each document), as its "padding-free"
  collator's batches (DataCollatorWithFlattening) are read;
* "stream": one stream, attention across document boundaries (pre-training's habit; plait's own decoders and
  module:factory models, whose attention takes no document ids, always run it);
* "padded": one document per row, from its first token, cut at seq_len + 1 tokens and right-padded with untrained
  EOS tokens: no packing at all (what an SFT trainer without packing does). Causal attention never lets a real
  token see the padding after it, so no mask is needed; the padded targets are not trained.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Literal

import numpy as np

from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.spec import ModelSpec
    from plait.train.config import Config

PACKING = ("documents", "stream", "padded")
Packing = Literal["documents", "stream", "padded"]

DOC_START = np.uint32(1 << 30)
"""Flag on the first token of a document."""
FLAG_BITS = np.uint32(3 << 30)
"""DOC_START and chat mode's NO_LOSS: what a stream's ids are stripped of."""


def packing_for(config: "Config", model: "ModelSpec") -> str:
    """The run's packing: [data] packing, or its default for the model; "documents" is refused, in one line, for a
    model whose attention cannot keep documents apart."""
    asked = config.data.packing
    if asked in ("stream", "padded"):
        return asked
    takes = _keeps_documents_apart(model)
    if asked is None:
        return "documents" if takes else "stream"
    if not takes:
        raise ConfigError(f"data.packing = \"documents\" keeps packed documents apart, which {model.name}'s attention "
                          f"cannot (plait's own decoders and module:factory models attend across them); use "
                          f"\"stream\" or \"padded\"")
    return "documents"


@functools.lru_cache(maxsize=8)
def _keeps_documents_apart(model: "ModelSpec") -> bool:
    """The model adapter's takes_positions (asked once per model: a Hugging Face class is built on meta to tell)."""
    from plait.models import adapter_for

    return adapter_for(model).takes_positions


def check_packing(config: "Config", plan) -> None:
    """Refuse, before any rank starts, packed documents kept apart under context parallelism for a class that does
    not hand its attention the position ids its ranks number the documents by."""
    from plait.models import adapter_for

    if plan.cp > 1 and packing_for(config, plan.model) == "documents" and \
            not adapter_for(plan.model).attention_sees_positions:
        raise ConfigError(f"cp={plan.cp}: {plan.model.name}'s attention is not handed its tokens' positions, which "
                          f"context parallelism needs to keep packed documents apart; use data.packing = \"padded\" "
                          f"or \"stream\", or a plan with cp=1")


def with_document_len(config: "Config", model: "ModelSpec") -> "Config":
    """`config` with train.document_len, the mean tokens of its training data's documents, where they are packed and
    kept apart and it is unset: what the planner prices attention with (plait.cost.attention). Reads (and caches)
    the data."""
    import dataclasses

    from plait.train.data import training_tokens

    try:
        if config.train.document_len is not None or packing_for(config, model) != "documents":
            return config
        tokens = training_tokens(config, model)
    except ConfigError:  # refused where it always was, after the plan (plait.train.resolve.check_data)
        return config
    count = len(document_starts(tokens))
    if count <= 1:
        return config
    return config.replace(train=dataclasses.replace(config.train, document_len=max(1, len(tokens) // count)))


def flag_start(ids: np.ndarray) -> np.ndarray:
    """`ids` (uint32) with their first token flagged as a document's start."""
    if len(ids):
        ids = ids.copy()
        ids[0] |= DOC_START
    return ids


def window_positions(rows: np.ndarray) -> np.ndarray | None:
    """Position ids [rows, seq_len] of the input tokens of windows [rows, seq_len + 1] of a flagged stream: 0 at
    the window's start and at every document start, counting up between; None where no document starts inside any
    window (the plain positions 0 .. seq_len - 1)."""
    if rows.dtype != np.uint32:
        return None
    inputs = rows[:, :-1]
    starts = (inputs & DOC_START) != 0
    starts[:, 0] = True
    if starts[:, 1:].sum() == 0:
        return None
    column = np.arange(inputs.shape[1])
    last_start = np.maximum.accumulate(np.where(starts, column, 0), axis=1)
    return (column - last_start).astype(np.int64)


def document_starts(tokens: np.ndarray) -> np.ndarray:
    """Indices of the tokens that begin a document (the stream's first, and every flagged one)."""
    if tokens.dtype != np.uint32 or len(tokens) == 0:
        return np.zeros(1 if len(tokens) else 0, dtype=np.int64)
    flagged = np.flatnonzero((np.asarray(tokens) & DOC_START) != 0)
    return np.union1d(np.zeros(1, dtype=np.int64), flagged.astype(np.int64))


def padded_rows(tokens: np.ndarray, starts: np.ndarray, picked: np.ndarray, seq_len: int, pad_id: int
                ) -> np.ndarray:
    """Rows [len(picked), seq_len + 1] uint32: document `picked[i]` from its start, cut at seq_len + 1 tokens,
    right-padded with `pad_id` flagged as untrained (chat mode's NO_LOSS)."""
    from plait.train.chat import NO_LOSS

    ends = np.append(starts[1:], len(tokens))
    rows = np.full((len(picked), seq_len + 1), np.uint32(pad_id) | NO_LOSS, dtype=np.uint32)
    for row, index in enumerate(picked):
        piece = np.asarray(tokens[starts[index]:min(ends[index], starts[index] + seq_len + 1)]).astype(np.uint32)
        rows[row, :len(piece)] = piece
    return rows
