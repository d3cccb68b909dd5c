"""Bad input, measured (part 2): where output goes, empty and garbage files, checkpoint sets nothing can be
resumed from, keys that contradict each other, fault specs that never fire, plans for other machines --
generated with hypothesis and fed to the real commands in this process (the launcher stubbed out).

Judged as in tests/unit/test_bad_input.py (tests/bad_input_world.py): exit code 2, one line naming the
value, no traceback, every checkpoint directory byte for byte as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parents[1]))
from bad_input_world import (  # noqa: E402
    CLUSTER, MODEL, ROOT, SETTINGS, UNWRITABLE, base_config, expect_cli_error, expect_config_error,
    fake_checkpoint, plan_dict, to_toml, tree_digest,
)

PLAN = str(ROOT / "plan.json")
A_FILE = ROOT / "a-file"


pytestmark = pytest.mark.usefixtures("bad_input_root")  # tests/unit/conftest.py


def _valid_train_config() -> str:
    config = base_config()
    config["checkpoint"] = {"dir": str(ROOT / "fresh-ckpt"), "every": 2}  # not resuming: nothing to read
    path = ROOT / "valid.toml"
    path.write_text(to_toml(config))
    return str(path)


# ---- output locations ---------------------------------------------------------------------------------
FILE_OUTPUTS: dict[str, Callable[[str], list[str]]] = {
    "plan --json": lambda v: ["plan", "--model", "tiny-gpt", "--cluster", "local-cpu", "--global-batch", "8",
                              "--seq-len", "64", "--json", v],
    "check --json": lambda v: ["check", "--plan", PLAN, "--json", v],
    "profile --out": lambda v: ["profile", "--nproc", "2", "--out", v],
    "profile --samples": lambda v: ["profile", "--nproc", "2", "--out", str(ROOT / "c.yaml"), "--samples", v],
    "tune --out": lambda v: ["tune", "--model", "tiny-gpt", "--out", v],
    "tune --plot": lambda v: ["tune", "--model", "tiny-gpt", "--out", str(ROOT / "t.yaml"), "--plot", v],
}
DIR_OUTPUTS: dict[str, Callable[[str], list[str]]] = {
    "plan --report": lambda v: ["plan", "--model", "tiny-gpt", "--cluster", "local-cpu", "--global-batch", "8",
                                "--seq-len", "64", "--report", v],
    "train --log-dir": lambda v: ["train", _valid_train_config(), "--log-dir", v],
    "train checkpoint.dir": lambda v: ["train", _valid_train_config(), "--set", f'checkpoint.dir="{v}"'],
    "demo --log-dir": lambda v: ["demo", "--log-dir", v],
}
names = st.text(alphabet=string.ascii_letters + string.digits + " -_é漢", min_size=1, max_size=10).filter(
    lambda n: n.strip() == n and n not in (".", ".."))


def bad_location(draw: Callable, wants_folder: bool) -> tuple[str, str]:
    """(path, why): under a file, somewhere no one can write, or the wrong kind of thing already there."""
    parts = draw(st.lists(names, min_size=1, max_size=3))
    why = draw(st.sampled_from(["under a file", "unwritable", "wrong kind"]))
    if why == "under a file":
        return str(A_FILE.joinpath(*parts)), why
    if why == "unwritable":
        return str(Path(draw(st.sampled_from(UNWRITABLE))).joinpath(*parts)), why
    target = ROOT.joinpath("things", *parts)
    if wants_folder:  # a file where the folder should be
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.parent.is_dir():
            target.write_text("x")
    else:  # a folder where the file should be
        if target.is_file():
            target.unlink()
        target.mkdir(parents=True, exist_ok=True)
    assume((target.is_file() if wants_folder else target.is_dir()))
    return str(target), why


@pytest.mark.parametrize("flag", list(FILE_OUTPUTS) + list(DIR_OUTPUTS))
@SETTINGS
@given(data=st.data())
def test_output_locations(flag: str, data: st.DataObject) -> None:
    wants_folder = flag in DIR_OUTPUTS
    value, _ = bad_location(data.draw, wants_folder)
    argv = (DIR_OUTPUTS if wants_folder else FILE_OUTPUTS)[flag](value)
    expect_cli_error(f"output location: {flag}", argv, names=value)


# ---- empty, blank and garbage input files -----------------------------------------------------------
blank = st.one_of(st.text(alphabet=" \t\r\n", max_size=20),
                  st.sampled_from(["{}", "[]", "null", "~", "---", "# only a comment\n", "\ufeff", "\ufeff\n",
                                   '""', "0"]))
INPUTS = ("plan file (train)", "model file (train)", "cluster file (train)", "text data (train)",
          "token data (train)", "plan file (check)", "model file (plan)", "cluster file (plan)", "cluster file (tune)")


def _input_case(target: str, path: Path) -> list[str]:
    """The command that reads `path` as `target`."""
    config = base_config()
    if target == "plan file (train)":
        config["plan"]["file"] = str(path)
    elif target == "model file (train)":
        config["model"]["file"] = str(path)
    elif target == "cluster file (train)":
        config["plan"] = {"file": "auto", "cluster": str(path), "devices": 2}
    elif target == "text data (train)":
        config["data"] = {"source": "text", "path": str(path)}
    elif target == "token data (train)":
        config["data"] = {"source": "tokens", "path": str(path), "dtype": "uint16"}
    elif target == "plan file (check)":
        return ["check", "--plan", str(path)]
    elif target == "model file (plan)":
        return ["plan", "--model", str(path), "--cluster", "local-cpu", "--global-batch", "8", "--seq-len", "16"]
    elif target == "cluster file (plan)":
        return ["plan", "--model", "tiny-gpt", "--cluster", str(path), "--global-batch", "8", "--seq-len", "64"]
    elif target == "cluster file (tune)":
        return ["tune", "--model", "tiny-gpt", "--cluster", str(path), "--out", str(ROOT / "t.yaml")]
    (ROOT / "case.toml").write_text(to_toml(config))
    return ["train", str(ROOT / "case.toml")]


def _suffix(target: str, draw: Callable) -> str:
    if "data" in target:
        return ".txt" if "text" in target else ".bin"
    return draw(st.sampled_from([".json", ".yaml"]))


@SETTINGS
@given(data=st.data())
def test_empty_and_blank_files(data: st.DataObject) -> None:
    target = data.draw(st.sampled_from(INPUTS))
    path = ROOT / f"blank{_suffix(target, data.draw)}"
    path.write_text(data.draw(blank), encoding="utf-8")
    expect_cli_error(f"empty or blank file: {target}", _input_case(target, path), names=str(path))


@SETTINGS
@given(data=st.data())
def test_garbage_files(data: st.DataObject) -> None:
    """Bytes that are no text at all (not UTF-8) where a config, plan, model or cluster file is read."""
    target = data.draw(st.sampled_from(["config (train)"] + [t for t in INPUTS if "data" not in t]))
    garbage = data.draw(st.binary(min_size=1, max_size=120))
    try:
        garbage.decode("utf-8")
        assume(False)  # text: the corrupted-text cases cover it
    except UnicodeDecodeError:
        pass
    if target == "config (train)":
        path = ROOT / "garbage.toml"
        path.write_bytes(garbage)
        expect_cli_error("garbage bytes: config (train)", ["train", str(path)], names=str(path))
        return
    path = ROOT / f"garbage{_suffix(target, data.draw)}"
    path.write_bytes(garbage)
    expect_cli_error(f"garbage bytes: {target}", _input_case(target, path), names=str(path))


# ---- checkpoint sets a resume cannot use ------------------------------------------------------------
CORRUPTIONS = ("truncate a shard", "flip a byte", "delete a shard", "delete the manifest", "garbage manifest",
               "empty meta.json", "delete the metadata")


def corrupt(folder: Path, how: str, draw: Callable) -> None:
    shards = sorted(folder.glob("*.distcp"))
    if how == "truncate a shard":
        shard = draw(st.sampled_from(shards))
        shard.write_bytes(shard.read_bytes()[: draw(st.integers(0, shard.stat().st_size - 1))])
    elif how == "flip a byte":
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
        victim = draw(st.sampled_from(files))
        data = bytearray(victim.read_bytes())
        at = draw(st.integers(0, len(data) - 1))
        data[at] ^= draw(st.integers(1, 255))
        victim.write_bytes(bytes(data))
    elif how == "delete a shard":
        draw(st.sampled_from(shards)).unlink()
    elif how == "delete the manifest":
        (folder / "MANIFEST.json").unlink()
    elif how == "garbage manifest":
        (folder / "MANIFEST.json").write_bytes(draw(st.binary(max_size=40)))
    elif how == "empty meta.json":
        (folder / "meta.json").write_text("")
    else:
        (folder / ".metadata").unlink()


@SETTINGS
@given(data=st.data())
def test_resume_from_a_set_of_corrupt_checkpoints(data: st.DataObject) -> None:
    root = ROOT / "sets" / "corrupt"
    shutil.rmtree(root, ignore_errors=True)
    steps = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3, unique=True))
    for step in steps:
        fake_checkpoint(root, step)
        corrupt(root / f"step_{step:06d}", data.draw(st.sampled_from(CORRUPTIONS)), data.draw)
    config = base_config()
    config["checkpoint"]["dir"] = str(root)
    flag = data.draw(st.sampled_from([[], ["--resume"]]))  # resume = true in the config, or the flag as well
    expect_config_error("resume: every checkpoint corrupt", to_toml(config), names=str(root), extra=flag,
                        guarded=((root, tree_digest(root)),))


@SETTINGS
@given(data=st.data())
def test_resume_from_a_folder_without_checkpoints(data: st.DataObject) -> None:
    root = ROOT / "sets" / "none"
    shutil.rmtree(root, ignore_errors=True)
    what = data.draw(st.sampled_from(["missing", "empty", "unfinished saves", "set aside", "other files"]))
    if what != "missing":
        root.mkdir(parents=True)
    for step in data.draw(st.lists(st.integers(1, 99), max_size=3, unique=True)):
        if what == "unfinished saves":
            fake_checkpoint(root, step)
            (root / f"step_{step:06d}").rename(root / f"step_{step:06d}.tmp")
        elif what == "set aside":
            fake_checkpoint(root, step)
            (root / f"step_{step:06d}").rename(root / f"step_{step:06d}.unreadable")
        elif what == "other files":
            (root / f"notes-{step}.txt").write_text("not a checkpoint")
    config = base_config()
    config["checkpoint"]["dir"] = str(root)
    expect_config_error("resume: no checkpoint in checkpoint.dir", to_toml(config), names=str(root),
                        guarded=((root, tree_digest(root)),))


# ---- keys that contradict each other, faults that never fire ------------------------------------------
@SETTINGS
@given(data=st.data())
def test_model_named_twice(data: st.DataObject) -> None:
    sources = {"preset": st.sampled_from(["tiny-gpt", "tiny-llama", "llama3-8b"]),
               "file": st.just(str(ROOT / "model.json")),
               "module": st.sampled_from(["tiny_decoder:build", "pkg.models:make"])}
    keys = data.draw(st.lists(st.sampled_from(sorted(sources)), min_size=2, max_size=3, unique=True))
    config = base_config()
    config["model"] = {key: data.draw(sources[key]) for key in keys}
    expect_config_error("config: model named twice", to_toml(config), names=f"{keys[0]}=")


@SETTINGS
@given(data=st.data())
def test_start_over_without_resume(data: st.DataObject) -> None:
    config = base_config()
    config["checkpoint"] = {"dir": str(ROOT / data.draw(names)), "start_over": True,
                            "every": data.draw(st.integers(0, 9))}
    expect_config_error("config: start_over without resume", to_toml(config), names="start_over")


faults = st.one_of(
    st.text(max_size=30),  # anything at all
    st.builds(lambda kind, rank, step: f"{kind}:rank={rank}:step={step}", st.sampled_from(["kill", "hang", "interrupt"]),
              st.integers(2, 99), st.integers(1, 4)),  # a rank the run does not have
    st.builds(lambda kind, step: f"{kind}:rank=0:step={step}", st.sampled_from(["kill", "hang"]),
              st.integers(5, 10**6)),  # a step the run never reaches
)


@SETTINGS
@given(spec=faults)
def test_fault_specs(spec: str) -> None:
    assume(spec.strip() and "\x00" not in spec)
    os.environ["PLAIT_FAULT"] = spec
    try:
        config = base_config()
        config["checkpoint"] = {"dir": str(ROOT / "fresh-ckpt")}
        expect_config_error("PLAIT_FAULT that never fires", to_toml(config), names="PLAIT_FAULT")
    finally:
        del os.environ["PLAIT_FAULT"]


# ---- plans that cannot run here ----------------------------------------------------------------------
@SETTINGS
@given(devices=st.sampled_from([1, 2, 4, 8]), interleave=st.integers(2, 8), how=st.sampled_from(["plan", "train"]))
def test_interleave_without_a_pipeline(devices: int, interleave: int, how: str) -> None:
    if how == "plan":
        argv = ["plan", "--model", "tiny-gpt", "--cluster", "local-cpu", "--devices", str(devices), "--global-batch",
                "8", "--seq-len", "64", "--pp", "1", "--interleave", str(interleave)]
        expect_cli_error("plan: interleave without pp", argv, names="interleave-needs-pp")
        return
    config = base_config()
    config["checkpoint"] = {"dir": str(ROOT / "fresh-ckpt")}
    config["plan"] = {"file": "auto", "devices": devices, "pins": {"pp": 1, "interleave": interleave}}
    expect_config_error("plan: interleave without pp", to_toml(config), names="interleave")


@SETTINGS
@given(cluster=st.sampled_from(["a100-80g", "a100-40g", "h100-80g"]), dp=st.sampled_from([2, 4, 8, 16, 64]))
def test_a_gpu_plan_on_this_machine(cluster: str, dp: int) -> None:
    from plait.plan import Plan
    from plait.spec import ModelSpec, TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    plan = Plan.of(dp=dp, micro_batch=1, model=ModelSpec(**MODEL), cluster=CLUSTER_PRESETS[cluster].with_devices(dp),
                   train=TrainSpec(global_batch=dp, seq_len=16, precision="bf16"))
    path = ROOT / "gpu-plan.json"
    path.write_text(plan.to_json())
    config = base_config()
    config["plan"]["file"] = str(path)
    config["train"]["global_batch"] = dp
    config["checkpoint"] = {"dir": str(ROOT / "fresh-ckpt")}
    expect_config_error("train: a GPU plan on a machine without its GPUs", to_toml(config), names=f"{dp} GPUs")


def _mutated_or_cut(original: dict[str, Any], draw: Callable) -> str:
    text = json.dumps(original)
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(text) - 1))
        return text[:cut] + draw(st.text(max_size=6)) + text[cut + 1:]
    data = json.loads(text)
    key = draw(st.sampled_from(sorted(data)))
    data[key] = draw(st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=5), st.lists(
        st.integers(-2, 2), max_size=2)))
    return json.dumps(data)


@SETTINGS
@given(data=st.data())
def test_broken_files_through_other_commands(data: st.DataObject) -> None:
    """The plan file `plait check` reads, the model and cluster files of `plait plan`, the cluster file of `tune`."""
    target = data.draw(st.sampled_from(["plan file (check)", "model file (plan)", "cluster file (plan)",
                                        "cluster file (tune)"]))
    original = {"plan": plan_dict(), "model": MODEL, "cluster": CLUSTER}[target.split()[0]]
    path = ROOT / "broken-for-command.json"
    path.write_text(_mutated_or_cut(original, data.draw))
    expect_cli_error(f"broken file: {target}", _input_case(target, path), may_succeed=True)
