"""Training data: tokenizers, token sources, a token cache, and a sharded, resumable batch loader.

Sources (``[data] source`` in the config):

* ``shipped``: the small public-domain text in ``plait/data/`` (see its README);
* ``text``: a user's UTF-8 text file, one document;
* ``jsonl``: JSON lines, one document per line under ``[data] text_key`` (``{"text": "..."}``);
* ``tokens``: a pre-tokenized file of little-endian ``uint16`` or ``uint32`` ids read as a
  memmap (the dtype from ``[data] dtype``, or from the name: ``train.u16.bin``,
  ``train.uint32.bin``, ...);
* ``hf``: a Hugging Face ``datasets`` dataset on disk -- a folder written by ``save_to_disk``, or a local
  parquet / JSON / Arrow file -- one document per row in the column ``[data] text_key`` (``[data] split`` of a
  folder holding several). Files are streamed (never loaded whole, no copy in the datasets cache); nothing is
  downloaded.

Tokenizers (``[data] tokenizer``): ``"byte"``, one token per byte (vocabulary 256, the demo's), or a
folder holding a Hugging Face ``tokenizer.json``, read with the `tokenizers` library from local files
only (by default the model folder's, for a Hugging Face model). A text is tokenized as the model's own
tokenizer would (its post-processor adds a BOS token where it says so), and documents are packed into one
stream with the tokenizer's EOS token between them. The result is kept in a cache (``[data] cache_dir``,
default ``<log.dir>/tokens``) under a key made of the file's content hash and the tokenizer's identity (every
tokenizer file, the chat template included: plait.hf.tokenizer_files), and for chat data the masking rule, so a run
tokenizes a file once and a changed file, tokenizer or template is tokenized again. Raw bytes need no
cache: the byte tokenizer reads a text file as it is.

The loader cuts the token stream into non-overlapping windows of ``seq_len + 1`` tokens,
shuffles them once per epoch from ``(seed, epoch)``, and hands out ``global_batch`` windows
per step. Every data-parallel rank takes its own contiguous block of rows from that global
batch, so the union over ranks is exactly what one process would see -- the property that
lets a parallel run be compared step for step with a single-process one.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal, Protocol

import numpy as np

from plait.errors import ConfigError
from plait.train.documents import document_starts, padded_rows, window_positions

if TYPE_CHECKING:
    from plait.spec import ModelSpec
    from plait.train.config import Config

Source = Literal["shipped", "text", "jsonl", "tokens", "hf"]
TokenDtype = Literal["auto", "uint16", "uint32"]
SHIPPED_TEXT = "shakespeare.txt"
_DTYPE_SUFFIXES = {".u16": "uint16", ".uint16": "uint16", ".u32": "uint32", ".uint32": "uint32"}
CACHE_FORMAT = 2
"""Bumped when the packing changes, so that older cache entries are not read as this format (2: documents' first
tokens flagged, plait.train.documents)."""
_BATCH_DOCUMENTS = 1024
_CHUNK = 1 << 20


class Tokenizer(Protocol):
    name: str
    """What the user named: "byte", or the tokenizer's folder."""
    vocab_size: int
    eos_id: int | None
    identity: str
    """Names the exact tokenization (a digest of the tokenizer's files): part of the cache key."""

    def encode_documents(self, documents: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Any) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte: vocabulary 256, nothing to download, lossless on any text. Documents are separated
    by the NUL byte (id 0), which text does not hold."""

    vocab_size = 256
    eos_id = 0
    identity = "byte"
    name = "byte"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_documents(self, documents: list[str]) -> list[np.ndarray]:
        return [self.encode(doc) for doc in documents]

    def decode(self, ids: Any) -> str:
        # A sampled sequence may stop inside a multi-byte character: show U+FFFD, do not fail.
        data = bytes(int(i) & 0xFF for i in np.asarray(ids).reshape(-1))
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer.json from a local folder, run by the `tokenizers` library (the engine of
    transformers' fast tokenizers, so ids are the ones `AutoTokenizer` gives). The EOS token comes from
    tokenizer_config.json's `eos_token`, else from config.json's `eos_token_id`."""

    FILE = "tokenizer.json"

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.folder = Path(folder)
        self.name = str(self.folder)
        file = self.folder / self.FILE
        try:
            self._tok = RustTokenizer.from_file(str(file))
        except Exception as e:  # the library raises plain Exceptions for unreadable or malformed files
            raise ConfigError(f"tokenizer {str(file)!r} cannot be read ({e}); give a folder holding a Hugging Face "
                              f"tokenizer.json, or data.tokenizer = \"byte\"") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._eos_id()
        self.identity = "hf-" + self._digest()

    def _digest(self) -> str:
        """Every tokenizer file (the chat template included: it decides a conversation's tokens and masks), and
        the EOS id, which config.json may give."""
        from plait.hf.tokenizer_files import tokenizer_files

        digest = hashlib.sha256()
        for name in tokenizer_files(self.folder):
            digest.update(name.as_posix().encode() + b"\0" + (self.folder / name).read_bytes())
        digest.update(f"eos={self.eos_id}".encode())
        return digest.hexdigest()

    def _eos_id(self) -> int | None:
        token = _json_field(self.folder / "tokenizer_config.json", "eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and self._tok.token_to_id(token) is not None:
            return self._tok.token_to_id(token)
        eos = _json_field(self.folder / "config.json", "eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos if isinstance(eos, int) else None

    def encode_documents(self, documents: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch(documents)]

    def decode(self, ids: Any) -> str:
        """Text without special tokens (BOS, EOS, a template's turn markers): what a reader wants printed."""
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)


def _json_field(path: Path, key: str) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8")).get(key)
    except (ValueError, OSError, AttributeError):
        return None


def load_tokenizer(name: str | None, model_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer `[data] tokenizer` names: "byte", a folder with tokenizer.json, or None: `model_dir`'s
    tokenizer.json when there is one (a Hugging Face model's), else bytes."""
    if name is None:
        if model_dir is not None and (Path(model_dir) / HFTokenizer.FILE).is_file():
            return HFTokenizer(model_dir)
        return ByteTokenizer()
    if name == "byte":
        return ByteTokenizer()
    folder = Path(name).expanduser()
    if folder.is_file() and folder.name == HFTokenizer.FILE:
        folder = folder.parent
    if not (folder / HFTokenizer.FILE).is_file():
        raise ConfigError(f"data.tokenizer {name!r} is not \"byte\" nor a folder holding {HFTokenizer.FILE}; "
                          f"give the folder of a Hugging Face tokenizer (or of the model), or \"byte\"")
    return HFTokenizer(folder)


def check_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Refuse a tokenizer whose ids the model's embedding cannot look up (a model may have more rows: padding)."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer.name!r} has a vocabulary of {tokenizer.vocab_size}, "
            f"the model's is {vocab_size}; set data.tokenizer to the model's own tokenizer (or use a model with "
            f"vocab_size >= {tokenizer.vocab_size})"
        )


# ---- sources --------------------------------------------------------------------------
def shipped_text_path() -> Path:
    return Path(str(importlib.resources.files("plait") / "data" / SHIPPED_TEXT))


def training_tokens(config: "Config", model: "ModelSpec") -> np.ndarray:
    """The token stream a run trains on, from its [data] section, checked against the model's vocabulary (less the
    tail that [eval] fraction holds out).

    The launcher calls it first (so a file is tokenized and cached once, before any rank starts), then every rank."""
    tokens = source_tokens(config, model, config.data.path)
    return split_held_out(tokens, config.eval.fraction)[0]


def eval_tokens(config: "Config", model: "ModelSpec") -> np.ndarray:
    """The held-out tokens [eval] names: its own file or split (read as [data] says), or the tail of the [data]
    stream."""
    ev = config.eval
    if ev.split is not None and config.data.source != "hf":
        raise ConfigError(f"eval.split={ev.split!r} picks a split of a Hugging Face dataset folder (data.source = "
                          f"\"hf\"), but data.source is {config.data.source!r}; give eval.path or eval.fraction")
    if ev.path is not None or ev.split is not None:
        path = ev.path if ev.path is not None else config.data.path
        return source_tokens(config, model, path, split=ev.split or config.data.split,
                             keys=("eval.path" if ev.path is not None else "data.path",
                                   "eval.split" if ev.split is not None else "data.split"))
    return split_held_out(source_tokens(config, model, config.data.path), config.eval.fraction)[1]


def same_documents(config: "Config") -> str | None:
    """What the validation reads when it is the training documents themselves ([eval] path or split naming the
    [data] file and split), else None: its loss then says how well the run fits them, not how it generalises."""
    ev, data = config.eval, config.data
    if ev.path is None and ev.split is None:
        return None  # nothing, or the held-out tail (eval.fraction), which training does not see
    eval_path = ev.path if ev.path is not None else data.path
    if eval_path is None or data.path is None or data.source == "shipped":
        return None
    if Path(eval_path).expanduser().resolve() != Path(data.path).expanduser().resolve():
        return None
    if data.source == "hf" and (ev.split or data.split) != data.split:
        return None
    split = f", split {data.split!r}" if data.source == "hf" else ""
    return f"{data.path}{split}"


def split_held_out(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training part, held-out tail) of a token stream; the tail is `fraction` of it (empty for 0)."""
    cut = len(tokens) - int(round(len(tokens) * fraction))
    return tokens[:cut], tokens[cut:]


def source_tokens(config: "Config", model: "ModelSpec", path: str | None, split: str | None = None,
                  keys: tuple[str, str] = ("data.path", "data.split")) -> np.ndarray:
    """The whole token stream of the file `path` (of its `split`, for an "hf" dataset folder; default data.split),
    read as [data] source and tokenizer say. `keys`: the config keys that named the path and the split, which
    errors name."""
    data = config.data
    where = f"data ({path or 'shipped text'})"
    hint = "check data.dtype"
    if data.source == "tokens":
        tokens = load_tokens("tokens", path, data.dtype, key=keys[0])
    else:
        model_dir = Path(model.source.removeprefix("hf:")) if model.source.startswith("hf:") else None
        tokenizer = load_tokenizer(data.tokenizer, model_dir)
        hint = f"set data.tokenizer (now {tokenizer.name!r}) to the model's own tokenizer"
        if not isinstance(tokenizer, ByteTokenizer):  # bytes: a model of 128 ids may train on ASCII text
            check_tokenizer(tokenizer, model.vocab_size)
        shipped = data.source == "shipped" and path is None  # [eval] path of a shipped-text run: a text file
        file = shipped_text_path() if shipped else _existing(_path_of(data.source, path, keys[0]), data.source,
                                                              keys[0])
        if data.chat and (isinstance(tokenizer, ByteTokenizer) or data.source not in ("jsonl", "hf")):
            raise ConfigError(f"data.chat = true renders conversations with a tokenizer's chat template: it needs "
                              f"data.source \"jsonl\" or \"hf\" (now {data.source!r}) and a Hugging Face tokenizer "
                              f"(now {tokenizer.name!r})")
        if isinstance(tokenizer, ByteTokenizer) and data.source not in ("jsonl", "hf"):
            tokens = _read_text(file)  # the bytes are the tokens: nothing to cache
        else:
            cache = Path(data.cache_dir) if data.cache_dir else Path(config.log.dir) / "tokens"
            tokens = cached_tokens(file, data.source, tokenizer, cache, text_key=data.text_key,
                                   split=split or data.split, chat=data.chat, split_key=keys[1])
    check_vocab(tokens, model.vocab_size, where, hint)
    return tokens


def rank_tokens(config: "Config", model: "ModelSpec") -> np.ndarray:
    """`training_tokens` on every rank of a run (collective): rank 0 first -- it finds the launcher's cache, or
    under a bare torchrun fills it for the others -- and its error, if any, stops every rank alike."""
    import torch.distributed as dist

    failure: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            tokens = training_tokens(config, model)
        except ConfigError as e:
            failure = [str(e)]
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise ConfigError(failure[0])
    return tokens if dist.get_rank() == 0 else training_tokens(config, model)


def load_tokens(source: Source, path: str | None = None, dtype: TokenDtype = "auto", key: str = "data.path"
                ) -> np.ndarray:
    """The whole token stream of a byte-level source, as a 1-D integer array (a memmap for token files); `key`
    names the config key of `path` in errors."""
    if source == "shipped":
        return _read_text(shipped_text_path())
    file = _existing(_path_of(source, path, key), key=key)
    if source == "text":
        return _read_text(file)
    if source == "tokens":
        return _read_token_file(file, dtype)
    raise ConfigError(f"data.source={source!r} is not one of 'shipped', 'text', 'tokens' (bytes)")


def _path_of(source: str, path: str | None, key: str = "data.path") -> str:
    if path is None:
        kind = {"text": "text", "jsonl": "JSON-lines", "tokens": "token"}.get(source, "data")
        raise ConfigError(f"data.source={source!r} needs {key} (a {kind} file)")
    return path


def _existing(path: str, source: str = "text", key: str = "data.path") -> Path:
    file = Path(path).expanduser()
    if source == "hf" and file.is_dir():
        return file
    if not file.is_file():
        what = "an existing file or dataset folder" if source == "hf" else "an existing file"
        raise ConfigError(f"{key} {str(file)!r} does not exist; set {key} to {what}")
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


def check_vocab(tokens: np.ndarray, vocab_size: int, where: str = "data", hint: str = "check data.dtype") -> None:
    """Refuse token ids the model's embedding cannot look up (a wrong dtype or tokenizer shows up here too)."""
    if len(tokens) == 0:
        raise ConfigError(f"{where}: no tokens; give a data file with something in it")
    largest = int(tokens.max())
    if tokens.dtype == np.uint32 and largest >= 1 << 30:  # no-loss and document flags (plait.train.chat, .documents)
        from plait.train.chat import ID_BITS

        largest = int((tokens & ID_BITS).max())
    if largest >= vocab_size:
        raise ConfigError(
            f"{where}: token id {largest} does not fit the model's vocabulary of {vocab_size}; "
            f"use a model with vocab_size > {largest} or {hint}"
        )


# ---- documents, packing and the cache ---------------------------------------------------
def read_documents(file: Path, source: str, text_key: str = "text", split: str = "train",
                   split_key: str = "data.split") -> Iterator[str]:
    """The documents of a text file (the whole file) or a JSON-lines file (one per line; blank lines skipped)."""
    if source == "hf":
        from plait.hf.data import dataset_documents

        yield from dataset_documents(file, text_key, split, split_key)
        return
    if source != "jsonl":
        from plait.inputs import read_text

        yield read_text(file, "data file")
        return
    with file.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            yield _json_document(raw, number, file, text_key)


def _json_document(raw: bytes, number: int, file: Path, text_key: str) -> str:
    where = f"data file {str(file)!r} line {number}"
    try:
        record = json.loads(raw)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 (byte {e.start} is {raw[e.start]:#04x})") from None
    except ValueError as e:
        raise ConfigError(f"{where} is not valid JSON ({e}); each line must be an object like "
                          f'{{"{text_key}": "..."}}') from None
    if not isinstance(record, dict) or text_key not in record:
        keys = ", ".join(map(repr, record)) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise ConfigError(f"{where} has no key {text_key!r} (it holds {keys or 'nothing'}); set data.text_key to "
                          f"the key of the text")
    if not isinstance(record[text_key], str):
        raise ConfigError(f"{where}: {text_key!r} is a {type(record[text_key]).__name__}, not a string")
    return record[text_key]


def pack_documents(documents: Iterator[str], tokenizer: Tokenizer, *, where: str = "data") -> tuple[np.ndarray, int]:
    """One token stream of all non-empty `documents`, with the tokenizer's EOS token between two documents; returns
    it and the number of documents. Several documents: uint32, each one's first token flagged (plait.train.documents);
    one: uint16 when the vocabulary allows."""
    from plait.train.documents import flag_start

    dtype = np.uint32
    pieces: list[np.ndarray] = []
    count = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal count
        for ids in tokenizer.encode_documents(batch):
            if count:
                if tokenizer.eos_id is None:
                    raise ConfigError(f"{where}: tokenizer {tokenizer.name!r} has no EOS token to "
                                      f"put between documents; give it an eos_token in tokenizer_config.json")
                pieces.append(np.array([tokenizer.eos_id], dtype=dtype))
            pieces.append(flag_start(ids.astype(dtype)))
            count += 1
        batch.clear()

    for doc in documents:
        if doc:
            batch.append(doc)
        if len(batch) >= _BATCH_DOCUMENTS:
            flush()
    flush()
    if not count:
        raise ConfigError(f"{where} holds no text; give a file with at least one non-empty document")
    if count == 1:  # no boundary to keep
        from plait.train.chat import ID_BITS

        stream = np.concatenate(pieces) & ID_BITS
        return (stream.astype(np.uint16) if tokenizer.vocab_size <= 1 << 16 else stream), 1
    return np.concatenate(pieces), count


def file_digest(file: Path) -> str:
    """SHA-256 of a file's bytes, or of a folder's files (their relative names and bytes, in name order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in file.rglob("*") if p.is_file()) if file.is_dir() else [file]
    for path in files:
        if file.is_dir():
            digest.update(path.relative_to(file).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def cache_key(content: str, tokenizer: Tokenizer, source: str, text_key: str, split: str = "train",
              chat: bool = False) -> str:
    """What decides the tokens: the file's content, the tokenizer, how documents are read, the packing format."""
    documents = {"jsonl": f"jsonl:{text_key}", "hf": f"hf:{text_key}:{split}"}.get(source, "text")
    if chat:
        from plait.train.chat import MASK_RULE

        documents = f"chat[{MASK_RULE}]:{documents}"
    fields = {"format": CACHE_FORMAT, "content": content, "tokenizer": tokenizer.identity, "documents": documents}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def cached_tokens(file: Path, source: str, tokenizer: Tokenizer, cache_dir: str | Path, *,
                  text_key: str = "text", split: str = "train", chat: bool = False,
                  split_key: str = "data.split") -> np.ndarray:
    """The packed tokens of `file`, read from `cache_dir` when this content was tokenized by this tokenizer before,
    else tokenized and stored there (written to a temporary name, then renamed: ranks that race see either no entry
    or a whole one). A damaged entry is tokenized again."""
    cache = Path(cache_dir)
    if file.is_file() and file.stat().st_size == 0:
        raise ConfigError(f"data file {str(file)!r} is empty; set data.path to a file with something in it")
    key = cache_key(file_digest(file), tokenizer, source, text_key, split, chat)
    entry = cache / f"{_safe_stem(file)}-{key[:20]}.npy"
    if entry.is_file():
        try:
            return np.load(entry, mmap_mode="r")
        except (OSError, ValueError, EOFError):
            pass  # damaged (a copy cut short): tokenize again below
    if chat:
        tokens, count = _pack_chat(file, source, tokenizer, text_key, split, split_key)
    else:
        tokens, count = pack_documents(read_documents(file, source, text_key, split, split_key), tokenizer,
                                       where=f"data file {str(file)!r}")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        _write_atomically(entry, lambda f: np.save(f, tokens))
        info = {"file": str(file.resolve()), "tokenizer": tokenizer.name,
                "tokenizer_identity": tokenizer.identity, "documents": count, "tokens": int(len(tokens)),
                "format": CACHE_FORMAT}
        _write_atomically(entry.with_suffix(".json"), lambda f: f.write(json.dumps(info, indent=1).encode()))
    except OSError as e:
        raise ConfigError(f"cannot write the token cache in {str(cache)!r} ({e.strerror or e}); set data.cache_dir "
                          f"to a writable folder") from None
    return np.load(entry, mmap_mode="r")


def _pack_chat(file: Path, source: str, tokenizer: Tokenizer, key: str, split: str, split_key: str
               ) -> tuple[np.ndarray, int]:
    from plait.train.chat import chat_tokenizer, json_conversations, pack_conversations
    from plait.hf.data import dataset_values

    conversations = json_conversations(file, key) if source == "jsonl" else dataset_values(file, key, split,
                                                                                              split_key)
    return pack_conversations(conversations, chat_tokenizer(tokenizer.folder), tokenizer.eos_id,
                              where=f"data file {str(file)!r}")


def _safe_stem(file: Path) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in file.stem)[:40] or "data"


def _write_atomically(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---- loader ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LoaderPosition:
    """Where the loader stands: the next batch is batch `step_in_epoch` of epoch `epoch`."""

    epoch: int = 0
    step_in_epoch: int = 0


@dataclass(frozen=True)
class Rows:
    """This rank's rows of one global batch: tokens and next-token targets, int64 [rows, seq_len]; `positions`, the
    position ids of each token in its document ([data] packing = "documents"; plait.train.documents), or None where
    no document begins inside a row."""

    tokens: Any
    targets: Any
    positions: Any = None


class BatchLoader:
    """Yields this rank's rows of each global batch as ``(tokens, targets)``, int64 [rows, seq_len] (`next_rows`: with
    their documents' position ids).

    ``dp_rank``/``dp_degree`` pick the block of ``global_batch // dp_degree`` rows that this
    data-parallel rank trains on; every rank walks the same global order, so the run is
    deterministic from ``seed`` and independent of the parallel layout. ``packing`` (plait.train.documents): rows
    are windows of the packed stream ("documents", "stream"), or its documents one per row ("padded", padded with
    `pad_id`).
    """

    def __init__(self, tokens: np.ndarray, *, global_batch: int, seq_len: int, seed: int = 0,
                 dp_rank: int = 0, dp_degree: int = 1, packing: str = "documents", pad_id: int = 0) -> None:
        if global_batch % dp_degree:
            raise ConfigError(f"global_batch={global_batch} is not divisible by the data-parallel degree {dp_degree}")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, {dp_degree})")
        self.tokens = tokens
        self.global_batch, self.seq_len, self.seed = global_batch, seq_len, seed
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.packing, self.pad_id = packing, pad_id
        self.starts = document_starts(tokens) if packing == "padded" else None
        self.num_windows = len(self.starts) if self.starts is not None else (len(tokens) - 1) // seq_len
        if self.starts is not None and self.num_windows < global_batch:
            raise ConfigError(f"data has {self.num_windows} document(s), too few for one batch of global_batch="
                              f"{global_batch} under data.packing = \"padded\" (one document per row); use more "
                              f"documents, a smaller global_batch, or data.packing = \"documents\"")
        if self.num_windows < global_batch:
            needed = global_batch * seq_len + 1
            raise ConfigError(
                f"data has {len(tokens)} tokens, too short for one batch of global_batch={global_batch} x "
                f"seq_len={seq_len}: needs at least {needed} tokens"
            )
        self.steps_per_epoch = self.num_windows // global_batch
        self.position = LoaderPosition()
        self._order: tuple[int, np.ndarray, int] | None = None  # (epoch, window order, shift)
        self.unanswered_windows = 0
        """Windows of the global batches so far with no trained target (chat mode: no assistant token); they weigh
        nothing in the step's loss (plait.execute.step_loss)."""

    # -- iteration --
    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        while True:
            yield self.next_batch()

    def next_batch(self) -> tuple[Any, Any]:
        rows = self.next_rows()
        return rows.tokens, rows.targets

    def next_rows(self) -> Rows:
        """This rank's rows of the next global batch, with their documents' position ids under "documents"."""
        import torch

        rows = self.global_rows(self.position)
        per_rank = self.global_batch // self.dp_degree
        mine = rows[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]  # [per_rank, seq_len + 1]
        self.position = self._advance(self.position)
        if mine.dtype == np.uint32:  # may carry chat mode's no-loss flags: flagged targets are ignored by the loss
            from plait.train.chat import split_flags, unanswered

            self.unanswered_windows += unanswered(rows)
            positions = window_positions(rows) if self.packing == "documents" else None  # the same for every rank
            tokens, targets = split_flags(mine)
            if positions is not None:
                positions = torch.from_numpy(np.ascontiguousarray(positions[self.dp_rank * per_rank:
                                                                            (self.dp_rank + 1) * per_rank]))
            return Rows(torch.from_numpy(np.ascontiguousarray(tokens)), torch.from_numpy(np.ascontiguousarray(targets)),
                        positions)
        batch = torch.from_numpy(mine.astype(np.int64))
        return Rows(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())

    def global_rows(self, position: LoaderPosition) -> np.ndarray:
        """All ``global_batch`` windows of the batch at `position`: [global_batch, seq_len + 1]."""
        order, shift = self._epoch_order(position.epoch)
        picked = order[position.step_in_epoch * self.global_batch:(position.step_in_epoch + 1) * self.global_batch]
        if self.starts is not None:  # "padded": one document per row
            return padded_rows(self.tokens, self.starts, picked, self.seq_len, self.pad_id)
        starts = shift + picked * self.seq_len
        return np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1]) for s in starts])

    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, int]:
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            # A random shift of the window grid each epoch shows the model new cut points (documents: none to shift).
            slack = 0 if self.starts is not None else (len(self.tokens) - 1) - self.num_windows * self.seq_len
            shift = int(rng.integers(0, slack + 1))
            self._order = (epoch, rng.permutation(self.num_windows), shift)
        return self._order[1], self._order[2]

    def _advance(self, position: LoaderPosition) -> LoaderPosition:
        if position.step_in_epoch + 1 < self.steps_per_epoch:
            return LoaderPosition(epoch=position.epoch, step_in_epoch=position.step_in_epoch + 1)
        return LoaderPosition(epoch=position.epoch + 1, step_in_epoch=0)

    # -- resume --
    def rewind(self) -> None:
        """Back to the first batch (validation reads the same held-out batches every time)."""
        self.position = LoaderPosition()

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
