"""Bad input, measured: malformed configs, plans, model, cluster and data files, generated with
hypothesis and fed to the real entry points -- the loaders and `plait train` in-process.

Every case must end in a clear one-line error (PlaitError; through the CLI: exit code 2, one
line on stderr, no traceback), and a checkpoint directory the config points at (resume=true)
must be byte for byte what it was. Inputs that turn out valid are not counted (the launcher
is replaced by a stub, so nothing trains). Counts per entry point are written to
$PLAIT_BAD_INPUT_REPORT when set (benchmarks/bad_input.py prints them).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from plait.errors import PlaitError

COUNTS: Counter = Counter()
SETTINGS = settings(max_examples=int(os.environ.get("PLAIT_BAD_INPUT_EXAMPLES", "30")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ROOT = Path(tempfile.mkdtemp(prefix="plait-bad-input-"))

MODEL = {"name": "bad-input-gpt", "arch": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
         "vocab_size": 128, "max_seq_len": 32}
CLUSTER = {"name": "two-cpus", "num_devices": 2, "devices_per_node": 2, "memory_bytes": "4GiB",
           "peak_flops": "50 GFLOPS", "device_type": "cpu", "backend": "gloo",
           "intra_node": {"latency_s": "20us", "bandwidth": "1 GB/s"},
           "inter_node": {"latency_s": "50us", "bandwidth": "0.5 GB/s"}}


# ---- the world a config points at ------------------------------------------------------------
def _plan_dict() -> dict[str, Any]:
    from plait.plan import Plan
    from plait.spec import ModelSpec, TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    plan = Plan.of(dp=2, tp=1, pp=1, micro_batch=2, model=ModelSpec(**MODEL),
                train=TrainSpec(global_batch=4, seq_len=16, precision="fp32"), cluster=CLUSTER_PRESETS["local-cpu"])
    return json.loads(plan.to_json())


def _meta() -> dict[str, Any]:
    return {"step": 2, "tokens": 128, "world_size": 2, "plan": _plan_dict(),
            "loader": {"epoch": 0, "step_in_epoch": 2, "seed": 0, "global_batch": 4, "seq_len": 16}}


def _fake_checkpoint(root: Path) -> Path:
    from plait.train.checkpoint import publish, step_dir, tmp_dir, write_manifest

    tmp = tmp_dir(root, 2)
    (tmp / "rng").mkdir(parents=True)
    for name, data in {".metadata": b"m" * 64, "__0_0.distcp": b"a" * 999, "__1_0.distcp": b"b" * 999,
                       "rng/rank_00000.pt": b"r" * 9, "meta.json": json.dumps(_meta()).encode()}.items():
        (tmp / name).write_bytes(data)
    write_manifest(tmp, 2)
    publish(tmp, step_dir(root, 2))
    return root


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(path.relative_to(root).as_posix().encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


CKPT = _fake_checkpoint(ROOT / "ckpt")
CKPT_DIGEST = tree_digest(CKPT)


@pytest.fixture(autouse=True, scope="module")
def _inside_root() -> Iterator[None]:
    """Mutated configs that happen to be valid name relative log dirs: keep them inside ROOT."""
    previous = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(previous)
(ROOT / "model.json").write_text(json.dumps(MODEL))
(ROOT / "cluster.json").write_text(json.dumps(CLUSTER))
(ROOT / "plan.json").write_text(json.dumps(_plan_dict()))
(ROOT / "text.txt").write_text("To be, or not to be, that is the question. " * 40)


def base_config() -> dict[str, Any]:
    return {
        "model": {"file": str(ROOT / "model.json")},
        "data": {"source": "text", "path": str(ROOT / "text.txt")},
        "train": {"steps": 4, "global_batch": 4, "seq_len": 16},
        "plan": {"file": str(ROOT / "plan.json")},
        "checkpoint": {"dir": str(CKPT), "every": 2, "keep": 2, "resume": True},
        "log": {"dir": str(ROOT / "log"), "progress": False},
    }


def to_toml(config: dict[str, Any]) -> str:
    def value(v: Any) -> str:
        return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")

    return "\n".join(f"[{section}]\n" + "\n".join(f"{k} = {value(v)}" for k, v in table.items())
                     for section, table in config.items()) + "\n"


# ---- running an entry point ------------------------------------------------------------------
class Launched(Exception):
    """The input was valid: the launcher was reached (and stubbed out)."""


def _stub_run_local(*args: Any, **kwargs: Any) -> int:
    raise Launched()


def run_cli(argv: list[str]) -> tuple[int, str]:
    """`plait <argv>` in this process: (exit code, stderr); raises Launched for valid input."""
    import plait.launch
    from plait.cli import main

    saved, plait.launch.run_local = plait.launch.run_local, _stub_run_local
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    finally:
        plait.launch.run_local = saved
    return code, err.getvalue()


def expect_cli_error(kind: str, config_text: str) -> None:
    path = ROOT / "case.toml"
    path.write_text(config_text)
    try:
        code, err = run_cli(["train", str(path)])
    except Launched:
        assume(False)  # a valid config: not a bad-input case
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("plait: warning:")]
    assert code == 2, f"exit {code} for {config_text!r}: {err}"
    assert len(lines) == 1 and lines[0].startswith("plait train: error: "), err
    assert "Traceback" not in err
    assert tree_digest(CKPT) == CKPT_DIGEST, "a bad input changed the checkpoint directory"
    COUNTS[kind] += 1


def expect_loader_error(kind: str, load: Callable[[], Any]) -> None:
    try:
        load()
    except PlaitError as error:
        message = str(error)
        assert message and "\n" not in message, f"not a one-line message: {message!r}"
    else:
        assume(False)  # valid input
    assert tree_digest(CKPT) == CKPT_DIGEST
    COUNTS[kind] += 1


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    out = os.environ.get("PLAIT_BAD_INPUT_REPORT")
    if out:
        Path(out).write_text(json.dumps(dict(COUNTS), indent=1))
    assert tree_digest(CKPT) == CKPT_DIGEST
    shutil.rmtree(ROOT, ignore_errors=True)


# ---- strategies ------------------------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
toml_values = st.one_of(st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False),
                        st.text(max_size=12), st.lists(st.integers(-5, 5), max_size=3))


def mutate(data: dict[str, Any], draw: Callable, value_strategy: Any) -> dict[str, Any]:
    """Replace, delete or add one key somewhere in a (nested) mapping."""
    data = json.loads(json.dumps(data))
    table = data
    while True:
        key = draw(st.sampled_from(sorted(table)))
        if isinstance(table[key], dict) and table[key] and draw(st.booleans()):
            table = table[key]
            continue
        break
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        table[key] = draw(value_strategy)
    elif action == "delete":
        del table[key]
    else:
        table[draw(st.text(min_size=1, max_size=8))] = draw(value_strategy)
    return data


def corrupt_text(text: str, draw: Callable) -> str:
    """Truncate, or splice random characters into, a file's text."""
    cut = draw(st.integers(0, len(text)))
    if draw(st.booleans()):
        return text[:cut]
    return text[:cut] + draw(st.text(min_size=1, max_size=8)) + text[cut:]


