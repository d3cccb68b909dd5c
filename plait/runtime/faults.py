"""Fault injection, so that crash recovery can be tested (and demonstrated) on purpose.

    PLAIT_FAULT="kill:rank=1:step=4" plait train run.toml --nproc 2 --max-restarts 1

makes rank 1 SIGKILL itself right after step 4 (after that step's checkpoint, if one is due):
the elastic agent sees the dead rank, stops the others, restarts all ranks, and they resume
from the newest complete checkpoint. Kinds:

* ``kill``: SIGKILL (no cleanup, no exception: what an out-of-memory kill or a lost node does);
* ``hang``: sleep forever (a stuck peer): the others' next collective times out;
* ``interrupt``: SIGINT to the launcher, as Ctrl-C in a terminal does, in the middle of
  that step's checkpoint save when one is due (shards written, no manifest yet), else after the step.

The run need not checkpoint for a fault to fire (`plait train` checks the spec before ranks start).
A fault fires only in the job's first round of workers (plait.runtime.launch.restart_round() = 0, the same on every
machine), so the restarted job runs through. Without PLAIT_FAULT nothing here does anything.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from plait.errors import ConfigError

ENV = "PLAIT_FAULT"
KINDS = ("kill", "hang", "interrupt")


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    rank: int
    step: int


def parse_fault(text: str) -> Fault:
    """"kill:rank=1:step=4" -> Fault(kind="kill", rank=1, step=4)."""
    kind, *fields = text.strip().split(":")
    values = dict(field.partition("=")[::2] for field in fields)
    if kind not in KINDS or set(values) != {"rank", "step"} or not all(v.isdigit() for v in values.values()):
        raise ConfigError(f"{ENV}={text!r} must look like 'kill:rank=1:step=4' (kinds: {', '.join(KINDS)})")
    return Fault(kind=kind, rank=int(values["rank"]), step=int(values["step"]))


def planned_fault() -> Fault | None:
    text = os.environ.get(ENV)
    from plait.runtime.launch import restart_round

    if not text or restart_round() > 0:
        return None
    return parse_fault(text)


def check_fault(world_size: int, steps: int) -> Fault | None:
    """The launcher's check of PLAIT_FAULT (exit 2 before ranks start): a spec that would never fire is refused."""
    fault = planned_fault()
    if fault is not None and (fault.rank >= world_size or not 1 <= fault.step <= steps):
        raise ConfigError(f"{ENV}={os.environ[ENV]!r} would never fire: the run has ranks 0-{world_size - 1} and steps "
                          f"1-{steps}; pick a rank and a step in range (or unset {ENV})")
    return fault


def maybe_inject(rank: int, step: int, fault: Fault | None, *, during_save: bool = False) -> None:
    """Called by every rank after each step (and half-way through each save); fires `fault` on its rank and step."""
    if fault is None or fault.rank != rank or fault.step != step:
        return
    if during_save and fault.kind != "interrupt":
        return  # kill and hang fire after the step; an interrupt reaches "after" only when no save was due
    where = "during the checkpoint save of" if during_save else "after"
    print(f"plait: {ENV}: injecting {fault.kind!r} on rank {rank} {where} step {step}", file=sys.stderr, flush=True)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "interrupt":
        # Ctrl-C reaches the launcher (torch's agent; ranks run in sessions of their own), which stops every rank.
        os.kill(os.getppid(), signal.SIGINT)
        time.sleep(60)  # the launcher's stop ends this process; never go on with the run
        return
    while True:  # "hang"
        time.sleep(3600)
