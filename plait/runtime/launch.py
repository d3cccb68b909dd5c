"""Starting ranks: under torchrun, or N local processes from a plain `plait ... --nproc N`.

A plait command that needs ranks asks `in_torchrun()`: under torchrun it is a worker and
calls `init_distributed()`; otherwise it re-launches itself with `run_local(N, argv)`, so
`torchrun --nproc-per-node N -m plait check --plan F` and `plait check --plan F` run the
same code. Every wait is bounded: the process group has a timeout (a dead or hung peer
becomes an error), and when a rank exits with an error the launcher stops the others at
once and names the rank.

The one place a rank's failure becomes plait's summary is `_report_failure`: it names the rank
that caused it (the one that died, raised first, or -- from the progress each rank notes -- hung),
then the ranks that only lost it. A rank that failed because of a peer prints one line of its own
error, not a traceback (PLAIT_TRACEBACK=1 shows them all). A failed rank ends without the interpreter's
teardown once its failure is on record, and one that lost a peer only once the launcher stops it (or after
STOP_WAIT_S), so that the rank that caused it is seen to exit first (`_wait_to_be_stopped`).

Ctrl-C has one handler: the launcher's. The terminal sends SIGINT to the launcher and every rank;
each rank of `run_local` exits at once and silently (exit 130; checkpoints are atomic, so the last
complete one stays usable and an unfinished save is never read), and the launcher raises
KeyboardInterrupt, which the CLI prints as one line with exit code 130.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout: long enough for a slow first step on a busy CPU, short enough not to hang for long."""

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

FAILURE_DIR_ENV = "PLAIT_FAILURE_DIR"
"""Set by run_local: each rank that fails writes a note there (when, and what), so the launcher can
tell the rank that failed first from the ones that only lost it as a peer."""

PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "remote process exited", "communicator was aborted")
"""What gloo and NCCL say in a rank whose peer died: such a rank failed because of another one."""

TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")
"""What a rank says when a collective waited past the process group's timeout: a peer never came."""

TRACEBACK_ENV = "PLAIT_TRACEBACK"
"""Set to 1 to print every rank's full traceback, also of errors caused by a lost peer."""

STOP_WAIT_S = 5.0
"""How long a rank that lost a peer waits, after its line, for the launcher to stop it (see _wait_to_be_stopped):
long enough for a failed rank of this machine to finish exiting and the launcher (polling every 0.1-0.2 s) to see
it; short, as a lost machine's agent cannot stop the ranks here, whose exit is what makes their agent restart."""


