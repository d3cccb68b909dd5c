"""Training data: a byte-level tokenizer, token sources, and a sharded, resumable batch loader.

Sources (``[data] source`` in the config):

* ``shipped``: the small public-domain text in ``plait/data/`` (see its README);
* ``text``: a user's UTF-8 text file, tokenized byte by byte;
* ``tokens``: a pre-tokenized file of little-endian ``uint16`` or ``uint32`` ids read as a
  memmap (the dtype from ``[data] dtype``, or from the name: ``train.u16.bin``,
  ``train.uint32.bin``, ...).

The loader cuts the token stream into non-overlapping windows of ``seq_len + 1`` tokens,
shuffles them once per epoch from ``(seed, epoch)``, and hands out ``global_batch`` windows
per step. Every data-parallel rank takes its own contiguous block of rows from that global
batch, so the union over ranks is exactly what one process would see -- the property that
lets a parallel run be compared step for step with a single-process one.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np

from plait.errors import ConfigError

Source = Literal["shipped", "text", "tokens"]
TokenDtype = Literal["auto", "uint16", "uint32"]
SHIPPED_TEXT = "shakespeare.txt"
_DTYPE_SUFFIXES = {".u16": "uint16", ".uint16": "uint16", ".u32": "uint32", ".uint32": "uint32"}


class ByteTokenizer:
    """One token per UTF-8 byte: vocabulary 256, nothing to download, lossless on any text."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Any) -> str:
        # A sampled sequence may stop inside a multi-byte character: show U+FFFD, do not fail.
        data = bytes(int(i) & 0xFF for i in np.asarray(ids).reshape(-1))
        return data.decode("utf-8", errors="replace")


# ---- sources --------------------------------------------------------------------------
def shipped_text_path() -> Path:
    return Path(str(importlib.resources.files("plait") / "data" / SHIPPED_TEXT))


def load_tokens(source: Source, path: str | None = None, dtype: TokenDtype = "auto") -> np.ndarray:
    """The whole token stream of a data source, as a 1-D integer array (a memmap for token files)."""
    if source == "shipped":
        return _read_text(shipped_text_path())
    if path is None:
        raise ConfigError(f"data.source={source!r} needs data.path (a {'text' if source == 'text' else 'token'} file)")
    file = _existing(path)
    if source == "text":
        return _read_text(file)
    if source == "tokens":
        return _read_token_file(file, dtype)
    raise ConfigError(f"data.source={source!r} is not one of 'shipped', 'text', 'tokens'")


def _existing(path: str) -> Path:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"data file {str(file)!r} does not exist; set data.path to an existing file")
    return file


def _read_text(file: Path) -> np.ndarray:
    # Bytes, not str: the byte tokenizer maps any file, even one that is not valid UTF-8.
    try:
        data = file.read_bytes()
    except OSError as e:
        raise ConfigError(f"data file {str(file)!r} cannot be read ({e.strerror})") from None
    if not data:
        raise ConfigError(f"data file {str(file)!r} is empty; set data.path to a text file with something in it")
    return np.frombuffer(data, dtype=np.uint8)


def token_dtype(file: Path, dtype: TokenDtype) -> str:
    """The element type of a token file: the explicit one, else the one its name's suffix says."""
    if dtype != "auto":
        return dtype
    for suffix in file.suffixes:
        if suffix.lower() in _DTYPE_SUFFIXES:
            return _DTYPE_SUFFIXES[suffix.lower()]
    raise ConfigError(
        f"cannot tell the dtype of token file {file.name!r}: set data.dtype to 'uint16' or 'uint32' "
        f"or name it like 'train.u16.bin' / 'train.u32.bin'"
    )


def _read_token_file(file: Path, dtype: TokenDtype) -> np.ndarray:
    kind = np.dtype(token_dtype(file, dtype)).newbyteorder("<")
    size = file.stat().st_size
    if size % kind.itemsize:
        raise ConfigError(
            f"token file {str(file)!r} has {size} bytes, not a multiple of {kind.itemsize} ({kind.name}); "
            f"is data.dtype right?"
        )
    if size == 0:
        raise ConfigError(f"token file {str(file)!r} is empty")
    return np.memmap(file, dtype=kind, mode="r")


