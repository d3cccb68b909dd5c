"""`plait profile` on real ranks (gloo, CPU): a quick 2-rank profile writes a file plait loads; a profile
killed or failing part-way leaves no file (and an old one untouched)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from plait.errors import ConfigError
from plait.profile.clusterfile import read_cluster_file, validate_cluster_for_world
from plait.spec.cluster import ClusterSpec
from plait.spec.load import load_cluster

pytestmark = pytest.mark.dist

ENV = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="120")


def plait(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plait", *argv], env=ENV, capture_output=True, text=True,
                          timeout=240, **kwargs)


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("profile")
    out, samples = folder / "cluster.yaml", folder / "samples.json"
    result = plait("profile", "--nproc", "2", "--quick", "--out", str(out), "--samples", str(samples))
    return out, samples, result


def test_quick_profile_writes_a_loadable_cluster_file(quick_profile):
    out, samples, result = quick_profile
    assert result.returncode == 0, result.stderr[-3000:]
    cluster = read_cluster_file(out)
    assert cluster == ClusterSpec.from_dict(yaml.safe_load(out.read_text())) == load_cluster(str(out))
    assert (cluster.num_devices, cluster.devices_per_node) == (2, 2)
    assert (cluster.device_type, cluster.backend) == ("cpu", "gloo")
    assert cluster.peak_flops > 1e8 and 0 < cluster.efficiency.matmul <= 1
    assert cluster.intra_node.bandwidth > 1e6 and cluster.intra_node.latency_s >= 0
    assert cluster.inter_node == cluster.intra_node  # one node
    assert 0 < cluster.memory_bytes < 2**50
    assert validate_cluster_for_world(out, 2) == cluster
    with pytest.raises(ConfigError, match="num_devices=2"):
        validate_cluster_for_world(out, 4)
    header = out.read_text().split("name:")[0]
    assert "measured:" in header and "intra_node: latency" in header and "R2" in header
    # host time, from the probe plans timed end to end: CPU processes always spend some per layer pass
    assert "host time (fitted on 8 small plans" in header
    assert cluster.host.layer_overhead_s + cluster.host.tp_layer_overhead_s > 0


def test_quick_profile_prints_fits_and_keeps_raw_samples(quick_profile):
    out, samples, result = quick_profile
    assert "link fits" in result.stdout and "R²" in result.stdout and "max rel" in result.stdout
    assert f"wrote {out}" in result.stdout
    raw = json.loads(samples.read_text())
    collectives = {s["collective"] for s in raw["comm"]["intra_node"]}
    assert collectives == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    assert {s["name"] for s in raw["compute"]} >= {"qkv", "fc1", "attention", "block"}
    assert all(s["seconds"] > 0 for s in raw["comm"]["intra_node"] + raw["compute"])
    assert len(raw["host_steps"]) == 8 and all(s["seconds"] > 0 for s in raw["host_steps"])
    assert "host time:" in result.stdout and "probe plan" in result.stdout


def test_killed_profile_leaves_old_file_untouched(tmp_path):
    out = tmp_path / "cluster.yaml"
    out.write_text("old: contents\n")
    process = subprocess.Popen([sys.executable, "-m", "plait", "profile", "--nproc", "2", "--out", str(out)],
                               env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        _wait_for_progress(process)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert out.read_text() == "old: contents\n"
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.yaml"]


def _wait_for_progress(process: subprocess.Popen) -> None:
    """Block until the progress bar shows a measurement under way (the file is written only at the end)."""
    os.set_blocking(process.stderr.fileno(), False)
    seen, deadline = b"", time.monotonic() + 120
    while b"compute h=" not in seen:
        assert process.poll() is None, f"profile ended before it could be interrupted: {seen[-2000:]!r}"
        assert time.monotonic() < deadline, f"no progress within 120 s: {seen[-2000:]!r}"
        try:
            seen += os.read(process.stderr.fileno(), 65536)
        except BlockingIOError:
            time.sleep(0.1)

def test_profile_failing_part_way_writes_nothing(tmp_path):
    """A rank that dies mid-profile (here: every rank, in the first block measurement) leaves no file."""
    out = tmp_path / "cluster.yaml"
    script = tmp_path / "failing.py"
    script.write_text(
        "import sys\n"
        "import plait.profile.devices as d\n"
        "def boom(*a, **k):\n"
        "    raise RuntimeError('simulated device failure')\n"
        "d.measure_block = boom\n"
        "from plait.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(script), "profile", "--quick", "--out", str(out), "--timeout", "60"]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    assert "simulated device failure" in result.stderr
    assert list(tmp_path.iterdir()) == [script]