# ---- configs through `plait train` -----------------------------------------------------------
@SETTINGS
@given(st.data())
def test_config_values(data: st.DataObject) -> None:
    config = mutate(base_config(), data.draw, toml_values)
    assume(all(isinstance(t, dict) for t in config.values()))  # a non-table section is a TOML-level case
    expect_cli_error("config: mutated key or value", to_toml(config))


@SETTINGS
@given(st.data())
def test_config_text(data: st.DataObject) -> None:
    expect_cli_error("config: corrupted TOML text", corrupt_text(to_toml(base_config()), data.draw))


@SETTINGS
@given(st.data())
def test_referenced_files(data: st.DataObject) -> None:
    """A config that points at a broken plan, model, cluster or data file."""
    config = base_config()
    kind = data.draw(st.sampled_from(["plan", "model", "cluster", "data"]))
    target = ROOT / f"broken-{kind}.json"
    if kind == "data":
        target = ROOT / "broken.u16.bin"
        target.write_bytes(data.draw(st.binary(max_size=80)))
        config["data"] = {"source": "tokens", "path": str(target), "dtype": "auto"}
    else:
        original = {"plan": _plan_dict(), "model": MODEL, "cluster": CLUSTER}[kind]
        text = json.dumps(mutate(original, data.draw, values)) if data.draw(st.booleans()) else corrupt_text(
            json.dumps(original), data.draw)
        target.write_text(text)
        if kind == "cluster":
            config["plan"] = {"file": "auto", "cluster": str(target), "devices": 2}
        else:
            config[kind]["file"] = str(target)
    expect_cli_error(f"{kind} file (via plait train)", to_toml(config))