def in_torchrun() -> bool:
    """True in a process started by torchrun (or run_local): RANK, WORLD_SIZE and LOCAL_RANK are set."""
    return all(name in os.environ for name in TORCHRUN_VARS)


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def cuda_allocator_defaults() -> None:
    """Segments that grow in place instead of a new block per size (torchtitan's launch script sets the same): on
    an H200 (benchmarks/gpu_check.py's grid of a 1.4B model) the default allocator reserved up to 15 GiB over the
    allocated peak, and two plans whose tensors fit ran out of memory; with this, reserved stayed within 1.5% of
    allocated there and both ran. A value the user set wins. Read at the first CUDA allocation, which comes later."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


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
    quiet_worker_interrupts()  # also for ranks not started through plait's CLI (plait.profile.tune)
    backend = backend or default_backend()
    if backend == "nccl":
        cuda_allocator_defaults()
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store, round_ = _round_store(timeout)
        dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
        round_ = _local_restart_count()
    _record_uncaught_failures()  # from the first collective on: a peer may die in it
    global _RESTART_ROUND
    _RESTART_ROUND = _agreed_round(round_, "cuda" if backend == "nccl" else "cpu")
    # DTensor warns, once per rank and call site, that 2-D reductions take two collectives
    # (FSDP x TP gradient norms, state-dict gathers): expected here, and it drowns the output.
    from plait.torch_internals import REDISTRIBUTE_LOGGER

    logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)
    return dist.get_rank(), dist.get_world_size()


ROUND_KEY = "plait/round"
"""Key of the agent's store under which each round's rank 0 says where its beacon listens (see _round_store)."""

_RESTART_ROUND: int | None = None
_BEACON: object | None = None  # rank 0's beacon store: lives as long as the process


def restart_round() -> int:
    """How many times this job's workers were started before this round (0 in the first), the same on every
    rank of every machine once init_distributed has run (before: this agent's own count)."""
    return _local_restart_count() if _RESTART_ROUND is None else _RESTART_ROUND


def _local_restart_count() -> int:
    """torchrun's TORCHELASTIC_RESTART_COUNT: this agent's own failed rounds. An agent whose workers were stopped
    because another machine's failed restarts them without counting, so two agents can disagree."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _round_store(timeout: timedelta):  # -> (torch.distributed.Store, round)
    """A store namespace of this round alone, agreed by every rank, and the round's number.

    Under torchrun's c10d rendezvous every round of workers joins the same store, hosted by an agent, which still
    holds the keys of the rounds before: gloo then reads the dead peers' addresses and fails ("connectFullMesh
    failed ... Connection refused") or waits for them (pytorch/pytorch#135712, #167288). A prefix per round keeps
    them apart, but TORCHELASTIC_RESTART_COUNT cannot name it: each agent counts only its own failures, so after
    a restart two machines disagree. So rank 0 of each round opens a beacon (a store of its own), counts the round
    in the agent's store and writes there where the beacon is and a fresh name. The other ranks read that entry
    and accept it once its beacon answers with the same name: every process of an earlier round is dead before
    the next one starts (the agents stop their workers before they meet again), so an earlier round's beacon
    no longer answers."""
    import uuid

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                           timeout=timeout)
    if rank == 0:
        global _BEACON
        name, round_ = uuid.uuid4().hex, int(shared.add(f"{ROUND_KEY}/count", 1)) - 1
        _BEACON = dist.TCPStore(_host_name(), 0, is_master=True, wait_for_workers=False, timeout=timeout)
        _BEACON.set("name", name)
        shared.set(ROUND_KEY, json.dumps({"host": _host_name(), "port": _BEACON.port, "name": name,
                                          "round": round_}))
    else:
        name, round_ = _current_round(shared, timeout)
    return dist.PrefixStore(f"plait/round_{name}", shared), round_


def _host_name() -> str:
    """This machine's name as torch's rendezvous gives it to other machines by default."""
    import socket

    return socket.getfqdn()


def _current_round(shared, timeout: timedelta) -> tuple[str, int]:  # noqa: ANN001 (a torch Store)
    """(name, round) of the round rank 0 opened, waiting out an earlier round's entry (see _round_store)."""
    import socket

    import torch.distributed as dist

    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        entry = json.loads(shared.get(ROUND_KEY))  # waits until a first round has written it
        try:  # a plain connect first: a dead beacon refuses at once (a store client would retry and log)
            socket.create_connection((entry["host"], entry["port"]), timeout=2).close()
            beacon = dist.TCPStore(entry["host"], entry["port"], is_master=False, timeout=timedelta(seconds=5))
            if beacon.get("name").decode() == entry["name"]:
                return entry["name"], int(entry["round"])
        except (OSError, RuntimeError):
            pass  # an earlier round's beacon (its rank 0 is gone), or a port taken again since
        time.sleep(0.1)
    raise TimeoutError(f"rank 0 of this round did not open it within {timeout.total_seconds():g} s "
                       f"(no live beacon under {ROUND_KEY!r} in the agent's store)")


def _agreed_round(mine: int, device: str) -> int:
    """The largest round any rank knows of: the store's count, or an agent's own restarts where the agent that held
    the store (and its count) is gone."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([max(mine, _local_restart_count())], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def is_local_worker() -> bool:
    """True in a rank started by run_local (its launcher reads the notes and owns Ctrl-C)."""
    return bool(os.environ.get(FAILURE_DIR_ENV)) and "RANK" in os.environ


def quiet_worker_interrupts() -> None:
    """In a rank of run_local, SIGINT ends the process at once with code 130 and no output: the launcher
    got the same Ctrl-C and prints the one line. Exiting at once (not raising KeyboardInterrupt) also works
    where an exception would be caught and wrapped (torch.distributed.checkpoint does) or printed per rank."""
    if is_local_worker() and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))


_NOTED = False  # this process has left its failure note: the first one stands


def note_failure(error: BaseException) -> None:
    """Leave this rank's failure note for run_local's launcher (a no-op outside run_local). Only the first note
    of a process counts: the same error noted again on its way out would take a later time than the peers that
    lost this rank, and the launcher orders causes by that time."""
    global _NOTED
    if _NOTED:
        return
    _NOTED = True
    _write_note("json", {"time_ns": time.time_ns(), "error": essential_line(error)})


def note_progress(label: str, count: int) -> None:
    """Leave this rank's progress (e.g. "step 5", 5) for run_local's launcher: when a collective times out,
    the rank that is behind the others is the one that hung (a no-op outside run_local)."""
    _write_note("progress", {"time_ns": time.time_ns(), "label": label, "count": count})


def _write_note(kind: str, note: dict) -> None:
    if not is_local_worker():
        return
    path = os.path.join(os.environ[FAILURE_DIR_ENV], f"rank{os.environ['RANK']}.{kind}")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(note, f)
        os.replace(path + ".tmp", path)  # the launcher never reads half a note
    except OSError:
        pass  # a note only improves the report; never hide the error itself


def essential_line(error: BaseException) -> str:
    """'Type: message' in one line: the line naming a lost peer or a timeout when there is one (torch wraps
    them in long messages), else the message's last line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    telling = [line for line in lines if any(sign in line for sign in PEER_LOST + TIMED_OUT)]
    line = (telling or lines or [""])[-1 if not telling else 0]
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)  # gloo's "[/__w/.../pair.cc:553] " source position
    return f"{type(error).__name__}: {line[:300]}"


