"""The TOML config: defaults, unknown keys named, overrides, and the checks made before launching."""

from pathlib import Path

import pytest

from plait.errors import ConfigError
from plait.spec.models import MODEL_PRESETS
from plait.train.config import Config, apply_override, load_config, parse_value
from plait.train.resolve import check_data, check_plan, resolve_model


def _write(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_empty_file_gives_the_documented_defaults(tmp_path):
    config = load_config(_write(tmp_path, ""))
    assert config == Config()
    assert config.model.source == "tiny-gpt" and config.plan.file == "auto"


def test_sections_are_read_into_typed_fields(tmp_path):
    config = load_config(_write(tmp_path, """
[optimizer]
lr = 1e-3
betas = [0.9, 0.99]
schedule = "constant"
[train]
steps = 7
[plan]
pins = {tp = 2}
"""))
    assert config.optimizer.betas == (0.9, 0.99) and config.optimizer.schedule == "constant"
    assert config.train.steps == 7 and config.plan.pins == {"tp": 2}


@pytest.mark.parametrize("text,named", [
    ("[train]\nstepz = 3\n", "unknown key 'stepz'"),
    ("[trian]\nsteps = 3\n", "unknown key 'trian'"),
    ("[optimizer]\nschedule = 'linear'\n", "'linear' is not one of"),
    ("[train]\nsteps = 'many'\n", "expected an integer"),
    ("[train]\nsteps = 0\n", "steps=0 must be a positive"),
])
def test_bad_keys_and_values_are_named(tmp_path, text, named):
    with pytest.raises(ConfigError, match=named):
        load_config(_write(tmp_path, text))


def test_unknown_key_lists_what_is_allowed(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, "[log]\ndirectory = 'x'\n"))
    assert "config.log" in str(info.value) and "every" in str(info.value)