# ---- loaders directly ------------------------------------------------------------------------
@SETTINGS
@given(st.data())
def test_plan_json(data: st.DataObject) -> None:
    from plait.plan import Plan

    text = json.dumps(mutate(_plan_dict(), data.draw, values)) if data.draw(st.booleans()) else corrupt_text(
        json.dumps(_plan_dict()), data.draw)
    expect_loader_error("plan JSON (Plan.from_json)", lambda: Plan.from_json(text))


@SETTINGS
@given(st.data())
def test_model_and_cluster_files(data: st.DataObject) -> None:
    from plait.spec.load import load_cluster, load_model

    kind = data.draw(st.sampled_from(["model", "cluster"]))
    original, load = (MODEL, load_model) if kind == "model" else (CLUSTER, load_cluster)
    suffix = data.draw(st.sampled_from([".json", ".yaml"]))
    path = ROOT / f"loader-{kind}{suffix}"
    mutated = mutate(original, data.draw, values)
    path.write_text(json.dumps(mutated) if data.draw(st.booleans()) else corrupt_text(json.dumps(original), data.draw))
    expect_loader_error(f"{kind} file ({load.__name__})", lambda: load(str(path)))


@SETTINGS
@given(data=st.binary(max_size=64), dtype=st.sampled_from(["uint16", "uint32", "auto"]),
       batch=st.integers(1, 8), seq=st.integers(1, 32))
def test_token_files(data: bytes, dtype: str, batch: int, seq: int) -> None:
    from plait.train.data import BatchLoader, check_vocab, load_tokens

    path = ROOT / "tokens.bin"  # no dtype in the name: "auto" must be refused
    path.write_bytes(data)

    def load() -> None:
        tokens = load_tokens("tokens", str(path), dtype)
        check_vocab(tokens, MODEL["vocab_size"])
        BatchLoader(tokens, global_batch=batch, seq_len=seq)

    expect_loader_error("token data file", load)


@pytest.mark.parametrize("section, key, value", [("train", "seed", 1), ("train", "seq_len", 8),
                                                 ("model", "file", "tiny-gpt")])
def test_resume_with_another_data_order_or_model(section: str, key: str, value: Any) -> None:
    config = base_config()
    config[section][key] = value
    if section == "model":  # a plan for the other model, so that only the checkpoint disagrees
        config["model"] = {"preset": value}
        config["plan"] = {"file": "auto", "devices": 2}
    expect_cli_error("resume: checkpoint of another run", to_toml(config))


def test_resume_from_a_checkpoint_of_another_model() -> None:
    """check_compatible refuses a checkpoint whose model differs, naming the field."""
    from plait.plan import Plan
    from plait.train.checkpoint import check_compatible

    plan = Plan.from_dict(_plan_dict())
    saved = _plan_dict()
    meta = {"plan": {**saved, "model": {**saved["model"], "hidden_size": 64}}}
    with pytest.raises(PlaitError, match="hidden_size=64"):
        check_compatible(meta, plan, CKPT)
    COUNTS["checkpoint of another model"] += 1
