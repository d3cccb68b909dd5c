"""The run measures itself and adapts, through the real `plait train` on 4 gloo ranks (a tiny GPT, few steps).

* Without --adapt: the run ends with the predicted-against-measured table, LOG_DIR/measured.json holds every
  rank's timings of every step, and `plait tune --from-run LOG_DIR` fits from them (or refuses, exit 2, writing
  nothing) without timing anything.
* With --adapt and rank 3 throttled 6x (PLAIT_THROTTLE): plait finds the straggler, re-plans, switches plans in
  the middle of the run, logs why, and the losses are those of the run that never switched.

The switch's cost is set to 0 (PLAIT_ADAPT_SWITCH_S) so that whether it pays does not hang on this machine's
speed; that decision is tested in tests/unit/test_adapt.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from run_configs import write_run_config  # noqa: E402

pytestmark = pytest.mark.dist

MODEL = {"name": "adapt-tiny-gpt", "arch": "gpt", "num_layers": 8, "hidden_size": 32, "num_heads": 4,
         "vocab_size": 128, "max_seq_len": 32}
STEPS = 16


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="plait-adapt-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def train(root: Path, name: str, *args: str, throttle: str | None = None) -> subprocess.CompletedProcess:
    config = write_run_config(root, name, MODEL, {"train": {"steps": STEPS, "global_batch": 16, "seq_len": 16, "seed": 7},
                                                  "optimizer": {"warmup": 2}, "plan": {"devices": 4},
                                                  "log": {"dir": str(root / name)}})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1", "PLAIT_ADAPT_SWITCH_S": "0",
           "PLAIT_DIST_TIMEOUT_S": "60", "COLUMNS": "200"}
    env.pop("PLAIT_THROTTLE", None)
    if throttle:
        env["PLAIT_THROTTLE"] = throttle
    return subprocess.run([sys.executable, "-m", "plait", "train", str(config), "--nproc", "4", *args], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def plain(root: Path) -> subprocess.CompletedProcess:
    result = train(root, "plain")
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def losses(log_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_run_ends_with_predicted_against_measured(root: Path, plain: subprocess.CompletedProcess) -> None:
    out = plain.stdout
    assert "predicted vs measured per step" in out and "compute per rank" in out
    for part in ("compute (layers", "waiting (pipeline bubble", "optimizer (clipping", "step"):
        assert part in out
    from plait.train.measure import read_measured

    [segment] = read_measured(root / "plain")
    assert sorted(r.rank for r in segment.ranks) == [0, 1, 2, 3]
    for record in segment.ranks:
        assert record.steps == list(range(1, STEPS + 1))
        for step, trained, compute, optimizer in zip(record.step_s, record.train_s, record.compute_s,
                                                     record.optimizer_s):
            assert 0 < compute <= trained and trained + optimizer <= step * (1 + 1e-9)
    measured = segment.measured()
    assert measured.step > 0 and measured.compute > 0 and measured.optimizer > 0


def test_tune_fits_from_the_run_without_timing_anything(root: Path, plain: subprocess.CompletedProcess) -> None:
    out = root / "from-run.yaml"
    result = subprocess.run([sys.executable, "-m", "plait", "tune", "--from-run", str(root / "plain"), "--out",
                             str(out)], env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True,
                            timeout=300)
    assert "tune: timing" not in result.stderr  # nothing was run
    assert "(compute part)" in result.stdout and "(optimizer part)" in result.stdout
    assert "before tuning; after: in-sample" in result.stdout
    if result.returncode == 0:  # a busy machine's timings may not identify anything: then it must refuse
        from plait.profile.clusterfile import read_cluster_file

        assert read_cluster_file(out).efficiency.matmul <= 1
    else:
        assert result.returncode == 2 and "was not written" in result.stderr and not out.exists()
        assert "Train longer" in result.stderr


def test_adapt_switches_away_from_a_slow_rank_exactly(root: Path, plain: subprocess.CompletedProcess) -> None:
    result = train(root, "adapted", "--adapt", throttle="rank=3:factor=6")
    assert result.returncode == 0, result.stderr[-3000:]
    decisions = [json.loads(line) for line in (root / "adapted" / "adapt.jsonl").read_text().splitlines()]
    switches = [d for d in decisions if d["action"] == "switch"]
    assert switches, result.stderr[-3000:]
    assert "rank 3 computes" in switches[0]["reason"]
    speeds = switches[0]["figures"]["speeds"]  # the others share 2 cores with 3 ranks: their speeds are noisy
    assert speeds[3] > 2 and speeds[3] > 2 * max(speeds[:3]), speeds
    assert "plait: adapt at step" in result.stderr and "switched to" in result.stderr
    first = json.loads((root / "plain" / "plan.json").read_text())
    last = json.loads((root / "adapted" / "plan.json").read_text())
    assert last == switches[-1]["plan"] and last != first  # a restart would resume under the new plan
    assert "(plan 2 of" in result.stdout
    assert not (root / "adapted" / "adapt-checkpoint").exists()
    a, b = losses(root / "adapted"), losses(root / "plain")
    assert len(a) == len(b) == STEPS
    assert max(abs(x - y) / abs(y) for x, y in zip(a, b)) <= 1e-5  # the switch is exact, like a resume
