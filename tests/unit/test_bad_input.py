"""Bad input, measured: malformed configs, plans, model, cluster and data files, generated with
hypothesis and fed to the real entry points -- the loaders and `plait train` in-process.

Every case must end in a clear one-line error (PlaitError; through the CLI: exit code 2, one
line on stderr, no traceback), and a checkpoint directory the config points at (resume=true)
must be byte for byte what it was. Inputs that turn out valid are not counted (the launcher
is replaced by a stub, so nothing trains). The world and the judging live in
tests/bad_input_world.py; benchmarks/bad_input.py prints the counts per kind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from plait.errors import PlaitError

sys.path.insert(0, str(Path(__file__).parents[1]))
from bad_input_world import (  # noqa: E402
    CKPT, CKPT_DIGEST, CLUSTER, MODEL, ROOT, SETTINGS, base_config, expect_config_error, expect_loader_error,
    plan_dict, record, to_toml, tree_digest,
)


pytestmark = pytest.mark.usefixtures("bad_input_root")  # tests/unit/conftest.py


def expect_cli_error(kind: str, config_text: str) -> None:
    expect_config_error(kind, config_text)


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
        original = {"plan": plan_dict(), "model": MODEL, "cluster": CLUSTER}[kind]
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

    text = json.dumps(mutate(plan_dict(), data.draw, values)) if data.draw(st.booleans()) else corrupt_text(
        json.dumps(plan_dict()), data.draw)
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

    plan = Plan.from_dict(plan_dict())
    saved = plan_dict()
    meta = {"plan": {**saved, "model": {**saved["model"], "hidden_size": 64}}}
    with pytest.raises(PlaitError, match="hidden_size=64") as refused:
        check_compatible(meta, plan, CKPT)
    changed = tree_digest(CKPT) != CKPT_DIGEST
    record("checkpoint of another model", 2, "", changed, "\n" not in str(refused.value))
    assert not changed, f"refusing the checkpoint changed {CKPT}"
    assert "\n" not in str(refused.value)
