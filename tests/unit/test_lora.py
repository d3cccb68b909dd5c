"""LoRA in one process: plait's adapters compute what peft's do, bad LoRA input is refused in one line before any
rank starts, and the planner prices a frozen base (so it plans LoRA differently from full fine-tuning).

The parallel side (plait check under dp, FSDP, tp, pp; resume; the exports) is tests/dist/test_lora_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait.cli import main as cli_main
from plait.spec.lora import Lora

TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")
MODEL_PARAMS = 8_030_261_248  # Llama 3 8B


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from plait.hf.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora") / "llama"
    write_tiny_checkpoint("llama", root, seed=1, vocab_size=320)
    return root


def lora_spec(folder: Path, **kwargs):
    from plait.models.lora import with_lora
    from plait.spec.load import load_model

    return with_lora(load_model(str(folder)), Lora(**{"rank": 4, "alpha": 8.0, "targets": TARGETS, **kwargs}))


def test_plait_adapters_compute_what_peft_computes(llama_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from plait.models import adapter_for, build_model
    from plait.models.lora import merged_state, peft_names

    spec = lora_spec(llama_dir)
    adapter = adapter_for(spec)
    model = build_model(spec, device="cpu", seed=0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B starts at zero (the base's output); give it values so the adapters count
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n, _ in model.named_parameters() if ".lora_" in n], "the base is frozen, the adapters train"
    assert len([n for n, _ in model.named_parameters() if ".lora_A." in n]) == len(TARGETS) * spec.num_layers
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, 320, (2, 12), generator=generator)
    ours = adapter.forward(model, tokens)

    base = AutoModelForCausalLM.from_config(adapter.hf_config())
    base.load_state_dict({n: v for n, v in state.items() if ".lora_" not in n}, strict=False)
    adapter.reset_buffers(base)
    theirs = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS)))
    named = {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"):
             v for k, v in peft_names(state).items()}
    assert theirs.load_state_dict(named, strict=False).unexpected_keys == []
    torch.testing.assert_close(ours, theirs.eval()(input_ids=tokens).logits, rtol=0, atol=0)

    plain = AutoModelForCausalLM.from_config(adapter.hf_config())  # merged: the base's names, the adapted model
    plain.load_state_dict(merged_state(state, spec.lora))
    adapter.reset_buffers(plain)
    torch.testing.assert_close(plain(input_ids=tokens).logits, ours, rtol=1e-5, atol=1e-5)


def test_adapters_are_counted_and_split_as_tensor_parallelism_places_them(llama_dir: Path) -> None:
    spec = lora_spec(llama_dir)
    h, ffn, kv = spec.hidden_size, spec.ffn_hidden_size, spec.kv_size
    q, v, o, down = (h, spec.q_size), (h, kv), (spec.q_size, h), (ffn, h)  # (in, out)
    assert spec.lora.adapter_params == 4 * sum(i + o_ for i, o_ in (q, v, o, down))
    # column-wise q, v keep A whole; row-wise o, down keep B whole
    assert spec.lora.whole_params == 4 * (q[0] + v[0] + o[1] + down[1])


def test_a_frozen_base_keeps_fewer_activations(llama_dir: Path) -> None:
    """Autograd keeps no input for a frozen projection without an adapter: with q and v alone the MLP's and the
    output projection's inputs go; with every projection adapted nearly all is kept (each A keeps its input)."""
    from plait.cost.trainable import kept_activations

    qv = lora_spec(llama_dir, targets=("q_proj", "v_proj"))
    every = lora_spec(llama_dir, targets=("all-linear",))
    assert 0.6 < qv.lora.activation_share < 0.9 < every.lora.activation_share <= 1.1
    assert kept_activations(qv, "none", 100.0) == pytest.approx(100.0 * qv.lora.activation_share)
    assert kept_activations(qv, "full", 100.0) == 100.0, "full recompute keeps the block input either way"
    assert kept_activations(qv.replace(lora=None), "none", 100.0) == 100.0


def write_config(folder: Path, tmp_path: Path, lora: str) -> Path:
    config = tmp_path / "lora.toml"
    config.write_text(f'[model]\nfile = "{folder}"\nlora = {lora}\n[data]\ntokenizer = "byte"\n'
                      f'[train]\nsteps = 1\nglobal_batch = 2\nseq_len = 8\n[log]\ndir = "{tmp_path / "log"}"\n')
    return config