def check_vocab(tokens: np.ndarray, vocab_size: int, where: str = "data") -> None:
    """Refuse token ids the model's embedding cannot look up (a wrong dtype shows up here too)."""
    if len(tokens) == 0:
        raise ConfigError(f"{where}: no tokens; give a data file with something in it")
    largest = int(tokens.max())
    if largest >= vocab_size:
        raise ConfigError(
            f"{where}: token id {largest} does not fit the model's vocabulary of {vocab_size}; "
            f"use a model with vocab_size > {largest} or check data.dtype"
        )


# ---- loader ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LoaderPosition:
    """Where the loader stands: the next batch is batch `step_in_epoch` of epoch `epoch`."""

    epoch: int = 0
    step_in_epoch: int = 0


class BatchLoader:
    """Yields this rank's rows of each global batch as ``(tokens, targets)``, int64 [rows, seq_len].

    ``dp_rank``/``dp_degree`` pick the block of ``global_batch // dp_degree`` rows that this
    data-parallel rank trains on; every rank walks the same global order, so the run is
    deterministic from ``seed`` and independent of the parallel layout.
    """

    def __init__(self, tokens: np.ndarray, *, global_batch: int, seq_len: int, seed: int = 0,
                 dp_rank: int = 0, dp_degree: int = 1) -> None:
        if global_batch % dp_degree:
            raise ConfigError(f"global_batch={global_batch} is not divisible by the data-parallel degree {dp_degree}")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, {dp_degree})")
        self.tokens = tokens
        self.global_batch, self.seq_len, self.seed = global_batch, seq_len, seed
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < global_batch:
            needed = global_batch * seq_len + 1
            raise ConfigError(
                f"data has {len(tokens)} tokens, too short for one batch of global_batch={global_batch} x "
                f"seq_len={seq_len}: needs at least {needed} tokens"
            )
        self.steps_per_epoch = self.num_windows // global_batch
        self.position = LoaderPosition()
        self._order: tuple[int, np.ndarray, int] | None = None  # (epoch, window order, shift)

    # -- iteration --
    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        while True:
            yield self.next_batch()

    def next_batch(self) -> tuple[Any, Any]:
        import torch

        rows = self.global_rows(self.position)
        per_rank = self.global_batch // self.dp_degree
        mine = rows[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]  # [per_rank, seq_len + 1]
        self.position = self._advance(self.position)
        batch = torch.from_numpy(mine.astype(np.int64))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def global_rows(self, position: LoaderPosition) -> np.ndarray:
        """All ``global_batch`` windows of the batch at `position`: [global_batch, seq_len + 1]."""
        order, shift = self._epoch_order(position.epoch)
        picked = order[position.step_in_epoch * self.global_batch:(position.step_in_epoch + 1) * self.global_batch]
        starts = shift + picked * self.seq_len
        return np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1]) for s in starts])

    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, int]:
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            # A random shift of the window grid each epoch shows the model new cut points.
            slack = (len(self.tokens) - 1) - self.num_windows * self.seq_len
            shift = int(rng.integers(0, slack + 1))
            self._order = (epoch, rng.permutation(self.num_windows), shift)
        return self._order[1], self._order[2]

    def _advance(self, position: LoaderPosition) -> LoaderPosition:
        if position.step_in_epoch + 1 < self.steps_per_epoch:
            return LoaderPosition(epoch=position.epoch, step_in_epoch=position.step_in_epoch + 1)
        return LoaderPosition(epoch=position.epoch + 1, step_in_epoch=0)

    # -- resume --
    def state_dict(self) -> dict[str, int]:
        """Enough to continue exactly here, under any data-parallel layout with the same batch and seed."""
        return {"epoch": self.position.epoch, "step_in_epoch": self.position.step_in_epoch,
                "seed": self.seed, "global_batch": self.global_batch, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "global_batch", "seq_len"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(
                    f"data loader state was saved with {key}={state[key]}, but this run has {key}={getattr(self, key)}"
                )
        position = LoaderPosition(epoch=int(state["epoch"]), step_in_epoch=int(state["step_in_epoch"]))
        if not 0 <= position.step_in_epoch < self.steps_per_epoch:
            raise ConfigError(
                f"data loader state step_in_epoch={position.step_in_epoch} is outside this data's "
                f"{self.steps_per_epoch} batches per epoch (different data file?)"
            )
        self.position = position

    def skip(self, num_batches: int) -> None:
        """Advance without reading (resume by step count when no loader state was saved)."""
        for _ in range(num_batches):
            self.position = self._advance(self.position)
