"""Hugging Face checkpoints in and out of a parallel model, for any plan.

In: every rank opens the directory's safetensors files (one `model.safetensors`, or shards listed by
`model.safetensors.index.json`) and reads only the tensors of its own stages, one at a time, copying its shard
of each into place (plait.execute.state.local_shard): no rank ever holds the whole model. A tied output layer
absent from the file takes the embedding's tensor; a checkpoint saved from the base model (GPT-2's on the Hub:
`h.0.attn...` without `transformer.`) is found under the names without the prefix. Non-persistent buffers
(rotary tables) are computed again by the adapter.

torch.distributed.checkpoint's HuggingFaceStorageReader was tried first: it loads plait's plain, FSDP, TP and
FSDP x TP layouts of Llama exactly, but places GPT-2's packed q|k|v projection under tensor parallelism wrongly
(parameters off by up to 0.114, measured, silently: DCP reads a strided shard as if it were contiguous), so plait
slices itself, with the one function that also loads the seed's initial weights.

Out, two ways to the same folder (safetensors files of at most `max_shard_bytes`, with an index when there is
more than one; the model's config.json, its `dtype` set to the tensors'; the tokenizer files):

* `export_hf` from a live parallel model (collective; `[checkpoint] export_hf` at the end of training): the
  first rank of every pipeline stage gathers its stages' full tensors (full_tensor over data, context and
  tensor ranks) one at a time and writes them, a shard file whenever `max_shard_bytes` is reached;
* `export_checkpoint` from one of plait's own checkpoints (`plait export`, one process, no process group):
  reads the DCP files a shard file's worth of tensors at a time.

Either way rank 0 (or the one process) names the files `model-0000k-of-0000n.safetensors` once all are
written, and `AutoModelForCausalLM.from_pretrained` loads the folder.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.errors import ConfigError
from plait.execute.state import local_shard, plain_named_parameters
from plait.models.lora import is_adapter

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 10**9
"""Hugging Face's customary largest shard file (save_pretrained's max_shard_size of transformers 4: "5GB")."""
MODEL_FILES = ("generation_config.json",)
"""Files of the model folder an export copies besides config.json (the tokenizer's: plait.hf.tokenizer_files)."""


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
                if is_adapter(name):  # LoRA's adapters are not the checkpoint's: they start from the seed
                    continue
                key = _stored_name(name, files, tied)

                def read(stored: str) -> torch.Tensor:
                    if files[stored] not in handles:
                        handles[files[stored]] = safe_open(str(files[stored]), framework="pt")
                    return handles[files[stored]].get_tensor(stored)

                full = read(key) if key is not None else _stacked_experts(name, files, read)
                if full is None:
                    raise ConfigError(f"{directory}: the checkpoint has no tensor {name!r} (nor a tied one, nor its "
                                      f"experts one by one); is it a checkpoint of this model?")
                _copy_into(param, full, name)
    finally:
        handles.clear()


def _stored_name(name: str, files: dict[str, Path], tied: dict[str, str]) -> str | None:
    """The checkpoint's name for parameter `name`: its own, without the base-model prefix, or its tied twin's."""
    for candidate in (name, tied.get(name)):
        if candidate is None:
            continue
        for key in (candidate, candidate.partition(".")[2]):
            if key in files:
                return key
    return None


PER_EXPERT = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",), "down_proj": ("down_proj",)}
"""A transformers experts weight [E, ...] -> the per-expert Linear weights `save_pretrained` writes for it
(`experts.<e>.gate_proj.weight`, ...; transformers fuses them when it loads), concatenated in this order."""


def _stacked_experts(name: str, files: dict[str, Path], read) -> torch.Tensor | None:
    """A fused experts weight (`...experts.gate_up_proj`) assembled from its experts one by one, as save_pretrained
    writes Qwen2/3-MoE, OLMoE, DeepSeek-V3 and their kin; None where the file holds neither."""
    prefix, _, leaf = name.rpartition(".")
    for base in (prefix, prefix.partition(".")[2]):
        parts = []
        for projection in PER_EXPERT.get(leaf, ()):
            experts = []
            while (key := f"{base}.{len(experts)}.{projection}.weight") in files:
                experts.append(read(key))
            parts.append(torch.stack(experts) if experts else None)
        if parts and all(p is not None for p in parts):
            return torch.cat(parts, dim=1)
    return None


def _copy_into(param: torch.Tensor, full: torch.Tensor, name: str) -> None:
    if tuple(full.shape) != tuple(param.shape):
        raise ConfigError(f"checkpoint tensor {name!r} has shape {list(full.shape)}, the model expects "
                          f"{list(param.shape)}")
    with torch.no_grad():
        if isinstance(param, DTensor):
            param.to_local().copy_(local_shard(full, param.device_mesh, param.placements))
        else:
            param.copy_(full)


class ShardWriter:
    """Collects tensors and writes them as safetensors files of at most `max_bytes` each (a larger tensor gets a
    file of its own), under temporary names `.<tag>-<k>.safetensors` that `publish` renames."""

    def __init__(self, out: Path, tag: str, max_bytes: int) -> None:
        self.out, self.tag, self.max_bytes = out, tag, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.written: list[tuple[str, list[str], int]] = []
        """(file name, tensor names, bytes) of each file written."""

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self.size += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        file = f".{self.tag}-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(self.out / file), metadata={"format": "pt"})
        self.written.append((file, sorted(self.pending), self.size))
        self.pending, self.size = {}, 0

    def close(self) -> list[tuple[str, list[str], int]]:
        self.flush()
        return self.written


def prepare_export_dir(out: Path) -> None:
    """Create `out`, and remove the weight files of an earlier export there (the caller has the user's consent:
    plait.outputs.filled_dir), so that no stale shard or index outlives this export."""
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), *out.glob(".*.safetensors"), out / INDEX]:
        old.unlink(missing_ok=True)


