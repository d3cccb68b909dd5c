"""One launch per world size runs every case of tests/dist/equivalence_cases.py; the tests read its results."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from plait.launch import run_local

WORKER = Path(__file__).parent / "_equivalence_worker.py"
LAUNCH_TIMEOUT_S = 600


class _Results:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.by_world: dict[int, dict] = {}

    def get(self, world: int) -> dict:
        if world not in self.by_world:
            out = self.tmp / f"results-{world}.json"
            os.environ.setdefault("PLAIT_OMP_THREADS", "1")
            code = run_local(world, [str(WORKER), str(world), str(out)], module=None, timeout_s=LAUNCH_TIMEOUT_S)
            results = json.loads(out.read_text()) if out.exists() else {}
            self.by_world[world] = {"exit_code": code, "cases": results}
        return self.by_world[world]


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory) -> _Results:
    return _Results(tmp_path_factory.mktemp("dist"))
