"""benchmarks/gpu_check.py on CPU (the CI size): it runs every part, writes its JSON, and refuses a device it lacks.

One run of the script is shared by the structure and value checks (it takes tens of seconds on two cores)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=ENV, timeout=300)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    result = run_script("--device", "cpu", "--quick", "--out", str(out))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result, json.loads((out / "gpu_check.json").read_text()), out


@pytest.mark.dist
def test_writes_every_part_as_json(cpu_run):
    result, data, out = cpu_run
    assert data["device"] == "cpu" and data["quick"] is True
    for name, key in (("precision.json", "precision"), ("profile.json", "profile"), ("grid.json", "grid")):
        assert json.loads((out / name).read_text()) == data[key]
    assert "Single-device plans" in result.stdout and "grid: " in result.stdout


@pytest.mark.dist
def test_losses_fall_and_bf16_matches_fp32(cpu_run):
    _, data, _ = cpu_run
    rows = data["precision"]
    assert {r["model"] for r in rows} == {"tiny-llama", "hf-llama"}
    assert any(r["source"].startswith("hf:") for r in rows)  # the Hugging Face class itself ran
    for r in rows:
        for losses in (r["fp32_losses"], r["bf16_losses"]):
            assert len(losses) >= 3 and all(math.isfinite(x) for x in losses)
            assert losses[-1] < losses[0] - 0.1
        assert r["loss_falls"] and r["within_tolerance"]
        assert max(abs(b - f) / f for b, f in zip(r["bf16_losses"], r["fp32_losses"])) <= r["tolerance"] <= 0.05
        assert r["bf16_computed_in"] == "bfloat16"  # a bf16 plan computes in bf16 on CPU too (autocast)


@pytest.mark.dist
def test_profile_rows_compare_with_the_local_preset(cpu_run):
    _, data, _ = cpu_run
    profile = data["profile"]
    assert profile["preset"] == "local-cpu" and profile["memory_bytes_available"] > 0
    names = {r["name"] for r in profile["rows"]}
    assert {"attention", "block"} <= names and len(names) >= 4
    for r in profile["rows"]:
        assert r["seconds"] > 0 and 0 < r["assumed_fraction"] <= 1
        assert r["fraction_of_peak"] == pytest.approx(r["flops"] / r["seconds"] / profile["peak_flops"])


@pytest.mark.dist
def test_every_grid_row_has_predicted_and_measured_fields(cpu_run):
    _, data, _ = cpu_run
    rows, summary = data["grid"]["rows"], data["grid"]["summary"]
    assert {r["recompute"] for r in rows} == {"none", "selective", "full"}
    assert summary["points"] == len(rows) and summary["measured"] == len(rows)
    for r in rows:
        assert r["status"] == "measured"
        assert r["predicted_step_time_s"] > 0 and r["predicted_peak_bytes"] > r["predicted_allocated_bytes"] > 0
        assert r["step_time_s"] > 0 and len(r["step_times_s"]) >= 2
        assert r["step_time_error"] == pytest.approx(r["predicted_step_time_s"] / r["step_time_s"] - 1)
        assert r["allocated_bytes"] is None and r["reserved_bytes"] is None  # CPU: labelled n/a, not made up
        assert all(math.isfinite(x) for x in r["losses"])
    assert summary["median_step_time_error"] >= 0 and summary["median_allocated_error"] is None


def test_cuda_without_a_gpu_exits_2_with_a_message(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    result = run_script("--device", "cuda", "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "--device cuda" in result.stderr and "no CUDA device" in result.stderr and "--device cpu" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_unknown_device_exits_2_naming_the_choices(tmp_path):
    result = run_script("--device", "tpu", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "tpu" in result.stderr and "cuda" in result.stderr and "cpu" in result.stderr


def test_a_shape_that_is_not_micro_batch_x_sequence_exits_2(tmp_path):
    result = run_script("--shapes", "1x1024,2y8", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "'2y8' is not micro-batch x sequence" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


RESULTS = SCRIPT.parent / "results" / "gpu"


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_reprice", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("run", sorted(p.name for p in RESULTS.iterdir()))
def test_the_gpu_presets_price_the_saved_gpu_runs_within_the_targets(run):
    """The grids the GPU constants came from (benchmarks/results/gpu), priced again by this tree: a constant that
    moves away from what those GPUs measured fails here, without a GPU."""
    from plait.spec.clusters import CLUSTER_PRESETS

    gpu_check = _gpu_check_module()
    header, rows = gpu_check.saved_grid(RESULTS / run)
    assert len(rows) >= 40 and header["device"] == "cuda"
    summary = gpu_check.grid_summary(gpu_check.reprice(rows, CLUSTER_PRESETS[header["preset"]]))
    assert summary["median_step_time_error"] <= gpu_check.TARGETS["step_time"], summary
    assert summary["median_allocated_error"] <= gpu_check.TARGETS["memory"], summary


def test_reprice_takes_only_a_saved_cuda_run_and_its_options_need_it(tmp_path):
    (tmp_path / "gpu_check.json").write_text(json.dumps({"device": "cpu", "grid": {"rows": []}}))
    refused = run_script("--reprice", str(tmp_path))
    assert refused.returncode == 2 and "only CUDA grids" in refused.stderr and "Traceback" not in refused.stderr
    missing = run_script("--reprice", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "not a gpu_check output folder" in missing.stderr
    alone = run_script("--fit-host")
    assert alone.returncode == 2 and "go with --reprice" in alone.stderr
    wrong = run_script("--reprice", str(RESULTS / "h100-2026-11-26-a"), "--cluster", "h300")
    assert wrong.returncode == 2 and "'h300'" in wrong.stderr and "h100-80g" in wrong.stderr
