"""LoRA on gloo ranks: `plait check` EQUAL under every kind of plan, training, resume and the two exports.

Built here, nothing downloaded: a tiny Llama checkpoint with a BPE tokenizer (plait.hf.tiny), adapters on
five of its seven projections (column- and row-wise ones).

* check: dp2 (DDP), FSDP2 (ZeRO-3), tp2 with sequence parallelism and pp2 (1F1B), each from the pretrained base,
  against one process in float64 whose base `from_pretrained` loads and whose adapters are placed as peft places
  them: EQUAL, the base untouched;
* train: run A (tp2) checkpoints at steps 2 and 4 and exports at its end, merged (export_hf) and as peft's adapter
  folder (export_adapter); run B resumes A's step-2 checkpoint under FSDP2: the same losses and adapters;
* exports: the merged folder, loaded with `from_pretrained`, and the base with the adapter folder, loaded with
  `peft.PeftModel.from_pretrained`, give the trained model's logits; `plait export` of A's checkpoint (which holds
  the adapters alone) writes the same two folders, and `plait generate` reads it over the base.

One launch of 2 ranks; this file is also its worker:  python tests/dist/test_lora_runs.py SCRIPT.json
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

GLOBAL_BATCH, SEQ_LEN, STEPS, VOCAB = 4, 16, 4, 320
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]}
CHECKS: dict[str, dict] = {
    "dp2": dict(dp=2, micro_batch=2),
    "fsdp2": dict(dp=2, zero=3, micro_batch=1, num_micro_batches=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True, micro_batch=4),
    "pp2": dict(pp=2, schedule="1f1b", micro_batch=1, num_micro_batches=4),
}
TRAINED = {"A": dict(tp=2, micro_batch=4), "B": dict(dp=2, zero=3, micro_batch=2)}  # B resumes A's step 2


# ---- building the runs (pytest side) ----------------------------------------------------------
def build_base(root: Path) -> None:
    from plait.hf.tiny import train_tokenizer, write_tiny_checkpoint
    from plait.train.data import shipped_text_path

    text = shipped_text_path().read_text(encoding="utf-8")[:40_000]
    write_tiny_checkpoint("llama", root / "llama", seed=1, vocab_size=VOCAB)
    train_tokenizer([text], VOCAB, root / "llama")
    docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    (root / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def lora_spec(root: Path):
    from plait.models.lora import with_lora
    from plait.spec.load import load_model
    from plait.spec.lora import Lora

    return with_lora(load_model(str(root / "llama")), Lora(**{**LORA, "targets": tuple(LORA["targets"])}))


def write_plan(root: Path, name: str, pins: dict) -> Path:
    from plait.plan import Plan
    from plait.spec import TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    kwargs = {"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 1, **pins}
    plan = Plan.of(model=lora_spec(root), cluster=CLUSTER_PRESETS["local-cpu"],
                   train=TrainSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision="fp32"), **kwargs)
    path = root / "plans" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plan.to_json())
    return path


def train_config(root: Path, run: str) -> dict:
    resume = run == "B"
    checkpoint = {"dir": str(root / run / "ckpt"), "every": 2, "resume": resume}
    if not resume:
        checkpoint |= {"export_hf": str(root / run / "hf"), "export_adapter": str(root / run / "adapter")}
    return {
        "model": {"file": str(root / "llama"), "weights": "pretrained", "lora": LORA},
        "data": {"source": "jsonl", "path": str(root / "train.jsonl")},
        "train": {"steps": STEPS, "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN, "seed": 5},
        "optimizer": {"warmup": 1, "lr": 3e-2},
        "plan": {"file": str(write_plan(root, f"train-{run}", TRAINED[run]))},
        "checkpoint": checkpoint,
        "log": {"dir": str(root / run / "log"), "progress": False, "save_model": True},
    }


@pytest.fixture(scope="module")
def runs() -> Iterator[Path]:
    from plait.runtime.launch import run_local

    root = Path(tempfile.mkdtemp(prefix="plait-lora-"))  # not under pytest's basetemp (other pytest runs prune it)
    try:
        build_base(root)
        items = [{"kind": "check", "name": name, "plan": str(write_plan(root, name, pins)),
                  "weights": str(root / "llama"), "out": str(root / f"check-{name}.json")}
                 for name, pins in CHECKS.items()]
        items += [{"kind": "train", "config": train_config(root, "A")},
                  {"kind": "train", "config": train_config(root, "B"),
                   "copy": [str(root / "A" / "ckpt" / "step_000002"), str(root / "B" / "ckpt" / "step_000002")]}]
        script = root / "script.json"
        script.write_text(json.dumps(items))
        assert run_local(2, [__file__, str(script)], module=None, timeout_s=600) == 0, "the launch failed"
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def losses(root: Path, run: str) -> dict[int, float]:
    rows = map(json.loads, (root / run / "log" / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row["loss"] for row in rows}


def tokens():
    import torch

    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(3))


def trained_logits(root: Path, run: str):
    """The trained model's logits: plait's single-process LoRA model holding the run's final state (model.pt)."""
    import torch

    from plait.models import adapter_for, build_model

    spec = lora_spec(root)
    model = build_model(spec, device="cpu")
    model.load_state_dict(torch.load(root / run / "log" / "model.pt"), strict=False)
    adapter_for(spec).reset_buffers(model)
    with torch.no_grad():
        return model(input_ids=tokens()).logits


