"""The cores this process may use (plait.runtime.launch.usable_cores): its CPU affinity (taskset, a cgroup's cpuset, Slurm's
binding), capped by a cgroup CPU quota. The local ranks' threads, `plait profile`'s default rank count and the
profile's oversubscription all ask it, so a process bound to fewer cores than the machine has does not run more
threads than it has cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.runtime.launch import threads_per_rank, usable_cores

REPO = Path(__file__).resolve().parents[2]
NO_QUOTA = Path("/nonexistent/cpu.max")


def test_the_affinity_decides_the_cores_not_the_machine(tmp_path):
    assert usable_cores({0, 1}, NO_QUOTA) == 2.0
    assert usable_cores(set(range(8, 24)), NO_QUOTA) == 16.0
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # a container's --cpus 1.5
    assert usable_cores(set(range(8)), quota) == 1.5
    quota.write_text("max 100000\n")
    assert usable_cores(set(range(8)), quota) == 8.0
    quota.write_text("50000 100000\n")  # half a core: still one to run on
    assert usable_cores({0, 1}, quota) == 1.0


def test_local_ranks_split_the_cores_they_may_use():
    assert threads_per_rank(2, usable_cores(set(range(4)), NO_QUOTA)) == 2
    assert threads_per_rank(4, usable_cores({3}, NO_QUOTA)) == 1  # fewer cores than ranks: one thread each
    assert threads_per_rank(2, 1.5) == 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_a_process_bound_to_one_core_runs_one_thread_per_rank_and_profiles_one_rank():
    """Bound to one core (what `taskset -c 0` does), in a process of its own: the launcher's threads, `plait
    profile`'s default --nproc and the machine key of the quick profile's cache all see one core, whatever
    os.cpu_count() says."""
    code = ("import json, os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "from plait.runtime.launch import threads_per_rank, usable_cores\n"
            "from plait.commands.profile import _default_nproc\n"
            "from plait.profile.cache import machine_key\n"
            "print(json.dumps([usable_cores(), threads_per_rank(1), _default_nproc(), machine_key(1).cores,"
            " os.cpu_count()]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    cores, threads, nproc, key_cores, machine = json.loads(done.stdout.strip().splitlines()[-1])
    assert (cores, threads, nproc, key_cores) == (1.0, 1, 1, 1.0)
    assert machine >= 1
