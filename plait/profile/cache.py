"""Quick profiles kept per machine: what a `local-cpu` run plans on when nobody has profiled this machine yet.

A cluster file measures one machine run one way: the host, its CPU model and the cores this process may use,
the torch and plait versions that ran the timings, the number of ranks and the threads each rank runs (ranks
share cores, so 2 ranks and 4 ranks see different rates). `MachineKey` holds those; its digest names the cached
file, so a machine, a version or a rank count that changes finds no file and profiles again, and an unreadable
file is measured again rather than trusted.

    PLAIT_CACHE_DIR/profiles/quick-<digest>.yaml    (default PLAIT_CACHE_DIR: $XDG_CACHE_HOME/plait, ~/.cache/plait)
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from plait.errors import ConfigError

CACHE_ENV = "PLAIT_CACHE_DIR"


@dataclass(frozen=True, kw_only=True)
class MachineKey:
    """What a quick profile's figures depend on; another value of any field is another machine to measure."""

    host: str
    cpu_model: str
    cores: float
    """Cores this process may run on (affinity, capped by a cgroup quota)."""
    torch_version: str
    plait_version: str
    nproc: int
    threads_per_rank: int

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return (f"{self.host}, {self.cpu_model}, {self.cores:g} cores, torch {self.torch_version}, {self.nproc} ranks "
                f"x {self.threads_per_rank} thread(s)")


def machine_key(nproc: int) -> MachineKey:
    """This machine's key for a profile on `nproc` local ranks started by plait's launcher."""
    import torch

    from plait.cli import version
    from plait.runtime.launch import rank_threads, usable_cores

    return MachineKey(host=socket.gethostname(), cpu_model=cpu_model(), cores=usable_cores(),
                      torch_version=torch.__version__, plait_version=version(), nproc=nproc,
                      threads_per_rank=rank_threads(nproc))


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cache_dir() -> Path:
    """PLAIT_CACHE_DIR, else $XDG_CACHE_HOME/plait, else ~/.cache/plait."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plait"


def profile_path(key: MachineKey, root: Path | None = None) -> Path:
    return (root or cache_dir()) / "profiles" / f"quick-{key.digest()}.yaml"


def cached_profile(key: MachineKey, root: Path | None = None) -> Path | None:
    """The cached quick profile of `key`'s machine when there is one that reads as a cluster file of `key.nproc`
    ranks; None when it must be measured (none yet, or a file that does not read: it is measured again)."""
    from plait.profile.clusterfile import read_cluster_file

    path = profile_path(key, root)
    if not path.is_file():
        return None
    try:
        cluster = read_cluster_file(path)
    except ConfigError:
        return None
    return path if cluster.num_devices == key.nproc else None