def hf_logits(folder: Path, adapter: Path | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model.eval()(input_ids=tokens()).logits


# ---- tests ------------------------------------------------------------------------------------
pytestmark = pytest.mark.dist


@pytest.mark.parametrize("name", list(CHECKS))
def test_check_is_equal_under_every_plan(runs: Path, name: str) -> None:
    result = json.loads((runs / f"check-{name}.json").read_text())
    assert result["failures"] == [], result
    assert result["worst_update"][1] < 1e-9, "adapters updated as one process updates them"
    assert result["base_moved"] == 0.0, "the frozen base is the file's, unmoved"
    assert result["trainable"] == result["trained_adapters"] == result["adapters"] > 0, "gradients: the adapters'"


def test_resume_under_another_plan_equals_the_uninterrupted_run(runs: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    full, resumed = losses(runs, "A"), losses(runs, "B")
    assert sorted(full) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), f"step {step}"
    a, b = torch.load(runs / "A" / "log" / "model.pt"), torch.load(runs / "B" / "log" / "model.pt")
    assert all(a[k].abs().max() > 0 for k in a if "lora_B" in k), "the adapters trained (B starts at zero)"
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6, msg=key)
    saved = dcp.FileSystemReader(str(runs / "A" / "ckpt" / "step_000004")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), "checkpoints hold adapters"


def test_the_merged_export_and_the_peft_folder_give_the_trained_logits(runs: Path) -> None:
    import torch

    expected = trained_logits(runs, "A")
    torch.testing.assert_close(hf_logits(runs / "A" / "hf"), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_logits(runs / "llama", runs / "A" / "adapter"), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hf_logits(runs / "llama"), expected, atol=1e-3), "the adapters changed the model"
    config = json.loads((runs / "A" / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert sorted(config["target_modules"]) == sorted(LORA["targets"])


def test_plait_export_of_the_adapter_checkpoint_writes_both_folders(runs: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from plait.cli import main

    assert main(["export", str(runs / "A" / "ckpt"), str(tmp_path / "merged")]) == 0
    assert main(["export", str(runs / "A" / "ckpt"), str(tmp_path / "adapter"), "--adapter"]) == 0
    merged, live = load_file(str(tmp_path / "merged" / "model.safetensors")), load_file(str(runs / "A" / "hf" /
                                                                                            "model.safetensors"))
    assert merged.keys() == live.keys() and not any("lora" in k for k in merged)
    for key in merged:
        torch.testing.assert_close(merged[key], live[key], rtol=0, atol=1e-6, msg=key)
    ours = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    theirs = load_file(str(runs / "A" / "adapter" / "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_generate_reads_the_adapter_checkpoint_over_its_base(runs: Path) -> None:
    import torch

    from plait.commands.generate import checkpoint_generator

    generator, expected = checkpoint_generator(runs / "A" / "ckpt"), trained_logits(runs, "A")
    with torch.no_grad():
        torch.testing.assert_close(generator.logits_of(tokens()), expected, rtol=1e-5, atol=1e-5)


# ---- worker (each rank) -------------------------------------------------------------------------
def run_check(item: dict) -> None:
    """`plait check`'s two runs (plait.execute.equivalence), keeping the parallel run's own gradients and weights."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from plait.execute.equivalence import CheckSettings, Tolerance, compare, run_parallel
    from plait.models.lora import is_adapter
    from plait.plan import Plan

    plan = Plan.from_json(item["plan"])
    settings = CheckSettings(steps=2, seed=1, lr=1e-2, weights=item["weights"])
    run = run_parallel(plan, settings)
    if dist.get_rank() == 0:
        result = compare(plan, settings, run)
        stored = load_file(str(Path(item["weights"]) / "model.safetensors"))
        base_moved = max((run.params[name].double() - stored[name].double()).abs().max().item()
                         for name in run.params if not is_adapter(name))
        Path(item["out"]).write_text(json.dumps({
            "failures": result.failures(Tolerance()), "worst_update": list(result.worst_update),
            "base_moved": base_moved, "adapters": sum(is_adapter(n) for n in run.params),
            "trainable": len(run.first_grads), "trained_adapters": sum(is_adapter(n) for n in run.first_grads)}))


def worker(script: Path) -> None:
    import torch.distributed as dist

    from plait.runtime.launch import init_distributed
    from plait.train import loop
    from plait.train.config import config_from_dict
    from plait.train.resolve import resolve_plan

    init_distributed("gloo", 120)
    for item in json.loads(script.read_text()):
        began = time.perf_counter()
        if item["kind"] == "check":
            run_check(item)
        else:
            if item.get("copy") and dist.get_rank() == 0:
                shutil.copytree(*item["copy"])
            dist.barrier()
            config = config_from_dict(item["config"])
            loop._train(config, resolve_plan(config))
        dist.barrier()
        if dist.get_rank() == 0:  # where the launch's time goes (pytest shows it when a test fails)
            print(f"{item['kind']} {item.get('name', '')}: {time.perf_counter() - began:.1f} s", file=sys.stderr)
    from plait.runtime.launch import shutdown_distributed

    shutdown_distributed()  # at a barrier: a rank closing its connections while another reads aborts it


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
