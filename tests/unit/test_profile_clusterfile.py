"""The cluster file: written atomically, read back equal, bad files refused naming what is wrong."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from plait.cli import main as cli_main
from plait.errors import ConfigError
from plait.profile import clusterfile
from plait.profile.clusterfile import read_cluster_file, validate_cluster_for_world, write_cluster_file
from plait.spec.cluster import HOST_FIELDS, ClusterSpec, Efficiency, LinkSpec

CLUSTER = ClusterSpec(name="profiled-test", num_devices=4, devices_per_node=4, memory_bytes=3.5e9,
                      peak_flops=4.2e10, efficiency=Efficiency(matmul=1.0, matmul_half_dim=73.1, overhead=0.21),
                      intra_node=LinkSpec(latency_s=1.5e-4, bandwidth=2.6e9),
                      inter_node=LinkSpec(latency_s=1.5e-4, bandwidth=2.6e9), device_type="cpu", backend="gloo")


def written(tmp_path: Path, **changes) -> Path:
    return write_cluster_file(tmp_path / "cluster.yaml", CLUSTER.replace(**changes) if changes else CLUSTER,
                              ["measured: today", "links: fitted"])


def test_round_trip_with_comments(tmp_path):
    path = written(tmp_path)
    text = path.read_text()
    assert text.startswith("# measured: today\n# links: fitted\n")
    assert read_cluster_file(path) == CLUSTER
    assert ClusterSpec.from_dict(yaml.safe_load(text)) == CLUSTER
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.yaml"]  # no temporary left behind


def test_the_planners_loader_accepts_it(tmp_path):
    from plait.spec.load import load_cluster

    assert load_cluster(str(written(tmp_path))) == CLUSTER


def test_files_of_older_plait_keep_host_time_under_efficiency(tmp_path):
    """Cluster files written before HostOverheads held the executor's host time under `efficiency`: read there
    still (same names, moved to `host`), by the profile reader, the planner's loader and a plan's cluster."""
    import dataclasses

    from plait.spec.cluster import HostOverheads
    from plait.spec.load import load_cluster

    profiled = CLUSTER.replace(host=HostOverheads(layer_overhead_s=6e-4, tp_layer_overhead_s=9e-3, step_overhead_s=5e-3))
    old = profiled.to_dict()
    old["efficiency"].update(old.pop("host"))  # the layout of plait before this change
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old, sort_keys=False))
    assert read_cluster_file(path) == profiled
    assert load_cluster(str(path)) == profiled
    assert ClusterSpec.from_dict(old) == profiled
    from plait.plan import Plan
    from plait.spec import TrainSpec
    from plait.spec.models import MODEL_PRESETS

    plan = Plan.of(dp=4, model=MODEL_PRESETS["tiny-gpt"], train=TrainSpec(global_batch=4, seq_len=16), cluster=profiled)
    assert Plan.from_dict({**plan.to_dict(), "cluster": old}) == plan  # a plan file of an older plait
    both = {**old, "host": {"layer_overhead_s": 1e-3}}
    path.write_text(yaml.safe_dump(both, sort_keys=False))
    with pytest.raises(ConfigError, match="'layer_overhead_s' is given both under efficiency"):
        read_cluster_file(path)
    assert not {f.name for f in dataclasses.fields(Efficiency)} & set(HOST_FIELDS)  # hardware figures only


def test_failed_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    path = written(tmp_path)
    before = path.read_bytes()

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(clusterfile.os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        write_cluster_file(path, CLUSTER.replace(num_devices=8, devices_per_node=8))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.yaml"]


def test_failed_first_write_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(clusterfile.os, "replace", lambda a, b: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        write_cluster_file(tmp_path / "new.yaml", CLUSTER)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("field", ["peak_flops", "memory_bytes", "num_devices", "intra_node", "backend"])
def test_missing_top_field_is_named(tmp_path, field):
    data = CLUSTER.to_dict()
    del data[field]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=f"missing field '{field}'"):
        read_cluster_file(path)


@pytest.mark.parametrize("outer,inner", [("efficiency", "overhead"), ("inter_node", "bandwidth")])
def test_missing_nested_field_is_named(tmp_path, outer, inner):
    data = CLUSTER.to_dict()
    del data[outer][inner]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=f"missing field '{outer}.{inner}'"):
        read_cluster_file(path)


def test_malformed_yaml_names_the_line(tmp_path):
    path = written(tmp_path)
    lines = path.read_text().splitlines()
    bad_line = next(i for i, line in enumerate(lines) if line.startswith("peak_flops"))
    lines[bad_line] = "peak_flops: [1, 2"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"malformed YAML at line \d+"):
        read_cluster_file(path)


@pytest.mark.parametrize("text,match", [
    ("- just\n- a list\n", "expected a mapping"),
    ("", "is empty"),
])
def test_not_a_mapping(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        read_cluster_file(path)


def test_unknown_key_and_bad_value_named(tmp_path):
    data = CLUSTER.to_dict() | {"gpus_per_box": 8}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="unknown key 'gpus_per_box'"):
        read_cluster_file(path)
    data = CLUSTER.to_dict()
    data["intra_node"]["bandwidth"] = -1
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="bandwidth"):
        read_cluster_file(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist.*plait profile"):
        read_cluster_file(tmp_path / "nope.yaml")


def test_world_size_checked(tmp_path):
    path = written(tmp_path)
    assert validate_cluster_for_world(path, 4) == CLUSTER
    assert validate_cluster_for_world(CLUSTER, 4, device_type="cpu") == CLUSTER
    with pytest.raises(ConfigError, match=r"num_devices=4 but this run has 2 ranks.*--nproc 2"):
        validate_cluster_for_world(path, 2)
    with pytest.raises(ConfigError, match="device_type='cpu'"):
        validate_cluster_for_world(path, 4, device_type="cuda")
    with pytest.raises(ConfigError, match="whole number of nodes"):
        validate_cluster_for_world(CLUSTER.replace(num_devices=6), 6)


def test_cli_refuses_bad_arguments_before_launching(tmp_path, capsys):
    assert cli_main(["profile", "--nproc", "1", "--out", str(tmp_path / "c.yaml")]) == 2
    assert "--nproc 1" in capsys.readouterr().err
    assert cli_main(["profile", "--nproc", "2", "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_cli_module_is_cheap_to_import():
    import subprocess
    import sys

    code = "import sys, plait.commands.profile; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ))
    assert out.stdout.strip() == "False"
