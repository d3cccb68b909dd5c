"""Fault injection, so that crash recovery can be tested (and demonstrated) on purpose.

    PLAIT_FAULT="kill:rank=1:step=4" plait train run.toml --nproc 2 --max-restarts 1

makes rank 1 SIGKILL itself right after step 4 (after that step's checkpoint, if one is due):
the elastic agent sees the dead rank, stops the others, restarts all ranks, and they resume
from the newest complete checkpoint. Kinds:

* ``kill``: SIGKILL (no cleanup, no exception: what an out-of-memory kill or a lost node does);
* ``hang``: sleep forever (a stuck peer): the others' next collective times out.

A fault fires only in the first attempt (TORCHELASTIC_RESTART_COUNT = 0), so the restarted job
runs through. Without PLAIT_FAULT nothing here does anything.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from plait.errors import ConfigError

ENV = "PLAIT_FAULT"
KINDS = ("kill", "hang")


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
    if not text or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return None
    return parse_fault(text)


def maybe_inject(rank: int, step: int, fault: Fault | None = None) -> None:
    """Called by every rank after each step; fires the planned fault on its rank and step."""
    fault = fault if fault is not None else planned_fault()
    if fault is None or fault.rank != rank or fault.step != step:
        return
    print(f"plait: {ENV}: injecting {fault.kind!r} on rank {rank} after step {step}", file=sys.stderr, flush=True)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # "hang"
        time.sleep(3600)