def caused_by_a_peer(error: BaseException) -> bool:
    return lost_a_peer(str(error)) or timed_out(str(error))


def lost_a_peer(text: str) -> bool:
    return any(sign in text for sign in PEER_LOST)


def timed_out(text: str) -> bool:
    return any(sign in text for sign in TIMED_OUT)


def _record_uncaught_failures() -> None:
    previous = sys.excepthook
    if getattr(previous, "_plait", False):
        return

    def hook(kind, error, traceback):
        note_failure(error)
        from_a_peer = caused_by_a_peer(error)
        if from_a_peer and is_local_worker() and os.environ.get(TRACEBACK_ENV) != "1":
            # The cause is another rank, which the launcher names; this rank's traceback would only bury it.
            print(f"plait: rank {os.environ['RANK']}: {essential_line(error)}", file=sys.stderr, flush=True)
        else:
            previous(kind, error, traceback)
        if from_a_peer and lost_a_peer(str(error)):
            _wait_to_be_stopped()
        # On record (note, message), a failed rank skips the teardown, where it could abort or stall: one that lost
        # a peer everywhere, one that failed of its own where plait's launcher waits for it (under a bare torchrun,
        # a user's script keeps its atexit handlers). Not Ctrl-C, which Python ends with SIGINT's own status.
        if isinstance(error, Exception) and (from_a_peer or is_local_worker()):
            exit_rank(1)

    hook._plait = True
    sys.excepthook = hook


def _wait_to_be_stopped() -> None:
    """Give the launcher time to stop this rank, which lost a peer, before it ends on its own.

    A failed rank ends without the interpreter's teardown (exit_rank): with a dead peer, gloo's threads, cut off
    mid-read, aborted it there ("terminate called without an active exception", SIGABRT), and with live ones a
    teardown can stall. But a rank that lost a peer does not end at once: the rank that failed first then exits
    before it, so the launcher sees the cause's exit first and these ranks' stops after it. torchrun's own report
    names the failure with the smallest timestamp, in whole seconds (the time the agent saw the exit when the
    rank wrote no error file), ties going to the one it saw first; run_local's launcher reads the notes, in which
    the cause's time comes first (and names a cause it had to stop on its way out). A rank that timed out does
    not wait: its peer is alive (hung), and only this rank's exit makes the launcher stop it."""
    time.sleep(STOP_WAIT_S)  # the launcher's SIGTERM ends the process here (Python keeps its default action)


def shutdown_distributed(together: bool = True) -> None:
    """Destroy the process group (and the meshes built on it). `together`: first wait for every rank at a barrier,
    so no rank closes its connections while another still reads from them (under load gloo then aborts a rank
    with "terminate called without an active exception"); pass False when this rank failed, as the others may
    be gone."""
    import torch.distributed as dist

    if dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()
    mesh = sys.modules.get("plait.execute.mesh")
    if mesh is not None:  # else no mesh was built; importing the executor would cost a failing rank seconds
        mesh.forget_meshes()


