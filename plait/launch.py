"""Starting ranks: under torchrun, or N local processes from a plain `plait ... --nproc N`.

A plait command that needs ranks asks `in_torchrun()`: under torchrun it is a worker and
calls `init_distributed()`; otherwise it re-launches itself with `run_local(N, argv)`, so
`torchrun --nproc-per-node N -m plait check --plan F` and `plait check --plan F` run the
same code. Every wait is bounded: the process group has a timeout (a dead or hung peer
becomes an error), and when a rank exits with an error the launcher stops the others at
once and names the rank.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta

DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout: long enough for a slow first step on a busy CPU, short enough not to hang for long."""

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

FAILURE_DIR_ENV = "PLAIT_FAILURE_DIR"
"""Set by run_local: each rank that fails writes a note there (when, and what), so the launcher can
tell the rank that failed first from the ones that only lost it as a peer."""

PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "remote process exited", "communicator was aborted")
"""What gloo and NCCL say in a rank whose peer died: such a rank failed because of another one."""


def in_torchrun() -> bool:
    """True in a process started by torchrun (or run_local): RANK, WORLD_SIZE and LOCAL_RANK are set."""
    return all(name in os.environ for name in TORCHRUN_VARS)


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group torchrun set up (idempotent); returns (rank, world_size).

    On CUDA each process takes the device of its LOCAL_RANK. The bounded `timeout_s`
    turns a dead peer into an error instead of an endless wait."""
    import torch
    import torch.distributed as dist

    if not in_torchrun():
        raise RuntimeError("init_distributed() needs torchrun's RANK/WORLD_SIZE/LOCAL_RANK; "
                           "use run_local() to start ranks")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = timedelta(seconds=timeout_s)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # After a restart the workers join the agent's store again, which still holds the dead
        # round's rendezvous keys: gloo then reads the old peers' addresses and fails ("connection
        # refused") or waits on them (seen in about half of the restarts here). A key prefix per
        # attempt keeps the rounds apart.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"plait/attempt_{restart}", store),
                                rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    _record_uncaught_failures()
    # DTensor warns, once per rank and call site, that 2-D reductions take two collectives
    # (FSDP x TP gradient norms, state-dict gathers): expected here, and it drowns the output.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return dist.get_rank(), dist.get_world_size()


def note_failure(error: BaseException) -> None:
    """Leave this rank's failure note for run_local's launcher (a no-op outside run_local)."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder or "RANK" not in os.environ:
        return
    lines = str(error).strip().splitlines()
    note = {"time_ns": time.time_ns(), "error": f"{type(error).__name__}: {lines[-1] if lines else ''}"}
    try:
        with open(os.path.join(folder, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(note, f)
    except OSError:
        pass  # the note only improves the report; never hide the error itself


def _record_uncaught_failures() -> None:
    previous = sys.excepthook
    if getattr(previous, "_plait", False):
        return

    def hook(kind, error, traceback):
        note_failure(error)
        previous(kind, error, traceback)

    hook._plait = True
    sys.excepthook = hook


def shutdown_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    from plait.execute.mesh import forget_meshes

    forget_meshes()


def threads_per_rank(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def run_local(nproc: int, argv: list[str], *, timeout_s: float | None = None, module: str | None = "plait",
              max_restarts: int = 0) -> int:
    """Run `python -m <module> <argv>` (`python <argv>` when module is None) on `nproc` local ranks (torch's elastic launcher, standalone
    rendezvous, OMP threads = cores // nproc) and return the exit code: 0, or 1 when a rank failed
    (the failing rank is named on stderr and the others are stopped), or 124 after `timeout_s`."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be at least 1")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"plait-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,  # a failed rank restarts all of them, up to this many times (torchrun's flag)
        monitor_interval=0.2,  # how fast a dead rank is noticed and the others stopped
    )
    saved_env = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", FAILURE_DIR_ENV)}
    os.environ["OMP_NUM_THREADS"] = os.environ.get("PLAIT_OMP_THREADS", str(threads_per_rank(nproc)))
    os.environ["PYTHONUNBUFFERED"] = "1"
    notes = tempfile.mkdtemp(prefix="plait-failures-")
    os.environ[FAILURE_DIR_ENV] = notes
    previous_alarm = signal.getsignal(signal.SIGALRM)
    timer = _start_deadline(timeout_s)
    try:
        args = ("-m", module, *argv) if module else tuple(argv)
        elastic_launch(config, entrypoint=sys.executable)(*args)
        return 0
    except ChildFailedError as failure:
        _report_failure(failure, _read_notes(notes))
        return 1
    except _Deadline:
        print(f"plait: ranks did not finish within {timeout_s:g} s; stopped them", file=sys.stderr)
        return 124
    finally:
        shutil.rmtree(notes, ignore_errors=True)
        if timer is not None:
            timer.cancel()
            signal.signal(signal.SIGALRM, previous_alarm)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _Deadline(Exception):
    pass


def _start_deadline(timeout_s: float | None) -> threading.Timer | None:
    """SIGALRM in this (launcher) process after timeout_s: the elastic agent's wait loop is
    interrupted, and its cleanup stops the workers. Signals reach only the main thread, so
    from another thread there is no deadline (the collective timeout still bounds hangs)."""
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        return None

    def _raise(signum, frame):
        raise _Deadline()

    signal.signal(signal.SIGALRM, _raise)
    timer = threading.Timer(timeout_s, lambda: os.kill(os.getpid(), signal.SIGALRM))
    timer.daemon = True
    timer.start()
    return timer


def _read_notes(folder: str) -> dict[int, dict]:
    notes = {}
    for name in os.listdir(folder):
        try:
            with open(os.path.join(folder, name)) as f:
                notes[int(name.removeprefix("rank").removesuffix(".json"))] = json.load(f)
        except (OSError, ValueError):
            continue
    return notes


def _report_failure(failure, notes: dict[int, dict]) -> None:
    """Name the rank(s) that caused the failure, then the ranks that only lost them as a peer.

    Ranks the launcher itself stopped (SIGTERM) are left out. A rank that died without a note
    (killed by a signal, or exited with a code) comes first: its peers fail after it. Among ranks
    with notes, the earliest is a cause, and so is any later one whose error is not a lost peer."""
    failed = {rank: info for rank, info in failure.failures.items() if info.signal_name() != "SIGTERM"}
    failed = failed or dict(failure.failures)
    silent = sorted(rank for rank in failed if rank not in notes)
    noted = sorted((rank for rank in failed if rank in notes), key=lambda rank: notes[rank]["time_ns"])
    causes = silent or noted[:1]
    causes += [rank for rank in noted if rank not in causes
               and not any(sign in notes[rank]["error"] for sign in PEER_LOST)]
    for rank in causes:
        info = failed[rank]
        reason = f"exit code {info.exitcode}" if info.exitcode >= 0 else f"signal {info.signal_name()}"
        error = f": {notes[rank]['error']}" if rank in notes else ""
        print(f"plait: rank {rank} failed ({reason}){error}", file=sys.stderr)
    followers = [rank for rank in sorted(failed) if rank not in causes]
    if followers:
        print(f"plait: rank{'s' if len(followers) > 1 else ''} {', '.join(map(str, followers))} "
              "lost a peer and stopped", file=sys.stderr)
    print("plait: the other ranks were stopped", file=sys.stderr)
