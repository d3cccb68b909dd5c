"""`plait tune` end to end, as a user runs it: time the top plans on 2 local ranks, write a corrected
cluster file plait reads back, and a plot; refuse a bad cluster file before starting any rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from plait.profile.clusterfile import read_cluster_file, render_cluster_yaml
from plait.spec.cluster import ClusterSpec, Efficiency, LinkSpec
from plait.spec.load import load_cluster

ROOT = Path(__file__).resolve().parents[2]
LINK = LinkSpec(latency_s=100e-6, bandwidth=1e9)
# Ten times faster than a 2-core CPU computes: the timings must show it whatever else loads the machine, so the
# fit always has a constant to find (with a near-right cluster, noise on a busy machine can leave it nothing).
PROFILED = ClusterSpec(name="profiled-test", num_devices=2, devices_per_node=2, memory_bytes=4 * 2**30,
                       peak_flops=3e11, efficiency=Efficiency(matmul=1.0, matmul_half_dim=50.0, overhead=0.3),
                       intra_node=LINK, inter_node=LINK, device_type="cpu", backend="gloo")


def plait_tune(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "220"}
    return subprocess.run([sys.executable, "-m", "plait", "tune", "--model", "tiny-gpt", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tune")
    cluster = write(folder / "cluster.yaml", render_cluster_yaml(PROFILED, ["written by the test"]))
    result = plait_tune("--cluster", str(cluster), "--nproc", "2", "--top", "2", "--steps", "3", "--warmup", "1",
                        "--global-batch", "4", "--seq-len", "64", "--out", str(folder / "tuned.yaml"),
                        "--plot", str(folder / "tuned.png"))
    assert result.returncode == 0, result.stderr[-3000:]
    return result, folder


@pytest.mark.dist
def test_tune_prints_predicted_against_measured(tuned):
    result, _ = tuned
    out = result.stdout
    for header in ("predicted s", "measured s", "error", "tuned s"):
        assert header in out
    assert "measured best" in out
    assert "before tuning; after: in-sample" in out and "held out" in out  # the held-out error beside in-sample
    assert "ranks the measured best plan first:" in out
    assert out.count("recompute=") == 2  # two plans timed


@pytest.mark.dist
def test_tune_writes_a_cluster_file_plait_reads(tuned):
    _, folder = tuned
    path = folder / "tuned.yaml"
    cluster = read_cluster_file(path)  # strict: every field present
    assert cluster == load_cluster(str(path))
    assert cluster.name == "profiled-test-tuned"
    assert cluster.num_devices == 2 and cluster.device_type == "cpu"
    assert cluster.peak_flops == PROFILED.peak_flops  # the fit moves efficiency and links, not the peak
    fitted = (cluster.efficiency, cluster.intra_node, cluster.inter_node)
    assert fitted != (PROFILED.efficiency, PROFILED.intra_node, PROFILED.inter_node)  # a ten-times error was corrected
    assert path.read_text().startswith("# Written by `plait tune`")
    assert not list(folder.glob(".tuned.yaml.*"))  # no temporary left behind
    png = folder / "tuned.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def _refused(tmp_path: Path, cluster_text: str, *extra: str) -> subprocess.CompletedProcess:
    cluster = write(tmp_path / "bad.yaml", cluster_text)
    result = plait_tune("--cluster", str(cluster), *extra, "--out", str(tmp_path / "out.yaml"), timeout=120)
    assert result.returncode == 2, result.stderr
    assert not (tmp_path / "out.yaml").exists()
    assert "Traceback" not in result.stderr
    return result


def test_malformed_cluster_file_is_refused(tmp_path):
    result = _refused(tmp_path, "name: x\nnum_devices: [2\n")
    assert "malformed YAML" in result.stderr and "bad.yaml" in result.stderr


def test_cluster_file_of_another_world_size_is_refused(tmp_path):
    result = _refused(tmp_path, render_cluster_yaml(PROFILED), "--nproc", "4")
    assert "num_devices=2" in result.stderr and "4 ranks" in result.stderr


def test_cluster_file_missing_a_field_is_refused(tmp_path):
    data = yaml.safe_load(render_cluster_yaml(PROFILED))
    del data["efficiency"]["overhead"]
    result = _refused(tmp_path, yaml.safe_dump(data))
    assert "missing field 'efficiency.overhead'" in result.stderr


def test_unknown_model_is_refused(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "plait", "tune", "--model", "no-such-model", "--out",
                          str(tmp_path / "o.yaml")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no-such-model" in bad.stderr
