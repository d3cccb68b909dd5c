"""The GPU presets' fitted constants are what the saved runs in the repository give: benchmarks/gpu_refit.py refits
GPU_HOST and each measured GPU's memory_balance from benchmarks/results/gpu/ with this tree's cost model, and the
shipped figures (plait/spec/clusters.py) lie within its rounding of them. A pricing change that moves the fit fails
here, and the constants are refit, not left behind."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_refit.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_refit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_shipped_gpu_constants_are_their_refit(capsys, tmp_path):
    refit = _script()
    assert refit.main(["--check"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "memory_balance h200-141g" in out and "layer_overhead_ms" in out  # every run was read and refit
    assert refit.main(["--runs", str(tmp_path)]) == 2  # not a saved run: one line, no traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--runs" in err[0] and "not a gpu_check output folder" in err[0]
