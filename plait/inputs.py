"""Reading a user's text file (config, plan, model, cluster): one place that turns what can go wrong -- a
folder, no permission, bytes that are not UTF-8, nothing in it -- into one ConfigError naming the file; and making
a user's folder of Python modules importable (no torch here: the launcher reads its inputs before ranks start)."""

from __future__ import annotations

import os
from pathlib import Path

from plait.errors import ConfigError


def read_text(path: str | os.PathLike, what: str, allow_empty: bool = False) -> str:
    """The UTF-8 text of `path` (a leading byte-order mark dropped); `what` names it: 'plan file', 'config file'.
    Blank text is refused unless `allow_empty` (a TOML config of nothing is all defaults)."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except IsADirectoryError:
        raise ConfigError(f"{what} {str(file)!r} is a folder; give a file") from None
    except OSError as e:
        raise ConfigError(f"{what} {str(file)!r} cannot be read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {str(file)!r} is not UTF-8 text (byte {e.start} is {data[e.start]:#04x}); "
                          f"is it the right file?") from None
    if not text.strip() and not allow_empty:
        raise ConfigError(f"{what} {str(file)!r} is empty")
    return text


def add_import_folder(folder: str) -> None:
    """Make `folder` importable here and in every process this one starts (PYTHONPATH is inherited)."""
    import sys

    if folder not in sys.path:
        sys.path.insert(0, folder)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, *parts])
