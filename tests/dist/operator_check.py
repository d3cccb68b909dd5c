"""`plait check` of a per-operator plan on its ranks, from a subprocess as a user runs it: the plan written to
`tmp_path`, the examples' modules on PYTHONPATH; the verdict must be EQUAL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "operators"


def check_equal(plan, tmp_path: Path, steps: int = 2) -> str:
    """Run `plait check --plan` on `plan` for `steps` steps; its stdout (asserted EQUAL)."""
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    env = {**os.environ, "PLAIT_OMP_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "plait", "check", "--plan", str(path), "--steps", str(steps)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "EQUAL" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout
