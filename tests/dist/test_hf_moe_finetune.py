"""A Qwen3-MoE checkpoint fine-tuned as transformers wrote the class, experts included, under ep2 x pp2.

Built here, nothing downloaded: a tiny Qwen3-MoE (4 experts, top-2) saved by `save_pretrained` (its experts one by
one on disk, `mlp.experts.<e>.gate_proj.weight`, which transformers fuses when it loads) and a BPE tokenizer trained
on the shipped text. One `plait train` launch of 4 ranks (pp2 x dp2, ep2: each data-parallel pair splits the
experts) with `weights = "pretrained"` and `export_hf`:

* step 1's loss is `from_pretrained`'s on the same batch (the per-expert tensors were fused and split right);
* the export loads with `from_pretrained` and gives the logits of the weights the run gathered at its end;
* the experts trained, and the run measured its routers' balance (plait.train.measure.RouterLoad).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

GLOBAL_BATCH, SEQ_LEN, STEPS, VOCAB = 4, 16, 3, 320
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"
pytestmark = pytest.mark.dist


def build(root: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    from transformers.utils import logging

    from plait.hf.tiny import train_tokenizer
    from plait.train.data import shipped_text_path

    logging.disable_progress_bar()
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=0,
                            eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(root / "base"))
    text = shipped_text_path().read_text(encoding="utf-8")[:60_000]
    train_tokenizer([text], VOCAB, root / "base")


def run_config(root: Path) -> dict:
    from plait.plan import Plan
    from plait.spec import TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.spec.load import load_model

    plan = Plan.of(model=load_model(str(root / "base")), cluster=CLUSTER_PRESETS["local-cpu"],
                   train=TrainSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision="fp32"),
                   pp=2, dp=2, ep=2, schedule="1f1b", micro_batch=1, num_micro_batches=2)
    (root / "plan.json").write_text(plan.to_json())
    return {
        "model": {"file": str(root / "base"), "weights": "pretrained"},
        "data": {"source": "shipped"},
        "train": {"steps": STEPS, "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN, "seed": 5},
        "optimizer": {"warmup": 1, "lr": 1e-2},
        "plan": {"file": str(root / "plan.json")},
        "checkpoint": {"export_hf": str(root / "hf")},
        "log": {"dir": str(root / "log"), "progress": False, "save_model": True},
    }


@pytest.fixture(scope="module")
def run() -> Iterator[Path]:
    from plait.cli import main
    from plait.train.config import toml_text

    root = Path(tempfile.mkdtemp(prefix="plait-hf-moe-"))  # not under pytest's basetemp, pruned by other sessions
    try:
        build(root)
        (root / "run.toml").write_text(toml_text(run_config(root)))
        assert main(["train", str(root / "run.toml"), "--timeout", "600"]) == 0
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def logits_of(model, tokens):
    import torch

    with torch.no_grad():
        return model(input_ids=tokens).logits


def first_batch(root: Path):
    from plait.spec.load import load_model
    from plait.train.config import config_from_dict
    from plait.train.data import BatchLoader, training_tokens

    config = config_from_dict(run_config(root))
    tokens = training_tokens(config, load_model(str(root / "base")))
    return BatchLoader(tokens, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, seed=5).next_batch()


def test_step_one_starts_from_the_checkpoint_as_from_pretrained_reads_it(run: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(run / "base"), local_files_only=True, dtype=torch.float32)
    x, y = first_batch(run)
    loss = torch.nn.functional.cross_entropy(logits_of(base, x).reshape(-1, VOCAB), y.reshape(-1)).item()
    rows = [json.loads(line) for line in (run / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0]["loss"] == pytest.approx(loss, rel=1e-5)


def test_the_export_loads_and_gives_the_trained_logits(run: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(run / "hf"), local_files_only=True, dtype=torch.float32)
    trained = AutoModelForCausalLM.from_config(exported.config)
    state = torch.load(run / "log" / "model.pt")
    missing, unexpected = trained.load_state_dict(state, strict=False)
    assert not missing and not unexpected, "the run gathered every tensor of the class, experts fused as it holds them"
    base = AutoModelForCausalLM.from_pretrained(str(run / "base"), local_files_only=True, dtype=torch.float32)
    assert not torch.equal(state[EXPERTS], base.state_dict()[EXPERTS]), "the experts trained"
    x, _ = first_batch(run)
    torch.testing.assert_close(logits_of(exported, x), logits_of(trained.eval(), x), rtol=0, atol=1e-6)


def test_the_run_measured_its_routers_balance(run: Path) -> None:
    measured = json.loads((run / "log" / "measured.json").read_text())
    loads = [rank["router_load"] for segment in measured["segments"] for rank in segment["ranks"]]
    readings = [value for load in loads for value in load.get("2", [])]  # ep2: 4 experts in two groups of 2
    assert readings and all(1.0 <= value <= 2.0 for value in readings), "RouterLoad read the class's routers"
