"""One launch per world size runs every case of tests/dist/equivalence_cases.py; the tests read its results."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from plait.runtime.launch import run_local

WORKER = Path(__file__).parent / "_equivalence_worker.py"
EXAMPLE_MODULES = Path(__file__).parents[2] / "examples" / "custom"  # the module:factory example's package
LAUNCH_TIMEOUT_S = 900


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """config.json of a tiny model of every Hugging Face family plait runs (written locally, nothing downloaded)."""
    from plait.hf.tiny import FAMILIES, WINDOWED_CONFIGS, write_tiny_config

    root = tmp_path_factory.mktemp("hf")
    for family in (*FAMILIES, *WINDOWED_CONFIGS):
        write_tiny_config(family, root / family)
    return root


class _Results:
    def __init__(self, tmp: Path, hf_dir: Path) -> None:
        self.tmp, self.hf_dir = tmp, hf_dir
        self.by_world: dict[int, dict] = {}

    def get(self, world: int) -> dict:
        if world not in self.by_world:
            out = self.tmp / f"results-{world}.json"
            os.environ.setdefault("PLAIT_OMP_THREADS", "1")
            os.environ["PLAIT_TEST_HF_DIR"] = str(self.hf_dir)
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLE_MODULES), os.environ.get("PYTHONPATH")]))
            code = run_local(world, [str(WORKER), str(world), str(out)], module=None, timeout_s=LAUNCH_TIMEOUT_S)
            results = json.loads(out.read_text()) if out.exists() else {}
            self.by_world[world] = {"exit_code": code, "cases": results}
        return self.by_world[world]


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory, tiny_hf_dir) -> _Results:
    return _Results(tmp_path_factory.mktemp("dist"), tiny_hf_dir)
