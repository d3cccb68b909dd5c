"""One module per `plait` subcommand: `add_arguments(parser)` (cheap, no torch) and `main(args) -> int`."""

import argparse


def positive_int(text: str) -> int:
    """argparse type for counts and degrees: a clear message instead of a traceback for 0, -1 or 'x'."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type for durations and sizes: a clear message for 0, -1, nan or 'x'."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def load_ratio(text: str) -> float:
    """argparse type for a busiest-over-mean load (>= 1, finite): a clear message for 0.9, nan or 'x'."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not 1.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1 (1: a perfectly balanced router), "
                                         f"got {text!r}")
    return value
