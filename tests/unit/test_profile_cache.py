"""The quick profile a local-cpu run plans on: its cache key, reuse, invalidation and opt-outs (no ranks started:
the measurement is a stand-in that writes a cluster file)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from plait.commands.train import overrides_of
from plait.profile.cache import CACHE_ENV, MachineKey, cache_dir, cached_profile, machine_key, profile_path
from plait.profile.clusterfile import read_cluster_file, write_cluster_file
from plait.spec.load import load_cluster
from plait.profile.quick import NO_PROFILE_ENV, with_quick_profile
from plait.train.config import load_config

KEY = MachineKey(host="box", cpu_model="Some CPU", cores=2.0, torch_version="2.13.0", plait_version="0.1",
                 nproc=2, threads_per_rank=1)


@pytest.fixture(autouse=True)
def allow_profiles(monkeypatch):
    monkeypatch.delenv(NO_PROFILE_ENV, raising=False)  # tests/conftest.py turns quick profiles off elsewhere


class FakeProfiler:
    """Writes a cluster file of `devices` ranks as `plait profile --quick` would, and counts its calls."""

    def __init__(self, failure: str | None = None) -> None:
        self.calls: list[int] = []
        self.failure = failure

    def __call__(self, devices: int, out: Path) -> str | None:
        self.calls.append(devices)
        if self.failure:
            return self.failure
        cluster = dataclasses.replace(load_cluster("local-cpu").with_devices(devices), name="profiled-box")
        write_cluster_file(out, cluster)
        return None


def test_every_field_of_the_key_names_another_file():
    changed = [dataclasses.replace(KEY, **{name: value}) for name, value in
               (("host", "other"), ("cpu_model", "Other CPU"), ("cores", 4.0), ("torch_version", "2.14.0"),
                ("plait_version", "0.2"), ("nproc", 4), ("threads_per_rank", 2))]
    digests = {KEY.digest(), *(k.digest() for k in changed)}
    assert len(digests) == 1 + len(changed)
    assert dataclasses.replace(KEY).digest() == KEY.digest()


def test_this_machines_key_holds_the_rank_count():
    assert machine_key(2).nproc == 2 and machine_key(4).nproc == 4
    assert machine_key(2).digest() == machine_key(2).digest()
    assert machine_key(2).digest() != machine_key(4).digest()


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "plait"
    assert profile_path(KEY).parent == tmp_path / "xdg" / "plait" / "profiles"


def test_a_first_run_measures_and_a_second_reuses(tmp_path):
    config, said, profiler = load_config(None), [], FakeProfiler()
    first = with_quick_profile(config, 2, said.append, profiler, tmp_path)
    assert profiler.calls == [2]
    assert read_cluster_file(first.plan.cluster).name == "profiled-box"
    assert Path(first.plan.cluster).parent == tmp_path / "profiles"
    assert "measuring a quick one" in said[0] and "--no-profile" in said[0]
    second = with_quick_profile(config, 2, said.append, profiler, tmp_path)
    assert profiler.calls == [2]  # not measured again
    assert second.plan.cluster == first.plan.cluster
    assert "planning on this machine's quick profile" in said[-1]


def test_another_rank_count_or_an_unreadable_file_is_measured_again(tmp_path):
    config, profiler = load_config(None), FakeProfiler()
    two = with_quick_profile(config, 2, lambda _: None, profiler, tmp_path)
    four = with_quick_profile(config, 4, lambda _: None, profiler, tmp_path)
    assert profiler.calls == [2, 4] and two.plan.cluster != four.plan.cluster
    Path(two.plan.cluster).write_text("name: [broken\n")
    assert cached_profile(machine_key(2), tmp_path) is None
    again = with_quick_profile(config, 2, lambda _: None, profiler, tmp_path)
    assert profiler.calls == [2, 4, 2] and again.plan.cluster == two.plan.cluster
    assert read_cluster_file(again.plan.cluster).num_devices == 2


@pytest.mark.parametrize("overrides", [["plan.profile=false"], ['plan.cluster="h100-80g"'], ['plan.file="plan.json"']])
def test_no_profile_unless_the_run_plans_on_the_preset(tmp_path, overrides):
    config, profiler, said = load_config(None, overrides), FakeProfiler(), []
    assert with_quick_profile(config, 2, said.append, profiler, tmp_path) is config
    assert profiler.calls == [] and said == []


def test_the_environment_switch_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv(NO_PROFILE_ENV, "1")
    config, profiler = load_config(None), FakeProfiler()
    assert with_quick_profile(config, 2, lambda _: None, profiler, tmp_path) is config
    assert profiler.calls == []


def test_a_failed_profile_plans_on_the_preset_and_says_why(tmp_path):
    config, said = load_config(None), []
    assert with_quick_profile(config, 2, said.append, FakeProfiler("exit code 1: boom"), tmp_path) is config
    assert "failed (exit code 1: boom)" in said[-1] and "'local-cpu'" in said[-1]
    assert cached_profile(machine_key(2), tmp_path) is None


def test_the_no_profile_flag_sets_the_config_key():
    import argparse

    from plait.commands.train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = load_config(None, overrides_of(parser.parse_args(["run.toml", "--no-profile"])))
    assert config.plan.profile is False
    assert load_config(None, overrides_of(parser.parse_args(["run.toml"]))).plan.profile is True
