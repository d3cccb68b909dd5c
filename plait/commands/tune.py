"""plait tune (not built yet)."""

import argparse

from plait.errors import PlaitError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    raise PlaitError("plait tune is not built yet")
