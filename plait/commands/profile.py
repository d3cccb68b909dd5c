"""Measure this machine's devices and links and write a cluster file for `plait plan --cluster FILE`.

Compute: forward+backward GEMMs of the widths planned models use, attention and a whole block, on
every rank at once. Links: all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point,
4 KiB to 32 MiB, every group size that divides a node (and across nodes under multi-node
torchrun), fitted to latency + bandwidth. Memory: free memory per device. Host time: eight small plans
timed end to end (plait/profile/host.py), fitted to the cost model's host-time fields (per layer pass,
per parameter, per step; more under tensor parallelism and fully_shard).

    plait profile --nproc 4 --out cluster.yaml          # N local processes (CPU: gloo; GPUs: NCCL)
    torchrun --nnodes 2 --nproc-per-node 8 ... -m plait profile --out cluster.yaml
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from plait.errors import ConfigError, Interrupted, PlaitError
from plait.outputs import output_file

if TYPE_CHECKING:  # torch-free at import: the runner module imports torch
    from plait.profile.runner import ProfileOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None,
                        help="local processes to profile (default: GPUs, else CPU cores; at least 2)")
    parser.add_argument("--out", default="cluster.yaml", help="cluster file to write (default: cluster.yaml)")
    parser.add_argument("--quick", action="store_true", help="few shapes and sizes, short timings (seconds)")
    parser.add_argument("--samples", default=None, metavar="JSON",
                        help="also write every raw measurement to this JSON file (for plots and tune)")
    parser.add_argument("--name", default="", help="cluster name in the file (default: profiled-<host>)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds before a hung profile (a dead rank) is stopped (default: 600)")


def main(args: argparse.Namespace) -> int:
    out = output_file(args.out, "--out", "cluster.yaml")
    if args.samples:
        args.samples = str(output_file(args.samples, "--samples", "samples.json"))
    if _in_torchrun():
        return _worker(args, out)
    try:
        nproc = args.nproc if args.nproc is not None else _default_nproc()
        if nproc < 2:
            raise ConfigError(f"--nproc {nproc}: links need at least 2 processes; use --nproc 2 or more")
        argv = ["profile", "--out", str(out), "--timeout", str(args.timeout)]
        argv += ["--quick"] * args.quick + (["--name", args.name] if args.name else [])
        argv += ["--samples", args.samples] if args.samples else []
        code = _run_local(nproc, argv, args.timeout)
    except KeyboardInterrupt:
        raise Interrupted(f"{out} was not written") from None
    if code != 0:
        raise PlaitError(f"profile failed on {nproc} processes (exit code {code}); {out} was not written")
    return 0


def _worker(args: argparse.Namespace, out: Path) -> int:
    """One rank of the profile: measure with every other rank; rank 0 fits and writes the file."""
    import torch.distributed as dist

    from plait.runtime.launch import ending_together
    from plait.profile.runner import ProfileOptions

    _init_distributed(args.timeout)
    with ending_together():
        if dist.get_rank() == 0:
            profile_and_write(ProfileOptions(quick=args.quick), out, name=args.name, samples=args.samples)
        else:
            from plait.profile.runner import run_profile

            run_profile(ProfileOptions(quick=args.quick))
    return 0


def profile_and_write(options: "ProfileOptions", out: Path, *, name: str = "", samples: str | None = None) -> Path:
    """Rank 0's share: measure (with a progress bar), print what was found, write the file atomically."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from plait.profile.calibrate import calibrate, describe, measurements_json
    from plait.profile.clusterfile import write_cluster_file
    from plait.profile.report import print_report
    from plait.profile.runner import run_profile

    console = Console(stderr=True)
    columns = (TextColumn("[bold]profile[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("starting", total=None)
        done, phase = [0], [""]

        def progress(label: str, total: int) -> None:  # called before each step
            bar.update(task, description=label, total=total, completed=done[0])
            done[0] += 1
            # Off a terminal the bar only draws at the end: log each phase as a line instead.
            if not console.is_terminal and label.split()[:2] != phase[0]:
                phase[0] = label.split()[:2]
                console.print(f"profile [{done[0]}/{total}] {label}", highlight=False)

        measurements = run_profile(options, progress)
        bar.update(task, description="done", completed=done[0])
    calibration = calibrate(measurements, name)
    print_report(measurements, calibration)
    path = write_cluster_file(out, calibration.cluster, describe(measurements, calibration))
    if samples:
        Path(samples).parent.mkdir(parents=True, exist_ok=True)
        Path(samples).write_text(measurements_json(measurements))
    print(f"wrote {path}  (use: plait plan --cluster {path} ...)")
    return path


# ---- launching (plait.runtime.launch, imported late: add_arguments must stay cheap) -------------------------

def _in_torchrun() -> bool:
    from plait.runtime.launch import in_torchrun

    return in_torchrun()


def _init_distributed(timeout_s: float) -> None:
    from plait.runtime.launch import init_distributed

    init_distributed(timeout_s=timeout_s)


def _run_local(nproc: int, argv: list[str], timeout_s: float) -> int:
    from plait.runtime.launch import run_local

    return run_local(nproc, argv, timeout_s=timeout_s)


def _default_nproc() -> int:
    import torch

    from plait.runtime.launch import usable_cores

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return int(usable_cores())
