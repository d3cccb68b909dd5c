"""A LoRA run's weights out, two ways (plait.models.lora):

* merged: a plain Hugging Face folder, each adapted weight W + (alpha / r)·B·A and no adapter left, in the base
  model's names and shapes: `AutoModelForCausalLM.from_pretrained` loads it like the base ([checkpoint] export_hf,
  `plait export`);
* adapter: peft's folder, `adapter_config.json` (peft's LoraConfig, written by peft) and `adapter_model.safetensors`
  (the adapters under peft's names), which `peft.PeftModel.from_pretrained(base, folder)` loads onto the base
  ([checkpoint] export_adapter, `plait export --adapter`).

From a live parallel model (collective, at the end of a run) the merged folder streams like
plait.hf.checkpoint.export_hf, one full tensor at a time; from a checkpoint (`plait export`, one process), which
holds the adapters alone (plait.train.checkpoint), the base comes from where the run started: the model folder's
safetensors ([model] weights = "pretrained") or the seed's initial weights.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from plait.hf.checkpoint import (DEFAULT_SHARD_BYTES, ShardWriter, _copy_tokenizer, export_stage_tensors,
                                 full_tensor, prepare_export_dir, publish, weight_files)
from plait.models.lora import adapted_modules, adapted_weight, is_adapter, peft_names
from plait.spec.lora import Lora

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lora: Lora) -> torch.Tensor:
    """W + scale·B·A, computed in float64 and stored in W's dtype."""
    return (weight.double() + (b.double() @ a.double()) * lora.scale).to(weight.dtype)


# ---- from a live parallel model (collective) -------------------------------------------------------------------
def export_merged(model, out_dir: str | Path, source_dir: str | Path, tokenizer_dir: str | Path | None = None, *,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """`model` (a ParallelModel with LoRA adapters) as a plain Hugging Face folder, its adapters merged (collective;
    the layout and writer of plait.hf.checkpoint.export_hf)."""
    lora = model.plan.model.lora
    params = dict(model.named_parameters())

    def merged():
        for name in sorted(params):
            if is_adapter(name) or name in model.adapter.tied:
                continue
            full = full_tensor(params[name])  # collective over the stage: every rank walks the same names
            a_name = name.removesuffix(".weight") + ".lora_A.weight"
            if a_name in params:
                full = merge(full, full_tensor(params[a_name]), full_tensor(params[a_name.replace("lora_A", "lora_B")]),
                             lora)
            yield name, full

    return export_stage_tensors(model, merged(), out_dir, source_dir, tokenizer_dir, max_shard_bytes=max_shard_bytes)


def export_adapter(model, out_dir: str | Path, source_dir: str | Path, tokenizer_dir: str | Path | None = None
                   ) -> Path:
    """`model`'s adapters as peft's adapter folder (collective; rank 0 writes)."""
    local = {name: full_tensor(param).cpu().clone() for name, param in sorted(model.named_parameters()) if is_adapter(name)}
    if model.plan.pp > 1:
        pieces: list = [None] * model.plan.pp
        dist.all_gather_object(pieces, local, group=model.mesh["pp"].get_group())
        local = {name: tensor for piece in pieces for name, tensor in piece.items()}
    out = Path(out_dir)
    if dist.get_rank() == 0:
        write_adapter_folder(local, model.plan.model.lora, out, Path(source_dir),
                             Path(tokenizer_dir) if tokenizer_dir else None)
    dist.barrier()
    return out


def write_adapter_folder(adapters: dict[str, torch.Tensor], lora: Lora, out: Path, source_dir: Path,
                         tokenizer_dir: Path | None) -> Path:
    """peft's adapter folder for `adapters` (full tensors under plait's names) of a model whose base is in
    `source_dir`: peft's own LoraConfig writes adapter_config.json."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_WEIGHTS).unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in peft_names(adapters).items()}, str(out / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=adapted_modules(adapters), task_type="CAUSAL_LM",
                        base_model_name_or_path=str(Path(source_dir).resolve()))
    config.save_pretrained(str(out))
    _copy_tokenizer(Path(source_dir), out, tokenizer_dir)
    return out


# ---- from a checkpoint (one process) ---------------------------------------------------------------------------
def checkpoint_adapters(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The adapters a LoRA run's checkpoint holds, full tensors under plait's names (one process, no group)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    stored = {key.removeprefix("model."): meta for key, meta in metadata.items()
              if key.startswith("model.") and is_adapter(key)}
    state = {"model": {n: torch.empty(m.size, dtype=m.properties.dtype) for n, m in stored.items()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(checkpoint)), no_dist=True)
    return state["model"]


def base_tensors(spec, meta: dict, source_dir: Path, names: list[tuple[str, tuple]] | None = None):
    """(name, full tensor) of the base model a LoRA run started from, one at a time: the model folder's
    safetensors where the run loaded them ([model] weights = "pretrained"), else the seed's initial weights.
    `names`: (name, shape) of the base's parameters (default: the model's, built on meta)."""
    from safetensors import safe_open

    from plait.hf.checkpoint import _stored_name
    from plait.models import adapter_for

    adapter = adapter_for(spec)
    if names is None:
        names = [(name, tuple(p.shape)) for name, p in adapter.build("meta").named_parameters()]
    config = meta.get("config", {})
    if config.get("model", {}).get("weights") == "pretrained":
        files = weight_files(source_dir)
        for name, _ in names:
            key = _stored_name(name, files, adapter.tied)
            with safe_open(str(files[key]), framework="pt") as handle:
                yield name, handle.get_tensor(key)
        return
    seed = int(config.get("train", {}).get("seed", 0))
    for name, shape in names:
        yield name, adapter.initial_tensor(name, shape, seed)


def load_base(model: torch.nn.Module, spec, meta: dict) -> None:
    """Fill `model` (one process, LoRA adapters on it) with the base the checkpoint's run started from."""
    params = {name: p for name, p in model.named_parameters() if not is_adapter(name)}
    names = [(name, tuple(p.shape)) for name, p in params.items()]
    with torch.no_grad():
        for name, tensor in base_tensors(spec.replace(lora=None), meta, Path(spec.source.removeprefix("hf:")), names):
            params[name].copy_(tensor)


