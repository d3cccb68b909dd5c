"""What a local run plans on when nobody has profiled this machine: a quick profile, measured once and cached.

`plan.cluster = "local-cpu"` (the default) is plait's generic CPU preset, nobody's machine in particular: its
predictions are off by several times here. So a `plait train` that plans for it ("auto") first looks for a quick
profile of this machine (`plait profile --quick` on the run's rank count, plait/profile/cache.py keys it by host,
CPU, cores, versions, ranks and threads), measures one when there is none (seconds; once per machine and rank
count), and plans on it, saying so in one line. `plan.profile = false` (`plait train --no-profile`) or
PLAIT_NO_PROFILE=1 plans on the preset instead, and the run says its predictions are uncalibrated. A profile that
fails does not stop the run: it says why, and plans on the preset.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

UNCALIBRATED_PRESET = "local-cpu"
"""plait's generic CPU preset: its figures are nobody's machine in particular."""
NO_PROFILE_ENV = "PLAIT_NO_PROFILE"
"""Set to 1: never measure a quick profile (plan on the preset), whatever the config says; the test suite sets it."""
PROFILE_TIMEOUT_S = 300.0


def wants_quick_profile(config: Any) -> bool:
    """True when this run plans ("auto") on the uncalibrated preset and may measure this machine instead."""
    return (config.plan.file == "auto" and config.plan.cluster == UNCALIBRATED_PRESET and config.plan.profile
            and os.environ.get(NO_PROFILE_ENV, "") in ("", "0"))


def with_quick_profile(config: Any, devices: int, say: Callable[[str], None],
                       measure: Callable[[int, Path], str | None] | None = None, root: Path | None = None) -> Any:
    """`config` planning on this machine's cached quick profile of `devices` ranks (measured now when there is none
    yet), or `config` itself when it does not want one or the profile failed. `say` gets the one line about it;
    `measure(devices, out)` writes a profile and returns None, or why it failed (default: `plait profile --quick`)."""
    from plait.profile.cache import cached_profile, machine_key, profile_path

    if not wants_quick_profile(config) or _has_gpus():
        return config
    key = machine_key(devices)
    path = cached_profile(key, root)
    if path is not None:
        say(f"plait train: planning on this machine's quick profile ({path}; {key.describe()}); `plait profile` "
            f"measures a thorough one, --no-profile plans on the uncalibrated {UNCALIBRATED_PRESET!r} preset")
    else:
        path = profile_path(key, root)
        say(f"plait train: no profile of this machine for {devices} ranks yet: measuring a quick one (`plait profile "
            f"--quick`, once per machine and rank count, kept in {path.parent}; --no-profile skips it)")
        started = time.perf_counter()
        failure = (measure or quick_profile)(devices, path)
        if failure is not None:
            say(f"plait train: the quick profile failed ({failure}); planning on the uncalibrated "
                f"{UNCALIBRATED_PRESET!r} preset")
            return config
        say(f"plait train: measured in {time.perf_counter() - started:.0f} s; planning on it")
    return config.replace(plan=dataclasses.replace(config.plan, cluster=str(path)))


def quick_profile(devices: int, out: Path) -> str | None:
    """Run `plait profile --quick --nproc DEVICES --out OUT` quietly; None, or the last line it printed on failure."""
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "plait", "profile", "--quick", "--nproc", str(devices), "--out", str(out)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROFILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"no result after {PROFILE_TIMEOUT_S:.0f} s"
    if done.returncode == 0 and out.is_file():
        return None
    lines = (done.stderr + done.stdout).strip().splitlines()
    return f"exit code {done.returncode}: {lines[-1] if lines else 'no output'}"


def uncalibrated_note(plan: Any) -> str | None:
    """The line a run planned on the preset starts with, else None."""
    if plan.cluster.name != UNCALIBRATED_PRESET:
        return None
    return (f"plait train: note: the plan's predictions use the {UNCALIBRATED_PRESET!r} preset, not measured on this "
            f"machine (uncalibrated: expect them off by several times); `plait profile` writes a cluster file of this "
            f"machine to plan with")


def _has_gpus() -> bool:
    """A quick profile of a GPU machine would plan for its GPUs, not for the CPU preset the config named."""
    import torch

    return torch.cuda.is_available()
