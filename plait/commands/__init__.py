"""One module per `plait` subcommand: `add_arguments(parser)` (cheap, no torch) and `main(args) -> int`."""

import argparse
import os
from pathlib import Path

from plait.errors import ConfigError


def positive_int(text: str) -> int:
    """argparse type for counts and degrees: a clear message instead of a traceback for 0, -1 or 'x'."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def writable_output(raw: str, example_name: str) -> Path:
    """Refuse an unusable --out before minutes of measuring, not after; returns the resolved path."""
    out = Path(raw).expanduser().resolve()
    if out.is_dir():
        raise ConfigError(f"--out {raw}: is a directory; give a file name such as {raw.rstrip('/')}/{example_name}")
    parent = next((p for p in [out.parent, *out.parent.parents] if p.exists()), None)
    if parent is None or not os.access(parent, os.W_OK):
        raise ConfigError(f"--out {raw}: cannot write in {parent}; pick a writable folder")
    return out
