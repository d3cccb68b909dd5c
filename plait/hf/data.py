"""Documents from a Hugging Face `datasets` dataset on disk ([data] source = "hf"), read locally, never downloaded.

* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (memory-mapped Arrow; the
  [data] split of a DatasetDict);
* a local ``.parquet``, ``.json`` / ``.jsonl`` or ``.arrow`` file, or a folder of them, streamed row by row
  (``load_dataset(..., streaming=True)``): a large file is never loaded whole, nor copied into the datasets cache.

Each row's [data] text_key column is one document; plait.train.data packs them into the token cache.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

from plait.errors import ConfigError

BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
_BATCH_ROWS = 1024


def dataset_documents(path: Path, text_key: str, split: str = "train", split_key: str = "data.split"
                      ) -> Iterator[str]:
    """The text of each row of the dataset at `path`, in order."""
    for number, text in enumerate(dataset_values(path, text_key, split, split_key), start=1):
        if not isinstance(text, str):
            raise ConfigError(f"dataset {str(path)!r}: column {text_key!r} holds a {type(text).__name__} (row "
                              f"{number}), not text; set data.text_key to a column of strings")
        yield text


def dataset_values(path: Path, key: str, split: str = "train", split_key: str = "data.split") -> Iterator[Any]:
    """The `key` column's value of each row of the dataset at `path`, in order (a conversation's messages, say);
    `split_key` is the config key that chose `split` (errors name it)."""
    first = True
    for batch in _rows(path, split, split_key):
        if first:
            _check_column(batch, key, path)
            first = False
        yield from batch[key]


def _datasets() -> Any:
    # Local files only: the library must not ask the Hub for anything (set before its first import).
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from plait.extras import require

    require("datasets", 'data.source = "hf"')
    import datasets

    datasets.disable_progress_bars()
    return datasets


def _rows(path: Path, split: str, split_key: str = "data.split") -> Iterator[dict[str, list]]:
    """Batches of rows ({column: [values]}) of a save_to_disk folder or of local data files."""
    datasets = _datasets()
    if path.is_dir() and any((path / name).is_file() for name in ("state.json", "dataset_dict.json")):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(f"dataset {str(path)!r} has no split {split!r} (it has {', '.join(loaded)}); "
                                  f"set {split_key} to one of them")
            loaded = loaded[split]
        elif split_key != "data.split":  # a split asked for on purpose (eval.split) must exist
            raise ConfigError(f"dataset {str(path)!r} holds one table, not splits; unset {split_key}, or give a "
                              f"DatasetDict folder")
        yield from loaded.iter(batch_size=_BATCH_ROWS)
        return
    if split_key != "data.split":
        raise ConfigError(f"{str(path)!r} holds data files, not splits; unset {split_key}, or give a DatasetDict "
                          f"folder (save_to_disk)")
    builder, files = _data_files(path)
    streamed = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True)
    yield from streamed.iter(batch_size=_BATCH_ROWS)


def _data_files(path: Path) -> tuple[str, list[Path]]:
    files = sorted(p for p in path.iterdir() if p.suffix in BUILDERS) if path.is_dir() else [path]
    kinds = {BUILDERS.get(f.suffix.lower()) for f in files}
    if not files or None in kinds or len(kinds) != 1:
        raise ConfigError(f"data.path {str(path)!r} is not a dataset plait reads: give a save_to_disk folder, or "
                          f"local {', '.join(BUILDERS)} files (one kind)")
    return kinds.pop(), files


def _check_column(batch: dict[str, list], text_key: str, path: Path) -> None:
    if text_key not in batch:
        raise ConfigError(f"dataset {str(path)!r} has no column {text_key!r} (it has {', '.join(batch) or 'none'}); "
                          f"set data.text_key to the column of the text")
