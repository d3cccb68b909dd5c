"""Starting a run across islands on this machine: plait's lighthouse, a start barrier, one launcher per island.

The parent (`plait train` or `plait check` outside torchrun) checks everything, then starts torchft's lighthouse
(islands.lighthouse = "local") or checks that the one named answers (a multi-node run points every island at the
same one; an unreachable one is one line and exit 2 before any rank starts), holds a TCPStore where the islands
meet before their first step, and starts one `python -m plait ...` per island, each of which starts that island's
ranks with plait's own launcher (plait.runtime.launch.run_local, which restarts them after a failure up to
islands.max_restarts times: the island rejoins and takes the weights from a peer). The parent waits for all and
returns the first failing island's exit code.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

from plait.errors import ConfigError
from plait.train.islands import (
    LIGHTHOUSE_ENV,
    QUIET_ENV,
    STORE_ENV,
    lighthouse_reachable,
    lighthouse_url,
)


@dataclass
class LocalIslands:
    """The running islands of one local run (see `start_islands`)."""

    lighthouse: str
    store_address: str
    processes: list[subprocess.Popen] = field(default_factory=list)
    started_s: float = field(default_factory=time.perf_counter)

    def env(self, island: int) -> dict[str, str]:
        return {**os.environ, **QUIET_ENV, LIGHTHOUSE_ENV: self.lighthouse, STORE_ENV: self.store_address,
                "PYTHONUNBUFFERED": "1"}

    def start(self, island: int, argv: list[str]) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-m", "plait", *argv], env=self.env(island),
                                   start_new_session=True)
        self.processes.append(process)
        return process

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for every island; the first non-zero exit code (the others are stopped then), else 0."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in self.processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                self.stop()
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                print(f"plait: the islands did not finish within {timeout_s:g} s; stopped them", file=sys.stderr)
                return 124
            time.sleep(0.2)

    def stop(self) -> None:
        import signal

        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)


def check_lighthouse(address: str) -> None:
    """A lighthouse named by the config must answer before any rank starts."""
    if address == "local":
        return
    problem = lighthouse_reachable(address)
    if problem:
        raise ConfigError(f"islands.lighthouse={address!r}: no lighthouse answers there ({problem}); start one "
                          "with `torchft_lighthouse --min_replicas 1 --bind [::]:29510`, or set "
                          "islands.lighthouse = \"local\" for a run on this machine")


@contextlib.contextmanager
def start_islands(lighthouse: str = "local") -> Iterator[LocalIslands]:
    """Lighthouse (started here for "local") and the islands' meeting store, for the islands started in the block."""
    import torch.distributed as dist

    check_lighthouse(lighthouse)
    os.environ.update({k: v for k, v in QUIET_ENV.items() if k not in os.environ})
    server = None
    if lighthouse != "local":
        lighthouse = lighthouse_url(lighthouse)
    else:
        from torchft.coordination import LighthouseServer

        # min_replicas 1: when an island fails the others form a quorum without it and train on
        server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000)
        lighthouse = server.address()
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    islands = LocalIslands(lighthouse=lighthouse, store_address=f"localhost:{store.port}")
    try:
        yield islands
    finally:
        islands.stop()
        if server is not None:
            server.shutdown()
        del store
