"""Where a command will write, checked before it starts working: one rule for every output location.

Every command that writes (`plan --json/--report`, `check --json`, `train`'s log.dir and checkpoint.dir,
`profile --out/--samples`, `tune --out/--plot`, `demo --log-dir`) calls `output_file` or `output_dir` on
each location before any search, measurement or rank starts, so a path that cannot be written fails
in a second with one line naming the value, instead of a traceback after the work is done.

A location is usable when nothing in the way is a file (a folder "under a file"), a file is not a
folder, and the nearest folder that exists accepts a new file. The last is probed by creating (and
removing) a temporary file there: permission bits say nothing for root or on a read-only mount. No
folder is created here; the writers create missing ones when they write. Pure (no torch).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from plait.errors import ConfigError


def output_file(raw: str | os.PathLike, what: str, example_name: str = "out.json") -> Path:
    """Refuse a file location that cannot be written (`what` names it: '--json', 'profile --out', ...);
    returns it resolved."""
    path = _resolved(raw, what)
    if path.is_dir():
        raise ConfigError(f"{what} {str(raw)!r} is a folder; give a file name such as "
                          f"{str(Path(raw) / example_name)!r}")
    if path.exists() and not _probe_existing_file(path):
        raise ConfigError(f"{what} {str(raw)!r} exists and cannot be overwritten; pick another file")
    _check_parent(path.parent, raw, what)
    return path


def output_dir(raw: str | os.PathLike, what: str) -> Path:
    """Refuse a folder location that cannot be written (or is a file); returns it resolved."""
    path = _resolved(raw, what)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {str(raw)!r} is a file, not a folder; pick a folder (it is created if missing)")
    _check_parent(path, raw, what)
    return path


def filled_dir(raw: str | os.PathLike, what: str, overwrite: bool, consent: str) -> Path:
    """A folder a command fills with files of its own (`plait export`, checkpoint.export_hf): usable as
    `output_dir` says, and empty or absent unless the user consents (`consent` says how: '--force')."""
    path = output_dir(raw, what)
    if path.is_dir() and not overwrite:
        entries = sorted(p.name for p in path.iterdir())
        if entries:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise ConfigError(f"{what} {str(raw)!r} is not empty ({len(entries)} entries: {shown}); pick an empty "
                              f"or new folder, or {consent} to replace the weights written there")
    return path


def _resolved(raw: str | os.PathLike, what: str) -> Path:
    text = os.fspath(raw)
    if not str(text).strip():
        raise ConfigError(f"{what} is empty; give a path")
    if "\0" in str(text):
        raise ConfigError(f"{what} {text!r} holds a NUL character; give a path")
    try:
        return Path(text).expanduser().resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop, a name too long
        raise ConfigError(f"{what} {text!r} is not a usable path ({e})") from None


def _check_parent(folder: Path, raw: str | os.PathLike, what: str) -> None:
    """The nearest existing ancestor of `folder` (itself included) must be a folder we can write in."""
    existing = folder
    try:
        while not existing.exists():
            existing = existing.parent
    except OSError as e:
        raise ConfigError(f"{what} {os.fspath(raw)!r} is not a usable path ({e})") from None
    if not existing.is_dir():
        raise ConfigError(f"{what} {os.fspath(raw)!r} lies under {str(existing)!r}, which is a file, not a folder; "
                          "pick another location")
    if not _probe_folder(existing):
        raise ConfigError(f"{what} {os.fspath(raw)!r}: cannot write in {str(existing)!r} (no permission, or a "
                          "read-only file system); pick a writable location")


def _probe_folder(folder: Path) -> bool:
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".plait-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def _probe_existing_file(path: Path) -> bool:
    try:
        with path.open("ab"):  # opens for writing without touching the content
            return True
    except OSError:
        return False


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to a location `output_file` accepted, creating missing folders."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target
