"""One launcher for the benchmarks that run on several local ranks: the script launches itself with `--worker` on
`nproc` ranks (plait's own launcher, as `plait train` uses), and each rank runs the script's `worker(args)`.

    def main() -> int:
        args = parse_args()                 # its parser calls add_worker_flag(parser)
        return run_on_ranks(args, worker, __file__)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence


def add_worker_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def run_on_ranks(args: argparse.Namespace, worker: Callable[[argparse.Namespace], None], script: str, *,
                 nproc: int | None = None, extra: Sequence[str] = (), timeout_s: float | None = None) -> int:
    """On a rank (`--worker`): run `worker(args)`. Else: launch `script` with `--worker`, `extra` and this command's
    own arguments on `nproc` (default `args.nproc`) local ranks, and return their exit code."""
    if args.worker:
        worker(args)
        return 0
    from plait.runtime.launch import run_local

    argv = [os.path.abspath(script), "--worker", *extra, *sys.argv[1:]]
    return run_local(nproc or args.nproc, argv, module=None, timeout_s=timeout_s)
