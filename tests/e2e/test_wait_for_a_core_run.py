"""A real run whose two ranks share one core (the launcher bound to it, as `taskset -c 0 plait train` binds it): each
rank records how long it sat ready to run without a core, inside its compute and before its optimizer, and the run
reports its parts less that wait, the wall clock's beside them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "250"}
ENV.pop("PLAIT_OMP_THREADS", None)  # the launcher's own split of the one core: one thread a rank
STEPS = 8


@pytest.mark.dist
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity and the run-queue delay are Linux's")
def test_two_ranks_on_one_core_report_their_steps_less_the_wait(tmp_path):
    from plait.train.measure import read_measured

    core = min(os.sched_getaffinity(0))
    config = tmp_path / "run.toml"
    config.write_text(f"""
[train]
steps = {STEPS}
global_batch = 8
seq_len = 64
[plan]
pins = {{ dp = 2 }}
[log]
dir = "{tmp_path / 'logs'}"
""")
    result = subprocess.run([sys.executable, "-m", "plait", "train", str(config), "--nproc", "2", "--no-profile"],
                            capture_output=True, text=True, env=ENV, timeout=300,
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    assert result.returncode == 0, result.stderr[-3000:]
    [segment] = read_measured(tmp_path / "logs")
    eps = 1e-4
    for record in segment.ranks:
        assert len(record.queued_s) == len(record.queued_train_s) == len(record.queued_compute_s) == STEPS
        for q, q_train, q_compute, compute in zip(record.queued_s, record.queued_train_s, record.queued_compute_s,
                                                  record.compute_s):
            assert 0 <= q_compute <= q_train + eps and q_train <= q + eps and q_compute <= compute + eps
    # both ranks compute at once on one core: each waits for the other's share of it
    wall, less = segment.measured(wall_clock=True), segment.measured()
    assert segment.queued_share() > 0.1
    assert less.compute < 0.9 * wall.compute and less.step < 0.9 * wall.step
    assert "wall clock s" in result.stdout and "other work shared the cores" in result.stdout
