"""Train the learned solver offline against the cost model, and write its weights.

    plait solver train                                   # seeded, on CPU, a couple of minutes: runs/solver/solver.npz
    plait solver train --seed 1 --problems 120 --out my-solver.npz
    plait solver train --replace-shipped                 # replace the weights shipped in the package
    plait plan ... --solver learned                      # uses the shipped weights (plait/data/solver.npz)

Training generates search problems (decoder shapes, device counts, batches, hardware presets, mixed clusters of
public parts and stragglers), prices candidates with the cost model, and trains two small policies with a
contrastive loss over their own samples (plait/search/training.py): the layout scorer and the device-group
policy of mixed clusters. No cluster is in the loop, and nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plait.commands import positive_int

DEFAULT_OUT = Path("runs/solver/solver.npz")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    train = sub.add_parser("train", help="train the learned solver's weights")
    train.add_argument("--seed", type=int, default=0, help="seed of the problems, the network and the samples")
    train.add_argument("--problems", type=positive_int, default=80, help="training problems (default 80)")
    train.add_argument("--epochs", type=positive_int, default=40, help="passes over the problems (default 40)")
    where = train.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None,
                       help=f"weights file to write (default: {DEFAULT_OUT}; the package's own weights are untouched)")
    where.add_argument("--replace-shipped", action="store_true",
                       help="write the package's plait/data/solver.npz (what --solver learned loads) instead")


def main(args: argparse.Namespace) -> int:
    import importlib.resources

    import numpy as np

    from plait.outputs import output_file
    from plait.search.learned import WEIGHTS_FILE
    from plait.search.training import train, train_groups

    shipped = Path(str(importlib.resources.files("plait") / "data" / WEIGHTS_FILE))
    target = shipped if args.replace_shipped else (args.out or DEFAULT_OUT)
    out = output_file(target, "--out", WEIGHTS_FILE)
    weights = train(seed=args.seed, problems=args.problems, epochs=args.epochs)
    weights.update(train_groups(seed=args.seed, problems=max(20, args.problems // 2), epochs=args.epochs))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.npz")
    np.savez(tmp, **weights)
    tmp.replace(out)
    print(f"wrote {out}")
    return 0