def test_malformed_and_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_write(tmp_path, "[train\nsteps = 3"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml")


def test_overrides_parse_toml_values_and_fall_back_to_strings(tmp_path):
    config = load_config(_write(tmp_path, "[train]\nsteps = 3\n"), [
        "train.steps=20", "optimizer.lr=3e-4", "optimizer.betas=[0.8, 0.9]", "log.dir=runs/x",
        "plan.pins.tp=2", "checkpoint.dir=none", "log.progress=false",
    ])
    assert config.train.steps == 20 and config.optimizer.lr == 3e-4
    assert config.optimizer.betas == (0.8, 0.9) and config.log.dir == "runs/x"
    assert config.plan.pins == {"tp": 2} and config.checkpoint.dir is None and config.log.progress is False
    assert parse_value('"quoted"') == "quoted" and parse_value("cosine") == "cosine"


@pytest.mark.parametrize("item,named", [
    ("train.stepz=3", "unknown key train.stepz"),
    ("traim.steps=3", "unknown section 'traim'"),
    ("steps=3", "section.key=value"),
    ("train.steps", "section.key=value"),
])
def test_bad_overrides_are_named(item, named):
    with pytest.raises(ConfigError, match=named):
        apply_override({}, item)


def test_model_preset_and_unknown_preset():
    from plait.train.config import ModelConfig

    assert resolve_model(ModelConfig(preset="tiny-llama")) == MODEL_PRESETS["tiny-llama"]
    with pytest.raises(ConfigError, match="tiny-gpt"):
        resolve_model(ModelConfig(preset="tiny-gtp"))


def test_plan_for_another_model_or_batch_is_refused():
    from plait.plan import Plan
    from plait.spec.clusters import CLUSTER_PRESETS

    config = Config()
    model = MODEL_PRESETS["tiny-gpt"]
    train = config.train.spec()
    plan = Plan.of(dp=2, tp=1, pp=1, num_micro_batches=8, model=MODEL_PRESETS["tiny-llama"], train=train,
                cluster=CLUSTER_PRESETS["local-cpu"])
    with pytest.raises(ConfigError, match="plan is for model 'tiny-llama'"):
        check_plan(plan, config, model)
    plan = plan.replace(model=model, num_micro_batches=4, train=train.replace(global_batch=8)
                        if hasattr(train, "replace") else type(train)(global_batch=8, seq_len=train.seq_len))
    with pytest.raises(ConfigError, match="global_batch=8"):
        check_plan(plan, config, model)


def test_a_plan_priced_with_a_measured_router_balance_trains_the_same_model():
    """router_imbalance prices expert parallelism; it changes neither the module nor its weights, so a plan made
    with `plait plan --router-imbalance` trains the config's model, and a checkpoint written before the field
    existed resumes."""
    from plait.plan import Plan
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.train.checkpoint import check_compatible

    config = Config()
    model = MODEL_PRESETS["tiny-moe"]
    train = config.train.spec()
    plan = Plan.of(dp=2, tp=1, pp=1, num_micro_batches=8, model=model.replace(router_imbalance=1.04), train=train,
                   cluster=CLUSTER_PRESETS["local-cpu"].with_devices(2))
    check_plan(plan, config, model)
    saved = plan.to_dict()
    del saved["model"]["router_imbalance"]
    check_compatible({"plan": saved}, plan, "ckpt")
    saved["model"]["moe_ffn_hidden_size"] = 64  # the module's shape still counts
    with pytest.raises(ConfigError, match="moe_ffn_hidden_size=64"):
        check_compatible({"plan": saved}, plan, "ckpt")


def test_data_checks_before_launch(tmp_path):
    config = load_config(None, ["data.source=text", f"data.path={tmp_path / 'short.txt'}"])
    with pytest.raises(ConfigError, match="does not exist"):
        check_data(config, MODEL_PRESETS["tiny-gpt"])
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(ConfigError, match="needs at least 2049 tokens"):
        check_data(config, MODEL_PRESETS["tiny-gpt"])


def test_dump_toml_round_trips(tmp_path):
    from plait.train.config import dump_toml

    config = load_config(None, ["plan.pins.tp=2", "optimizer.betas=[0.8, 0.9]", 'log.dir="a \\"b\\""',
                                "train.max_seconds=1.5", "log.progress=false",
                                'model.tp_plan={"blocks.*.attn.q" = "colwise"}'])  # keys that are not bare
    path = tmp_path / "c.toml"
    path.write_text(dump_toml(config))
    assert load_config(path) == config


def test_the_example_config_documents_every_key():
    """examples/tiny-gpt.toml says it lists every key: each field of every section appears, set or commented."""
    import dataclasses
    import re

    from plait.train.config import Config

    text = (Path(__file__).parents[2] / "examples" / "tiny-gpt.toml").read_text()
    sections = re.split(r"^\[(\w+)\]\s*$", text, flags=re.M)
    body = dict(zip(sections[1::2], sections[2::2]))
    for section in dataclasses.fields(Config):
        assert section.name in body, f"[{section.name}] is missing"
        for key in dataclasses.fields(section.default_factory):
            assert re.search(rf"^#? ?{key.name} = ", body[section.name], flags=re.M), f"{section.name}.{key.name}"
    assert load_config(Path(__file__).parents[2] / "examples" / "tiny-gpt.toml").train.steps == 200


@pytest.mark.parametrize("text", ["two\nlines", 'quote " and \\ backslash', "tab\tand unicode: 日本語 ✓ é",
                                  "'single' and \"double\"", "trailing newline\n", "#not a comment = 1"])
def test_written_toml_round_trips_awkward_strings(tmp_path, text):
    """The writer is tomli-w: a string with a newline, quotes, backslashes or unicode reads back as written, as a
    whole config and as a command-line override."""
    from plait.train.config import dump_toml, toml_value

    config = load_config(None, [f"log.dir={toml_value(text)}", f"model.tp_plan={{{toml_value(text)} = \"colwise\"}}"])
    assert config.log.dir == text and config.model.tp_plan == {text: "colwise"}
    path = tmp_path / "c.toml"
    path.write_text(dump_toml(config), encoding="utf-8")
    assert load_config(path) == config
