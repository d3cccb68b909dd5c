"""Run plans on this machine (or read what a training run measured), compare predicted and measured time, and
correct the cost model's constants the timings identify: GEMM efficiency, host time per layer pass, parameter,
stage pass and step, link latency and bandwidth.

examples:
  plait profile --nproc 2 --out cluster.yaml
  plait tune --model tiny-gpt --cluster cluster.yaml --top 4 --out cluster.tuned.yaml --plot tune.png
  plait tune --from-run runs/tiny-gpt --out cluster.tuned.yaml      # no timing runs: what `plait train` measured
  plait plan --model tiny-gpt --cluster cluster.tuned.yaml --global-batch 8 --seq-len 128

The plans timed are the planner's best and then those that tell the constants apart best (different layouts,
micro-batch counts). All run in one launch of N local ranks (or under torchrun: `torchrun --nproc-per-node N -m
plait tune ...`), each for --warmup untimed and --steps timed steps; a step's time is the slowest rank's, a
plan's the median over its steps. A constant is fitted only where it predicts each timing from the others better
(never more constants than timings less one); the report gives that held-out error beside the in-sample one, and
whether the tuned model ranks the measured best plan first. A fit that does not improve the held-out error is
refused (exit 2, nothing written), with what to measure more of. The corrected cluster file is written
atomically.
"""

from __future__ import annotations

import argparse

from plait.commands import positive_int
from plait.errors import ConfigError
from plait.outputs import output_file
from plait.profile.tuning import DEFAULT_CLUSTER  # a light module: --help stays cheap



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="M",
                        help="model preset (e.g. tiny-gpt) or model file (required unless --from-run)")
    parser.add_argument("--from-run", action="append", default=[], metavar="LOG_DIR",
                        help="fit from what `plait train` measured (LOG_DIR/measured.json; repeatable, one per run) "
                             "instead of timing plans")
    parser.add_argument("--cluster", default=None, metavar="C",
                        help=f"cluster file from `plait profile` (or a preset; default: {DEFAULT_CLUSTER})")
    parser.add_argument("--nproc", type=positive_int, default=None, metavar="N",
                        help="local ranks (default: the cluster file's num_devices, else 2)")
    parser.add_argument("--top", type=positive_int, default=3, metavar="K",
                        help="plans to run: the planner's best, then those that tell the constants apart best "
                             "(default: 3)")
    parser.add_argument("--global-batch", type=positive_int, default=8, metavar="B",
                        help="sequences per step (default: 8)")
    parser.add_argument("--seq-len", type=positive_int, default=128, metavar="S",
                        help="tokens per sequence (default: 128)")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per plan (default: 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: 2)")
    parser.add_argument("--out", default="cluster.tuned.yaml",
                        help="corrected cluster file (default: cluster.tuned.yaml)")
    parser.add_argument("--plot", default=None, metavar="FILE",
                        help="predicted-vs-measured plot (default: next to --out, as <out>.png)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before a hung run is stopped (default: scaled with --top and --steps)")


def main(args: argparse.Namespace) -> int:
    from plait.profile.tuning import (cluster_file_devices, time_on_local_ranks, torchrun_main, candidate_plans,
                                      from_run, report_and_write, resolve_cluster)
    from plait.runtime.launch import in_torchrun

    if args.warmup < 0:
        raise ConfigError(f"--warmup {args.warmup}: must be 0 or more")
    out = output_file(args.out, "--out", "cluster.tuned.yaml")
    plot = output_file(args.plot, "--plot", "tune.png") if args.plot else output_file(out.with_suffix(".png"), "--plot")
    if args.from_run:
        return from_run(args.from_run, args.cluster, out, plot)
    if not args.model:
        raise ConfigError("--model is required: the model whose plans to time (e.g. --model tiny-gpt), or give "
                          "--from-run LOG_DIR to fit from what a training run measured")
    if in_torchrun():
        return torchrun_main(args, out, plot)
    nproc = args.nproc or cluster_file_devices(args.cluster) or 2
    cluster = resolve_cluster(args.cluster, nproc)
    plans = candidate_plans(args, cluster, nproc)
    results = time_on_local_ranks(plans, args, nproc)
    return report_and_write(plans, results, cluster, out, plot)