def publish(out: Path, written: list[tuple[str, list[str], int]], source_dir: Path, tokenizer_dir: Path | None,
            dtype: torch.dtype) -> Path:
    """Give the written files their Hugging Face names (one: model.safetensors; more: numbered, with an index),
    then write config.json (its dtype the tensors') and copy the tokenizer files."""
    count = len(written)
    weight_map: dict[str, str] = {}
    for number, (file, names, _) in enumerate(written, start=1):
        final = SINGLE if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"
        (out / file).rename(out / final)
        weight_map.update({name: final for name in names})
    if count > 1:
        total = sum(size for _, _, size in written)
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(
            weight_map.items()))}, indent=2) + "\n")
    _write_config(Path(source_dir), out, dtype)
    _copy_tokenizer(Path(source_dir), out, tokenizer_dir)
    return out


def _write_config(source: Path, out: Path, dtype: torch.dtype) -> None:
    # from_pretrained builds the model in config.json's dtype ("auto"): say what the files hold, or a model trained
    # in float32 from a bfloat16 checkpoint would load rounded to bfloat16.
    config = json.loads((source / "config.json").read_text())
    config.pop("torch_dtype", None)  # the key of transformers 4
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_tokenizer(source: Path, out: Path, tokenizer_dir: Path | None) -> None:
    """The model folder's generation config, and every file of the tokenizer trained with (the chat template
    included): `tokenizer_dir`'s when the run named one, else the model folder's, never a mix of the two."""
    from plait.hf.tokenizer_files import tokenizer_files

    for name in MODEL_FILES:
        if (source / name).is_file() and source.resolve() != out.resolve():
            shutil.copyfile(source / name, out / name)
    folder = tokenizer_dir if tokenizer_dir is not None and tokenizer_files(tokenizer_dir) else source
    if folder.resolve() == out.resolve():
        return
    for name in tokenizer_files(folder):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / name, out / name)


def export_hf(model, out_dir: str | Path, source_dir: str | Path, tokenizer_dir: str | Path | None = None, *,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write `model` (a ParallelModel of a Hugging Face model) to `out_dir` in Hugging Face's layout (collective).
    `source_dir` holds the model's config.json (and tokenizer files); `tokenizer_dir` the tokenizer trained with."""
    def tensors():
        for name, param in sorted(model.named_parameters()):
            if name in model.adapter.tied:  # a tied model's output layer is the embedding: written once, as HF does
                continue
            yield name, full_tensor(param)

    return export_stage_tensors(model, tensors(), out_dir, source_dir, tokenizer_dir, max_shard_bytes=max_shard_bytes)


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter: a collective over its mesh for a DTensor."""
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def export_stage_tensors(model, tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path,
                         source_dir: str | Path, tokenizer_dir: str | Path | None = None, *,
                         max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the whole tensors this pipeline stage yields (every rank of the stage walks the same names: gathering
    them is collective) as safetensors shards, one writer per stage, then rank 0 publishes the folder: the index,
    config.json and the tokenizer's files (collective)."""
    out = Path(out_dir)
    rank = dist.get_rank()
    if rank == 0:
        prepare_export_dir(out)
    dist.barrier()
    leader = model.mesh["dp_cp"].get_local_rank() == 0 and model.mesh["tp"].get_local_rank() == 0
    writer = ShardWriter(out, f"stage{model.pp_rank:05d}", max_shard_bytes)
    dtype = None
    for name, full in tensors:
        dtype = full.dtype
        if leader:
            writer.add(name, full)
    written = writer.close() if leader else []
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (model.pp_rank, written, dtype))
    if rank == 0:
        ordered = [entry for _, entry_list, _ in sorted(gathered, key=lambda g: g[0]) for entry in entry_list]
        dtype = next(d for _, _, d in gathered if d is not None)
        publish(out, ordered, Path(source_dir), Path(tokenizer_dir) if tokenizer_dir else None, dtype)
    dist.barrier()
    return out


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, source_dir: str | Path,
                      tokenizer_dir: str | Path | None, tied: dict[str, str], *,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the model of one of plait's checkpoints (plait.train.checkpoint: DCP files keyed ``model.<name>``) to
    `out_dir` in Hugging Face's layout, in this one process (no process group), one shard file of tensors in memory
    at a time."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    stored = {key.removeprefix("model."): meta for key, meta in metadata.items() if key.startswith("model.")}
    names = sorted(name for name in stored if not (name in tied and tied[name] in stored))
    out = Path(out_dir)
    prepare_export_dir(out)
    writer = ShardWriter(out, "export", max_shard_bytes)
    group: list[str] = []
    for name in names + [None]:
        if name is not None and _bytes(stored[name]) + sum(_bytes(stored[n]) for n in group) <= max_shard_bytes:
            group.append(name)
            continue
        if group:  # read this file's worth of tensors, then write them
            state = {"model": {n: torch.empty(stored[n].size, dtype=stored[n].properties.dtype) for n in group}}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, storage_reader=dcp.FileSystemReader(str(checkpoint)), no_dist=True)
            for n in group:
                writer.add(n, state["model"][n])
            writer.flush()
        group = [name] if name is not None else []
    dtype = stored[names[0]].properties.dtype
    return publish(out, writer.close(), Path(source_dir), Path(tokenizer_dir) if tokenizer_dir else None, dtype)


def _bytes(meta) -> int:
    return math.prod(meta.size) * torch.empty((), dtype=meta.properties.dtype).element_size()
