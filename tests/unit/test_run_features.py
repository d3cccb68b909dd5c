"""The run's features a config turns on, refused in one line where they cannot work: validation, metrics sinks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plait.errors import ConfigError
from plait.train.config import load_config
from plait.train.data import split_held_out
from plait.train.resolve import check_outputs


def config_of(tmp_path: Path, *overrides: str):
    return load_config(None, [f'log.dir="{tmp_path / "log"}"', *overrides])


@pytest.mark.parametrize(("overrides", "named"), [
    (["eval.every=5"], "set fraction"),
    (["eval.fraction=1.5"], "fraction=1.5"),
    (["eval.every=5", "eval.fraction=0.1", "eval.path=val.txt"], "both set"),
    (["eval.batches=0"], "batches=0"),
])
def test_eval_sections_that_cannot_work_are_refused(tmp_path: Path, overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        config_of(tmp_path, *overrides)


def test_keep_best_needs_a_checkpoint_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="checkpoint.dir"):
        check_outputs(config_of(tmp_path, "eval.every=2", "eval.fraction=0.1", "eval.keep_best=true"))


def test_the_held_out_tail_is_the_fraction_and_disjoint() -> None:
    tokens = np.arange(1000)
    train, held = split_held_out(tokens, 0.05)
    assert len(held) == 50 and len(train) == 950
    assert train[-1] + 1 == held[0]
    assert len(split_held_out(tokens, 0.0)[1]) == 0


def test_an_unknown_wandb_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="log.wandb"):
        config_of(tmp_path, 'log.wandb="cloud"')


# ---- fine-tune guards: a Hugging Face model's tokenizer and position limit --------------------------------------
def train_cli(tmp_path: Path, model_dir: Path, capsys, *, seq_len: int = 16, tokenizer: str | None = None):
    from plait.cli import main
    from plait.train.config import config_from_dict, dump_toml

    data = {"source": "shipped"} | ({"tokenizer": tokenizer} if tokenizer else {})
    config = config_from_dict({"model": {"file": str(model_dir)}, "data": data, "log": {"dir": str(tmp_path / "log")},
                               "train": {"steps": 2, "global_batch": 4, "seq_len": seq_len},
                               "plan": {"devices": 2, "pins": {"tp": 1, "pp": 1}}})
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(config))
    code = main(["train", str(path)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "warning:" not in line]
    return code, lines


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2"])
def test_seq_len_past_the_position_limit_is_refused_for_every_family(tmp_path: Path, family: str, capsys) -> None:
    from plait.hf.tiny import write_tiny_config

    model_dir = write_tiny_config(family, tmp_path / family)  # 64 positions
    code, lines = train_cli(tmp_path, model_dir, capsys, seq_len=128, tokenizer="byte")
    assert code == 2 and len(lines) == 1 and "seq_len=128" in lines[0] and "64" in lines[0], lines


def test_a_model_folder_without_a_tokenizer_is_refused_naming_byte(tmp_path: Path, capsys, no_launch) -> None:
    from plait.hf.tiny import write_tiny_config

    model_dir = write_tiny_config("llama", tmp_path / "llama", vocab_size=256)
    code, lines = train_cli(tmp_path, model_dir, capsys)
    assert code == 2 and len(lines) == 1 and "no tokenizer.json" in lines[0] and 'tokenizer = "byte"' in lines[0]
    with pytest.raises(no_launch):  # asked for on purpose, bytes train
        train_cli(tmp_path, model_dir, capsys, tokenizer="byte")


# ---- the smaller points: config-relative inputs, --fresh, --version, one-line argument errors, help, solver ------
def test_input_paths_resolve_next_to_the_config_file_first(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "train.txt").write_text("text")
    (folder / "run.toml").write_text('[data]\nsource = "text"\npath = "train.txt"\n[eval]\npath = "absent.txt"\n'
                                     '[log]\ndir = "runs/x"\n')
    monkeypatch.chdir(tmp_path)
    config = load_config(folder / "run.toml", ['model.file="also-absent.json"'])
    assert Path(config.data.path) == folder / "train.txt"  # beside the config
    assert config.eval.path == "absent.txt"  # not beside it: the working directory's, as before
    assert config.model.file == "also-absent.json" and config.log.dir == "runs/x"  # --set values and outputs: as given


def test_words_and_presets_are_not_paths_even_where_a_file_of_that_name_sits_beside_the_config(tmp_path: Path) -> None:
    """examples/operators is a folder beside examples/*.toml: `file = "auto"` must still mean "plan here"."""
    for name in ("auto", "byte", "local-cpu"):
        (tmp_path / name).mkdir()
    (tmp_path / "run.toml").write_text('[plan]\nfile = "auto"\ncluster = "local-cpu"\n[data]\ntokenizer = "byte"\n')
    config = load_config(tmp_path / "run.toml")
    assert (config.plan.file, config.plan.cluster, config.data.tokenizer) == ("auto", "local-cpu", "byte")


def test_fresh_clears_the_checkpoints_of_an_earlier_run_and_says_so(tmp_path: Path, capsys, no_launch) -> None:
    from plait.cli import main

    ckpt = tmp_path / "ckpt"
    for name in ("step_000002", "step_000004", "step_000006.tmp", "best/step_000004"):
        (ckpt / name).mkdir(parents=True)
        (ckpt / name / "meta.json").write_text("{}")
    (ckpt / "notes.txt").write_text("mine")
    config = tmp_path / "run.toml"
    config.write_text(f'[train]\nsteps = 2\nglobal_batch = 4\nseq_len = 16\n[checkpoint]\ndir = "{ckpt}"\n'
                      f'[log]\ndir = "{tmp_path / "log"}"\n')
    assert main(["train", str(config)]) == 2  # a second run of the same config, without the flag
    assert "already holds checkpoints" in capsys.readouterr().err
    with pytest.raises(no_launch):
        main(["train", str(config), "--fresh"])
    err = capsys.readouterr().err
    assert sorted(p.name for p in ckpt.iterdir()) == ["notes.txt"]  # only what plait saved went
    for name in ("step_000002", "step_000004", "step_000006.tmp", "best"):
        assert f"--fresh removed {ckpt / name}" in err
    assert main(["train", str(config), "--fresh", "--resume"]) == 2


def test_version_help_and_one_line_argument_errors(capsys) -> None:
    from plait.cli import main
    from plait.spec.clusters import CLUSTER_PRESETS

    with pytest.raises(SystemExit) as shown:
        main(["--version"])
    assert shown.value.code == 0 and capsys.readouterr().out.startswith("plait ")
    with pytest.raises(SystemExit) as refused:
        main(["plan", "--model", "tiny-gpt"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1 and "--cluster" in err and "usage" not in err
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(name in help_text for name in CLUSTER_PRESETS)


def test_solver_train_leaves_the_shipped_weights_alone_by_default(capsys) -> None:
    from plait.cli import build_parser
    from plait.commands.solver import DEFAULT_OUT

    args = build_parser().parse_args(["solver", "train"])
    assert args.out is None and not args.replace_shipped and "plait/data" not in str(DEFAULT_OUT)
    assert build_parser().parse_args(["solver", "train", "--replace-shipped"]).replace_shipped


# ---- calibration: a run far off its prediction says how to fix it ------------------------------------------------
def test_a_run_far_off_its_prediction_names_the_calibration_commands() -> None:
    from types import SimpleNamespace

    from plait.train.measure import calibration_advice

    def segment(predicted: float, measured: float, queued: float | None = None) -> SimpleNamespace:
        return SimpleNamespace(plan={"cluster": {"name": "local-cpu"}}, predicted=SimpleNamespace(step=predicted),
                               measured=lambda wall_clock=False: SimpleNamespace(step=measured), queued_share=lambda: queued)

    assert calibration_advice([segment(1.0, 1.4)], "runs/x", 2) is None  # within 1.5x: nothing to say
    advice = calibration_advice([segment(1.0, 1.4), segment(0.1, 1.37)], "runs/x", 2)
    assert "13.7x slower" in advice and "'local-cpu'" in advice
    assert "plait profile --nproc 2" in advice and "plait tune --from-run runs/x" in advice
    assert "`--from-run DIR` once more for every other run of this config" in advice
    assert "waited for a core" not in advice and "waited for a core" not in calibration_advice(
        [segment(0.1, 1.37, queued=0.05)], "runs/x", 2)
    shared = calibration_advice([segment(0.1, 1.37, queued=0.4)], "runs/x", 2)
    assert "waited for a core held by other work for 40% of the step" in shared
    assert "0.5x" not in calibration_advice([segment(1.0, 0.5)], "runs/x", 2) and "2.0x faster" in \
        calibration_advice([segment(1.0, 0.5)], "runs/x", 2)


def test_fp16_is_refused_in_one_line_before_ranks_start(tmp_path: Path, capsys, no_launch) -> None:
    from plait.cli import main

    config = tmp_path / "run.toml"
    config.write_text(f'[train]\nsteps = 2\nglobal_batch = 4\nseq_len = 16\nprecision = "fp16"\n'
                      f'[log]\ndir = "{tmp_path / "log"}"\n')
    assert main(["train", str(config)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "loss scaler" in lines[0] and '"bf16"' in lines[0], lines


def test_eval_path_is_a_second_source_read_like_the_first(tmp_path: Path) -> None:
    from plait.spec.models import MODEL_PRESETS
    from plait.train.data import eval_tokens, training_tokens

    (tmp_path / "train.txt").write_text("the training text " * 20)
    (tmp_path / "val.txt").write_text("held out")
    config = config_of(tmp_path, 'data.source="text"', f'data.path="{tmp_path / "train.txt"}"', "eval.every=2",
                       f'eval.path="{tmp_path / "val.txt"}"')
    model = MODEL_PRESETS["tiny-gpt"]
    assert bytes(np.asarray(eval_tokens(config, model), dtype=np.uint8)) == b"held out"
    assert len(training_tokens(config, model)) == len("the training text " * 20)  # nothing held out of it