def export_checkpoint_lora(checkpoint: str | Path, out_dir: str | Path, source_dir: str | Path,
                           tokenizer_dir: str | Path | None, meta: dict, *, adapter_only: bool,
                           max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """`plait export` of a LoRA run's checkpoint: its adapters merged into the base (a plain Hugging Face folder),
    or, `adapter_only`, peft's adapter folder."""
    from plait.spec import ModelSpec

    spec = ModelSpec.from_dict(meta["plan"]["model"]).replace(source="hf:" + str(Path(source_dir).resolve()))
    adapters = checkpoint_adapters(checkpoint)
    out = Path(out_dir)
    tokenizer = Path(tokenizer_dir) if tokenizer_dir else None
    if adapter_only:
        return write_adapter_folder(adapters, spec.lora, out, Path(source_dir), tokenizer)
    by_weight = {adapted_weight(name): name for name in adapters if name.endswith("lora_A.weight")}
    prepare_export_dir(out)
    writer = ShardWriter(out, "export", max_shard_bytes)
    dtype = next(iter(adapters.values())).dtype  # the run's parameters' (a pretrained base was loaded into them)
    for name, tensor in base_tensors(spec.replace(lora=None), meta, Path(source_dir)):
        tensor = tensor.to(dtype)
        if name in by_weight:
            a = by_weight[name]
            tensor = merge(tensor, adapters[a], adapters[a.replace("lora_A", "lora_B")], spec.lora)
        writer.add(name, tensor)
    return publish(out, writer.close(), Path(source_dir), tokenizer, dtype)


def is_lora_checkpoint(meta: dict) -> bool:
    return bool(meta.get("plan", {}).get("model", {}).get("lora"))


def adapter_config(folder: Path) -> dict:
    return json.loads((folder / ADAPTER_CONFIG).read_text())