@contextlib.contextmanager
def ending_together():
    """End the process group when the block ends: with every rank when it ended normally, at once when it raised.

    A rank that raised notes its failure first, so that its note is older than those of the peers that see it
    go. A rank that lost a peer leaves the group as it is: gloo's destructor would first wait out the work the
    dead peer left queued, and the process ends without its teardown anyway (_wait_to_be_stopped)."""
    try:
        yield
    except BaseException as error:
        if isinstance(error, Exception):
            note_failure(error)
        if not lost_a_peer(str(error)):
            shutdown_distributed(together=False)
        raise
    shutdown_distributed()


def exit_rank(code: int) -> None:
    """End a rank's process with `code` once its output is flushed, skipping the interpreter's teardown: the
    process group's C++ threads can outlive it and abort the process after the work is done and written."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


CPU_QUOTA_FILE = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2's CPU quota of this process's group: "QUOTA PERIOD" (microseconds), or "max QUOTA" for none."""


def usable_cores(affinity: set[int] | None = None, quota_file: Path = CPU_QUOTA_FILE) -> float:
    """The cores this process may run on: its CPU affinity where the OS has one (`taskset`, a cgroup's cpuset,
    Slurm's cpu binding all set it; `affinity` stands for it, else os.sched_getaffinity), every core where it has
    none, capped by a cgroup v2 CPU quota where one is set (a container's --cpus). At least 1; may be fractional."""
    if affinity is None and hasattr(os, "sched_getaffinity"):
        affinity = os.sched_getaffinity(0)
    cores = float(len(affinity) if affinity else (os.cpu_count() or 1))
    try:
        quota, period = quota_file.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return max(cores, 1.0)


