"""Hugging Face checkpoints in and out of a parallel model, for any plan.

In: every rank opens the directory's safetensors files (one `model.safetensors`, or shards listed by
`model.safetensors.index.json`) and reads only the tensors of its own stages, one at a time, copying its shard
of each into place (plait.execute.state.local_shard): no rank ever holds the whole model. A tied output layer
absent from the file takes the embedding's tensor. Non-persistent buffers (rotary tables) are computed again by
the adapter.

torch.distributed.checkpoint's HuggingFaceStorageReader was tried first: it loads plait's plain, FSDP, TP and
FSDP x TP layouts of Llama exactly, but places GPT-2's packed q|k|v projection under tensor parallelism wrongly
(parameters off by up to 0.11, silently: DCP reads a strided shard as if it were contiguous), so plait slices
itself, with the one function that also loads the seed's initial weights.

Out: the first rank of every pipeline stage gathers its stages' full tensors (full_tensor over data, context and
tensor ranks), one at a time, and writes them as one safetensors shard; rank 0 writes the index, the model's
config.json and the tokenizer files. `AutoModelForCausalLM.from_pretrained` loads the result.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.errors import ConfigError
from plait.execute.state import local_shard, plain_named_parameters

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json")


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it; {} when the directory has no weights."""
    directory = Path(directory)
    if (directory / INDEX).is_file():
        index = json.loads((directory / INDEX).read_text())
        return {name: directory / file for name, file in index["weight_map"].items()}
    if (directory / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(directory / SINGLE), framework="pt") as f:
            return {name: directory / SINGLE for name in f.keys()}
    return {}


def has_weights(directory: str | Path) -> bool:
    directory = Path(directory)
    return (directory / INDEX).is_file() or (directory / SINGLE).is_file()


def load_hf_weights(parts: list[nn.Module], tied: dict[str, str], directory: str | Path) -> None:
    """Copy each of this rank's parameter shards from the checkpoint in `directory` (no communication)."""
    from safetensors import safe_open

    files = weight_files(directory)
    if not files:
        raise ConfigError(f"{directory}: no {SINGLE} or {INDEX}; nothing to load")
    handles: dict[Path, object] = {}
    try:
        for part in parts:
            for name, param in plain_named_parameters(part, remove_duplicate=False):
                key = name if name in files else tied.get(name, name)
                if key not in files:
                    raise ConfigError(f"{directory}: the checkpoint has no tensor {name!r} (nor a tied one); is it "
                                      f"a checkpoint of this model?")
                if files[key] not in handles:
                    handles[files[key]] = safe_open(str(files[key]), framework="pt")
                full = handles[files[key]].get_tensor(key)
                _copy_into(param, full, name)
    finally:
        handles.clear()


def _copy_into(param: torch.Tensor, full: torch.Tensor, name: str) -> None:
    if tuple(full.shape) != tuple(param.shape):
        raise ConfigError(f"checkpoint tensor {name!r} has shape {list(full.shape)}, the model expects "
                          f"{list(param.shape)}")
    with torch.no_grad():
        if isinstance(param, DTensor):
            param.to_local().copy_(local_shard(full, param.device_mesh, param.placements))
        else:
            param.copy_(full)


def export_hf(model, out_dir: str | Path, source_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """Write `model` (a ParallelModel of a Hugging Face model) to `out_dir` in Hugging Face's layout (collective)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    rank = dist.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    leader = model.mesh["dp_cp"].get_local_rank() == 0 and model.mesh["tp"].get_local_rank() == 0
    tensors: dict[str, torch.Tensor] = {}
    for name, param in sorted(model.named_parameters()):
        if name in model.adapter.tied and model.adapter.tied[name] in dict(model.named_parameters()):
            continue  # the tied output layer is the embedding (as Hugging Face saves it)
        if name in model.adapter.tied:  # the last stage's copy of a tied weight: the first stage writes it
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if leader:
            tensors[name] = full.detach().to("cpu", copy=True).contiguous()
    pp, pp_rank = model.plan.pp, model.mesh["pp"].get_local_rank()
    file = SINGLE if pp == 1 else f"model-{pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    if leader:
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, (file, sorted(tensors)) if leader else None)
    if rank == 0:
        weight_map = {name: f for entry in names if entry for f, listed in [entry] for name in listed}
        if pp > 1:
            size = sum((out / f).stat().st_size for f in set(weight_map.values()))
            (out / INDEX).write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map},
                                                indent=2) + "\n")
        _copy_side_files(Path(source_dir), out, Path(tokenizer_dir) if tokenizer_dir else None)
    dist.barrier()
    return out


def _copy_side_files(source: Path, out: Path, tokenizer_dir: Path | None) -> None:
    shutil.copyfile(source / "config.json", out / "config.json")
    for folder in (source, tokenizer_dir):
        if folder is None:
            continue
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)