@pytest.mark.parametrize("lora, words", [
    ('{rank = 0, targets = ["q_proj"]}', ["rank=0", "positive integer"]),
    ('{rank = 4, targets = ["q_prj"]}', ["'q_prj' names no linear layer", "q_proj", "all-linear"]),
    ('{rank = 4, targets = ["lm_head"]}', ["lm_head lies outside the repeated blocks"]),
    ('{rank = 4}', ["targets=[]", "q_proj"]),
])
def test_bad_lora_is_refused_in_one_line_before_any_rank_starts(llama_dir, tmp_path, capsys, no_launch, lora,
                                                                words) -> None:
    code = cli_main(["train", str(write_config(llama_dir, tmp_path, lora)), "--nproc", "2"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "warning:" not in line]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("plait train: error: "), err
    assert all(word in lines[0] for word in words), lines[0]


def test_a_plan_file_must_have_the_configs_adapters(llama_dir: Path, tmp_path: Path) -> None:
    from plait.errors import ConfigError
    from plait.plan import Plan
    from plait.spec import TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.train.config import load_config
    from plait.train.resolve import resolve_plan

    plan = Plan.of(model=lora_spec(llama_dir), cluster=CLUSTER_PRESETS["local-cpu"].with_devices(2),
                   train=TrainSpec(global_batch=2, seq_len=8, precision="fp32"), dp=2, micro_batch=1)
    (tmp_path / "plan.json").write_text(plan.to_json())
    lora = f'{{rank = 4, alpha = 32, targets = {list(TARGETS)!r}, dropout = 0.1}}'.replace("'", '"')
    config = write_config(llama_dir, tmp_path, lora)
    ran = resolve_plan(load_config(config, [f'plan.file="{tmp_path / "plan.json"}"']))
    assert (ran.model.lora.alpha, ran.model.lora.dropout) == (32.0, 0.1), "the config's scale and dropout run"
    plain = tmp_path / "plain.toml"
    plain.write_text(config.read_text().replace(f"lora = {lora}\n", ""))
    with pytest.raises(ConfigError, match="with LoRA rank 4 on q_proj.*every weight trained.*without --lora-rank"):
        resolve_plan(load_config(plain, [f'plan.file="{tmp_path / "plan.json"}"']))


def test_plan_lora_arguments_are_checked(capsys) -> None:
    argv = ["plan", "--model", "tiny-llama", "--cluster", "local-cpu", "--devices", "2", "--global-batch", "4",
            "--seq-len", "64"]
    assert cli_main([*argv, "--lora-targets", "wq"]) == 2
    assert "needs --lora-rank" in capsys.readouterr().err
    assert cli_main([*argv, "--lora-rank", "4", "--lora-targets", "q_proj"]) == 2
    err = capsys.readouterr().err
    assert "'q_proj' names no linear layer" in err and "wq" in err, err


# ---- the planner's side ------------------------------------------------------------------------------
def llama8b(lora: bool):
    from plait.models.lora import with_lora
    from plait.spec.models import MODEL_PRESETS

    spec = MODEL_PRESETS["llama3-8b"]
    return with_lora(spec, Lora(rank=16, targets=("all-linear",))) if lora else spec


def test_a_frozen_base_keeps_no_gradients_or_optimizer_states() -> None:
    from plait.cost import predict
    from plait.cost.memory import ADAM_STATE_BYTES
    from plait.plan import Plan
    from plait.spec import TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    cluster = CLUSTER_PRESETS["h100-80g"].with_devices(1)
    train = TrainSpec(global_batch=1, seq_len=4096, precision="bf16")
    parts = {lora: predict(Plan.of(model=llama8b(lora), cluster=cluster, train=train, micro_batch=1)).memory_parts
             for lora in (False, True)}
    spec = llama8b(True)
    adapters = spec.lora.adapter_params * spec.num_layers  # one device holds them all: fp32, AdamW's two moments
    assert parts[True]["optimizer"] == pytest.approx(ADAM_STATE_BYTES * adapters, rel=1e-9)
    assert parts[True]["grads"] <= 4 * adapters * (1 + 1e-9)  # at most every adapter's fp32 gradient
    assert parts[False]["optimizer"] == pytest.approx(ADAM_STATE_BYTES * MODEL_PARAMS, rel=1e-9)
    # the base is held as it was (fp32, autocast's bf16 copy), and the adapters with it
    assert parts[True]["params"] - parts[False]["params"] == pytest.approx(6 * adapters, rel=1e-9)


def test_the_planner_plans_lora_differently_from_full_fine_tuning() -> None:
    """Llama 3 8B on 8 A100 40GB, 32 sequences of 4096: full fine-tuning needs the states split over tensor and
    pipeline ranks; with the base frozen they fit data parallelism, and the step is shorter (no weight gradients)."""
    from plait import plan as search
    from plait.spec import TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    cluster = CLUSTER_PRESETS["a100-40g"].with_devices(8)
    train = TrainSpec(global_batch=32, seq_len=4096, precision="bf16")
    full, lora = (search(llama8b(x), cluster, train, num_devices=8)[0] for x in (False, True))
    assert (full.tp, full.pp) != (1, 1) and (lora.tp, lora.pp) == (1, 1), (full.describe(), lora.describe())
    assert lora.predicted.step_time_s < 0.8 * full.predicted.step_time_s
    assert lora.predicted.memory_parts["optimizer"] < 0.01 * full.predicted.memory_parts["optimizer"]
