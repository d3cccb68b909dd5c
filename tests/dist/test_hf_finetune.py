"""Fine-tuning a Hugging Face checkpoint on gloo ranks: weights in under any plan, weights out, resume and reshard.

Built here, nothing downloaded: a tiny Llama checkpoint (random weights, model.safetensors) with a byte-level BPE
tokenizer trained on the shipped text, and a tiny GPT-2 checkpoint (tied embeddings, packed q|k|v: the layout
DCP's reader misplaced under tensor parallelism).

* load: every plan (dp, FSDP, dp x tp + SP, pp, pp x FSDP, pp x tp, 2x2x2) loads the file; the gathered parameters
  equal the file's exactly, and the parallel model's loss on a fixed batch is `from_pretrained`'s;
* train: the Llama fine-tuned 4 steps under pp2 x tp2 from the checkpoint (JSON-lines data, the model folder's
  tokenizer) exports at the end; a second run resumes its step-2 checkpoint under FSDP4 and exports too: the
  resumed steps and weights equal the uninterrupted run's;
* logits: each export, loaded with `from_pretrained`, gives the logits of the plan's parallel model holding it;
  its tensors are the trained weights bit for bit; `plait export` of the checkpoint writes the same tensors.

Two launches (world 4, then world 8 for 2x2x2); this file is also their worker:
    python tests/dist/test_hf_finetune.py SCRIPT.json
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

GLOBAL_BATCH, SEQ_LEN, STEPS, VOCAB = 4, 16, 4, 320
PLANS: dict[str, dict] = {
    "dp4": dict(dp=4, micro_batch=1),
    "fsdp4": dict(dp=4, zero=3, micro_batch=1),
    "dp2-tp2-sp": dict(dp=2, tp=2, sequence_parallel=True, micro_batch=1, num_micro_batches=2),
    "pp4": dict(pp=4, schedule="1f1b", micro_batch=1, num_micro_batches=4),
    "pp2-fsdp2": dict(pp=2, dp=2, zero=3, schedule="gpipe", micro_batch=1, num_micro_batches=2),
    "pp2-tp2": dict(pp=2, tp=2, schedule="1f1b", micro_batch=1, num_micro_batches=4),
    "2x2x2": dict(dp=2, tp=2, pp=2, zero=3, sequence_parallel=True, schedule="1f1b", micro_batch=1,
                  num_micro_batches=2),
}
WORLD = {name: math.prod(p.get(k, 1) for k in ("dp", "tp", "pp")) for name, p in PLANS.items()}
FAMILIES = ("llama", "gpt2")
TRAINED = {"A": "pp2-tp2", "C": "fsdp4"}  # run -> plan; C resumes A's step-2 checkpoint


# ---- building the runs (pytest side) ----------------------------------------------------------
def build_checkpoints(root: Path) -> None:
    from plait.hf.tiny import train_tokenizer, write_tiny_checkpoint
    from plait.train.data import shipped_text_path

    text = shipped_text_path().read_text(encoding="utf-8")[:60_000]
    write_tiny_checkpoint("llama", root / "llama", seed=1, vocab_size=VOCAB)
    train_tokenizer([text], VOCAB, root / "llama")
    write_tiny_checkpoint("gpt2", root / "gpt2", seed=2)
    # JSON lines: one paragraph of the play per document
    docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    (root / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def write_plan(root: Path, name: str, family: str) -> Path:
    from plait.plan import Plan
    from plait.spec import TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.spec.load import load_model

    kwargs = {"dp": 1, "tp": 1, "pp": 1, "num_micro_batches": 1, **PLANS[name]}
    plan = Plan.of(model=load_model(str(root / family)), cluster=CLUSTER_PRESETS["local-cpu"],
                   train=TrainSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision="fp32"), **kwargs)
    path = root / "plans" / f"{family}-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plan.to_json())
    return path


def train_item(root: Path, run: str, *, resume_from: str | None = None) -> dict:
    config = {
        "model": {"file": str(root / "llama"), "weights": "pretrained"},
        "data": {"source": "jsonl", "path": str(root / "train.jsonl")},
        "train": {"steps": STEPS, "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN, "seed": 5},
        "optimizer": {"warmup": 1, "lr": 1e-2},
        "plan": {"file": str(write_plan(root, TRAINED[run], "llama"))},
        "checkpoint": {"dir": str(root / run / "ckpt"), "every": 2, "resume": resume_from is not None,
                       "export_hf": str(root / run / "hf")},
        "log": {"dir": str(root / run / "log"), "progress": False, "save_model": True},
    }
    copy = [resume_from, str(root / run / "ckpt" / Path(resume_from).name)] if resume_from else None
    return {"kind": "train", "world": 4, "config": config, "copy": copy}


def model_items(root: Path) -> list[dict]:
    """Load each checkpoint under each plan; load each export under the plan that trained it."""
    items = [{"kind": "load", "world": WORLD[name], "plan": str(write_plan(root, name, family)),
              "weights": str(root / family), "out": str(root / "out" / f"load-{family}-{name}.pt")}
             for name in PLANS for family in FAMILIES]
    items += [{"kind": "load", "world": 4, "plan": str(write_plan(root, plan, "llama")),
               "weights": str(root / run / "hf"), "out": str(root / "out" / f"export-{run}.pt")}
              for run, plan in TRAINED.items()]
    return items


def launch(root: Path, world: int, items: list[dict]) -> None:
    from plait.runtime.launch import run_local

    script = root / f"script-{world}.json"
    script.write_text(json.dumps([i for i in items if i["world"] == world]))
    code = run_local(world, [__file__, str(script)], module=None, timeout_s=600)
    assert code == 0, f"the {world}-rank launch failed (exit {code}); see the output above"


@pytest.fixture(scope="module")
def runs() -> Iterator[Path]:
    # Not under pytest's basetemp: other sessions on this machine prune old basetemps while the ranks run.
    root = Path(tempfile.mkdtemp(prefix="plait-hf-"))
    try:  # removed after a failed launch too
        build_checkpoints(root)
        (root / "out").mkdir()
        items = [train_item(root, "A"), train_item(root, "C", resume_from=str(root / "A" / "ckpt" / "step_000002"))]
        items += model_items(root)
        launch(root, 4, items)
        launch(root, 8, items)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def batch(vocab: int):
    import torch

    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def file_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def hf_logits_and_loss(folder: Path, vocab: int):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32).eval()
    tokens, targets = batch(vocab)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)).item()


def losses(root: Path, run: str) -> dict[int, float]:
    lines = (root / run / "log" / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row["loss"] for row in map(json.loads, lines)}


# ---- tests ------------------------------------------------------------------------------------
pytestmark = pytest.mark.dist


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("plan", list(PLANS))
def test_loading_gives_exactly_the_file(runs: Path, plan: str, family: str) -> None:
    import torch

    result = torch.load(runs / "out" / f"load-{family}-{plan}.pt")
    stored = file_tensors(runs / family)  # GPT-2's holds wte and no lm_head (tied), as does the gathered model
    assert set(result["params"]) == set(stored), "the parallel model holds the file's tensors"
    for name, tensor in result["params"].items():
        assert torch.equal(tensor, stored[name]), f"{plan}: {name} differs from the file"
    logits, loss = hf_logits_and_loss(runs / family, result["vocab"])
    assert result["loss"] == pytest.approx(loss, rel=1e-5), "rotary tables and tied weights as from_pretrained's"
    if result["logits"] is not None:  # not gathered for pp x dp (each dp rank holds its rows)
        torch.testing.assert_close(result["logits"], logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("run", list(TRAINED))
def test_export_loads_with_from_pretrained_and_gives_the_parallel_logits(runs: Path, run: str) -> None:
    import torch
    from transformers import AutoTokenizer

    export = runs / run / "hf"
    result = torch.load(runs / "out" / f"export-{run}.pt")
    logits, loss = hf_logits_and_loss(export, VOCAB)
    torch.testing.assert_close(result["logits"], logits, rtol=1e-5, atol=1e-5)
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    trained = torch.load(runs / run / "log" / "model.pt")  # what the run gathered at its end
    exported = file_tensors(export)
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained), "the export is the trained weights"
    assert json.loads((export / "config.json").read_text())["dtype"] == "float32"
    exported_tokenizer = AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    base_tokenizer = AutoTokenizer.from_pretrained(str(runs / "llama"), local_files_only=True)
    assert exported_tokenizer("To be, or not").input_ids == base_tokenizer("To be, or not").input_ids


def test_resume_under_another_plan_equals_the_uninterrupted_run(runs: Path) -> None:
    import torch

    full, resumed = losses(runs, "A"), losses(runs, "C")
    assert sorted(full) == [1, 2, 3, 4] and sorted(resumed) == [3, 4], "C resumes A's step-2 checkpoint"
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), f"step {step}"
    a, c = torch.load(runs / "A" / "log" / "model.pt"), torch.load(runs / "C" / "log" / "model.pt")
    for key in a:
        torch.testing.assert_close(c[key], a[key], rtol=1e-4, atol=1e-5, msg=f"{key}")
    base = file_tensors(runs / "llama")
    assert not torch.equal(a["model.embed_tokens.weight"], base["model.embed_tokens.weight"]), "it trained"
    assert full[1] == pytest.approx(hf_loss_on_first_batch(runs), rel=1e-5), "step 1 starts from the checkpoint"


def hf_loss_on_first_batch(root: Path) -> float:
    """from_pretrained's loss on the run's first batch (the loader's, from the cached tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    from plait.spec.load import load_model
    from plait.train.config import config_from_dict
    from plait.train.data import BatchLoader, training_tokens

    config = config_from_dict(train_item(root, "A")["config"])
    tokens = training_tokens(config, load_model(str(root / "llama")))
    x, y = BatchLoader(tokens, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, seed=5).next_batch()
    model = AutoModelForCausalLM.from_pretrained(str(root / "llama"), local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).item()


def test_plait_export_of_the_checkpoint_writes_the_same_weights(runs: Path, tmp_path: Path) -> None:
    import torch

    from plait.cli import main

    out = tmp_path / "hf"
    assert main(["export", str(runs / "A" / "ckpt"), str(out), "--max-shard-size", "40KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "sharded by --max-shard-size, with an index"
    exported, trained = file_tensors(out), file_tensors(runs / "A" / "hf")
    assert exported.keys() == trained.keys() == set(index["weight_map"])
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    logits, _ = hf_logits_and_loss(out, VOCAB)
    torch.testing.assert_close(logits, hf_logits_and_loss(runs / "A" / "hf", VOCAB)[0], rtol=0, atol=0)
    assert (out / "tokenizer.json").is_file()
    assert main(["export", str(runs / "A" / "ckpt" / "step_000002"), str(out)]) == 2, "not empty: refused"
    assert main(["export", str(runs / "A" / "ckpt" / "step_000002"), str(out), "--force"]) == 0
    assert not (out / "model.safetensors.index.json").exists(), "no stale index after a smaller export"
    step2 = file_tensors(out)
    assert not torch.equal(step2["lm_head.weight"], trained["lm_head.weight"]), "step 2, not step 4"


# ---- worker (each rank) -------------------------------------------------------------------------
def parallel_logits(model, tokens, targets):
    """The logits of the parallel model itself for `tokens`, on its last pipeline rank (the schedule runs forward
    only, and its loss function wants the targets)."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad(), model._compute_context():
        if model.schedule is None:
            out = model.model_parts[0](tokens)
        else:
            out = model.schedule.eval(*((tokens,) if model.has_first_stage else ()), target=targets, losses=[])
    out = out.full_tensor() if isinstance(out, DTensor) else out
    return out if model.has_last_stage else None


def run_load(item: dict) -> None:
    import torch
    import torch.distributed as dist

    from plait.execute import parallelize
    from plait.plan import Plan

    plan = Plan.from_json(item["plan"])
    model = parallelize(plan, seed=0, device="cpu", weights=item["weights"])
    params = model.full_state_dict()
    vocab = plan.model.vocab_size
    tokens, targets = batch(vocab)
    rows = GLOBAL_BATCH // plan.dp
    mine = slice(model.dp_rank * rows, (model.dp_rank + 1) * rows)
    loss = model.train_step(tokens[mine], targets[mine])
    # with one pipeline stage every rank can run all rows; through a pipeline, the plan's rows of one dp rank
    rows = slice(None) if plan.pp == 1 else mine
    logits = parallel_logits(model, tokens[rows], targets[rows]) if plan.pp == 1 or plan.dp == 1 else None
    # the last pipeline rank holds the logits; send them to rank 0
    box = [logits]
    if plan.pp > 1:
        holders = [None] * dist.get_world_size()
        dist.all_gather_object(holders, logits)
        box = [next((h for h in holders if h is not None), None)]
    if dist.get_rank() == 0:
        torch.save({"params": params, "loss": loss, "vocab": vocab, "logits": box[0]}, item["out"])


def worker(script: Path) -> None:
    import torch.distributed as dist

    from plait.runtime.launch import init_distributed
    from plait.train import loop
    from plait.train.config import config_from_dict
    from plait.train.resolve import resolve_plan

    init_distributed("gloo", 120)
    for item in json.loads(script.read_text()):
        if item["kind"] == "load":
            run_load(item)
            continue
        if item["copy"] and dist.get_rank() == 0:
            shutil.copytree(*item["copy"])
        dist.barrier()
        config = config_from_dict(item["config"])
        loop._train(config, resolve_plan(config))  # loop.run without destroying the process group
    from plait.runtime.launch import shutdown_distributed

    shutdown_distributed()  # at a barrier: a rank closing its connections while another reads aborts it


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