def threads_per_rank(nproc: int, cores: float | None = None) -> int:
    """The OMP threads each of `nproc` local ranks gets when they share `cores` (default: usable_cores())."""
    return max(1, int(usable_cores() if cores is None else cores) // nproc)


def rank_threads(nproc: int) -> int:
    """The OMP threads each of `nproc` local ranks runs: PLAIT_OMP_THREADS, else the cores split between them."""
    return int(os.environ.get("PLAIT_OMP_THREADS", threads_per_rank(nproc)))


def run_local(nproc: int, argv: list[str], *, timeout_s: float | None = None, module: str | None = "plait",
              max_restarts: int = 0) -> int:
    """Run `python -m <module> <argv>` (`python <argv>` when module is None) on `nproc` local ranks (torch's elastic launcher, standalone
    rendezvous, OMP threads = cores // nproc) and return the exit code: 0, or 1 when a rank failed
    (the failing rank is named on stderr and the others are stopped), or 124 after `timeout_s`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
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
    os.environ["OMP_NUM_THREADS"] = str(rank_threads(nproc))
    os.environ["PYTHONUNBUFFERED"] = "1"
    notes = tempfile.mkdtemp(prefix="plait-failures-")
    os.environ[FAILURE_DIR_ENV] = notes
    previous_alarm = signal.getsignal(signal.SIGALRM)
    # torch's agent installs its own SIGINT/SIGTERM/... handlers and leaves them behind: put ours back after,
    # or a Ctrl-C during what the command does next would raise its SignalException instead of KeyboardInterrupt.
    stops = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    timer = _start_deadline(timeout_s)
    quiet = _quiet_elastic_logs()
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
    except SignalException as stop:
        # The agent has stopped the ranks; Ctrl-C (or a kill of the launcher) ends the command here.
        raise KeyboardInterrupt(f"signal {stop.sigval.name}") from None
    finally:
        quiet.restore()
        shutil.rmtree(notes, ignore_errors=True)
        if timer is not None:
            timer.cancel()
            signal.signal(signal.SIGALRM, previous_alarm)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in stops.items():
                signal.signal(sig, handler)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _Deadline(Exception):
    pass


class _QuietLogs:
    """torch's elastic agent logs each stop and exit code ("Sending process 123 closing signal SIGTERM",
    "failed (exitcode: 1) local_rank: 0"): what `_report_failure` says in plait's words. Kept to errors
    the agent itself hits; restored afterwards."""

    def __init__(self) -> None:
        import logging

        self.levels = {}
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("torch.distributed.elastic"):
                logger = logging.getLogger(name)
                self.levels[name] = logger.level
                logger.setLevel(logging.CRITICAL)

    def restore(self) -> None:
        import logging

        for name, level in self.levels.items():
            logging.getLogger(name).setLevel(level)


def _quiet_elastic_logs() -> _QuietLogs:
    return _QuietLogs()


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
    """rank -> its failure note ({"time_ns", "error"}), with its last progress note under "progress" if any."""
    notes: dict[int, dict] = {}
    for name in os.listdir(folder):
        stem, _, kind = name.partition(".")
        if kind not in ("json", "progress") or not stem.startswith("rank"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                note = json.load(f)
            rank = int(stem.removeprefix("rank"))
        except (OSError, ValueError):
            continue
        entry = notes.setdefault(rank, {})
        if kind == "json":
            entry.update(note)
        else:
            entry["progress"] = note
    return notes


def _report_failure(failure, notes: dict[int, dict]) -> None:
    """Name the rank(s) that caused the failure, then the ranks that only lost them as a peer.

    Ranks the launcher itself stopped (SIGTERM) are left out, unless they failed of their own first (a note
    of an error that is not a lost peer or a timeout: the launcher stopped them on their way out) or hung:
    when the failed ranks timed out waiting in a collective, a stopped rank whose progress note is behind
    theirs is the one that never came, and is named as hung. A rank that died without a note (killed by a
    signal, or exited with a code) comes first: its peers fail after it. Among ranks with notes, the
    earliest is a cause, and so is any later one whose error is not a lost peer."""
    errors = {rank: note["error"] for rank, note in notes.items() if "error" in note}
    hung = _hung_ranks(failure, notes, errors)
    if hung:
        _report_hang(hung, notes, failure, errors)
        return
    failed = {rank: info for rank, info in failure.failures.items()
              if info.signal_name() != "SIGTERM" or _failed_of_its_own(errors.get(rank))}
    failed = failed or dict(failure.failures)
    silent = sorted(rank for rank in failed if rank not in errors)
    noted = sorted((rank for rank in failed if rank in errors), key=lambda rank: notes[rank]["time_ns"])
    causes = silent or noted[:1]
    causes += [rank for rank in noted if rank not in causes and not lost_a_peer(errors[rank])]
    for rank in causes:
        info = failed[rank]
        reason = f"exit code {info.exitcode}" if info.exitcode >= 0 else f"signal {info.signal_name()}"
        if info.signal_name() == "SIGTERM" and rank in errors:
            reason = "stopped by the launcher as it ended"
        error = f": {errors[rank]}" if rank in errors else ""
        print(f"plait: rank {rank} failed ({reason}){error}", file=sys.stderr)
    followers = [rank for rank in sorted(failed) if rank not in causes]
    if followers:
        print(f"plait: rank{'s' if len(followers) > 1 else ''} {', '.join(map(str, followers))} "
              "lost a peer and stopped", file=sys.stderr)
    print("plait: the other ranks were stopped", file=sys.stderr)


def _failed_of_its_own(error: str | None) -> bool:
    return error is not None and not lost_a_peer(error) and not timed_out(error)


def _hung_ranks(failure, notes: dict[int, dict], errors: dict[int, str]) -> list[int]:
    """Ranks the launcher stopped that are behind the ranks whose collective timed out (see _report_failure)."""
    waited = [rank for rank, error in errors.items() if timed_out(error)]
    progress = {rank: note["progress"]["count"] for rank, note in notes.items() if "progress" in note}
    if not waited or not all(rank in progress for rank in waited):
        return []
    waiting_at = min(progress[rank] for rank in waited)
    stopped = {rank for rank, info in failure.failures.items() if info.signal_name() == "SIGTERM"}
    alive = set(progress) - set(failure.failures)
    return sorted(rank for rank in stopped | alive if rank not in errors and progress.get(rank, -1) < waiting_at)


def _report_hang(hung: list[int], notes: dict[int, dict], failure, errors: dict[int, str]) -> None:
    for rank in hung:
        last = notes.get(rank, {}).get("progress", {}).get("label")
        where = f"last began {last}" if last else "never reported progress"
        print(f"plait: rank {rank} hung ({where}); its peers timed out waiting for it", file=sys.stderr)
    waiting = sorted(rank for rank in errors if rank not in hung)
    if waiting:
        first = min(waiting, key=lambda rank: notes[rank]["time_ns"])
        print(f"plait: rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} timed out waiting "
              f"({errors[first]})", file=sys.stderr)
    print("plait: the other ranks were stopped", file=sys.stderr)
