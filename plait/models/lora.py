"""LoRA adapters on a frozen base model, for every plan plait runs (ModelSpec.lora, plait.spec.lora).

`apply_lora(model, lora, adapter)` turns each targeted `nn.Linear` of the repeated blocks into a `LoraLinear` in
place -- the same object, its class changed -- and gives it two child Linears, `lora_A` [rank, in] and `lora_B`
[out, rank], as peft names them; every other parameter is frozen. The base weight keeps its name and object, so
what addresses the model by name (checkpoint loading, tied parameters, tensor plans, pipeline stages) is
unchanged, and the adapters are parameters like any other: fully_shard, DDP, pipeline stages and checkpoints take
them as they come.

Why not peft's own layers: peft (0.21) wraps the linear (its weight becomes `q_proj.base_layer.weight`, renaming
every adapted tensor the checkpoints and the tensor plans name), and torch's ColwiseParallel / RowwiseParallel
take nn.Linear and nn.Embedding only (`NotImplementedError: ColwiseParallel currently only support nn.Linear and
nn.Embedding!` on peft's lora.Linear, tried), nor would their partition functions place the adapters inside it.
plait computes what peft computes (h = W·x + b + (alpha / r)·B·A·dropout(x), A initialised as peft does, B at
zero: `tests/unit/test_lora.py` compares the two on the same weights) and writes peft's adapter folder on export
(plait.execute.lora_export), which `peft.PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import ConfigError
from plait.spec.lora import ALL_LINEAR, Lora

ADAPTERS = ("lora_A", "lora_B")
"""The child modules a LoraLinear adds, peft's names."""
_ADAPTER_NAME = re.compile(r"(^|\.)lora_[AB]\.weight$")


class LoraLinear(nn.Linear):
    """An nn.Linear with low-rank adapters: W·x + b + scale·B(A(dropout(x))). Made from the model's own Linear by
    `apply_lora`; under tensor parallelism its weight and adapters are DTensors placed by plait.execute.lora."""

    lora_scale: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.lora_scale


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is an adapter's (`...q_proj.lora_A.weight`)."""
    return bool(_ADAPTER_NAME.search(name))


def adapted_weight(name: str) -> str:
    """The base weight an adapter parameter belongs to: `x.q_proj.lora_A.weight` -> `x.q_proj.weight`."""
    return name.rsplit(".", 2)[0] + ".weight"


def initial_adapter(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """peft's initial adapters: A as nn.Linear's default (kaiming_uniform with a = sqrt(5): uniform in
    ±1/sqrt(in)), B zeros -- so the adapted model starts as the base."""
    if name.endswith("lora_B.weight"):
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


def _matches(path: str, target: str) -> bool:
    """peft's rule for a list of target_modules: the module's path is the target or ends with '.' + target."""
    return path == target or path.endswith("." + target)


def block_linears(model: nn.Module, blocks_path: str) -> dict[str, nn.Linear]:
    """Path (from the model's root) -> every nn.Linear inside the repeated blocks."""
    from plait.models.adapter import get_module

    blocks = get_module(model, blocks_path)
    return {f"{blocks_path}.{key}.{path}": module for key, block in blocks.named_children()  # ModuleList or Dict
            for path, module in block.named_modules() if isinstance(module, nn.Linear) and path}


def find_targets(model: nn.Module, lora: Lora, blocks_path: str, model_name: str = "the model") -> dict[str, nn.Linear]:
    """The Linears `lora.targets` names inside the blocks; ConfigError for a target that names none of them."""
    linears = block_linears(model, blocks_path)
    if ALL_LINEAR in lora.targets:
        return linears
    found: dict[str, nn.Linear] = {}
    for target in lora.targets:
        hits = {path: module for path, module in linears.items() if _matches(path, target)}
        if not hits:
            raise ConfigError(_no_such_target(model, target, linears, blocks_path, model_name))
        found.update(hits)
    wrong = {path: type(m).__name__ for path, m in found.items() if type(m) is not nn.Linear}
    if wrong:
        path, kind = next(iter(wrong.items()))
        raise ConfigError(f"model.lora target {path!r} is a {kind}, not an nn.Linear; plait adapts plain linear "
                          f"layers: target others")
    return found


def _no_such_target(model: nn.Module, target: str, linears: dict[str, nn.Module], blocks_path: str,
                    model_name: str) -> str:
    names = sorted({path.rsplit(".", 1)[-1] for path in linears})
    outside = [path for path, module in model.named_modules() if _matches(path, target)
               and not path.startswith(blocks_path + ".")]
    where = (f" ({outside[0]} lies outside the repeated blocks, which plait does not adapt)" if outside else "")
    return (f"model.lora target {target!r} names no linear layer of {model_name}'s blocks{where}; its blocks' "
            f"linear layers are {', '.join(names) or 'none'} (or use \"{ALL_LINEAR}\")")


def apply_lora(model: nn.Module, lora: Lora, blocks_path: str, model_name: str = "the model") -> list[str]:
    """Freeze every parameter of `model` and give each target Linear its adapters (on the weight's device and in
    its dtype; their values are set where the weights are: ModelAdapter.initial_tensor). Returns the paths adapted."""
    targets = find_targets(model, lora, blocks_path, model_name)
    for param in model.parameters():
        param.requires_grad_(False)
    for linear in targets.values():
        weight = linear.weight
        linear.__class__ = LoraLinear
        linear.lora_A = nn.Linear(linear.in_features, lora.rank, bias=False, device=weight.device, dtype=weight.dtype)
        linear.lora_B = nn.Linear(lora.rank, linear.out_features, bias=False, device=weight.device,
                                  dtype=weight.dtype)
        linear.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
        linear.lora_scale = lora.scale
    return list(targets)


def with_lora(spec, lora: Lora):
    """`spec` with `lora` attached, its adapters counted and their blocks' activations measured on `meta`
    (Lora.adapter_params, whole_params, activation_share); ConfigError for a target that names no linear layer of
    the blocks."""
    from plait.models.adapter import adapter_for

    adapter = adapter_for(spec.replace(lora=None))
    model = adapter.build("meta")
    adapted = apply_lora(model, lora.settings(), adapter.blocks_path, spec.name)
    share = activation_share(adapter, model)
    styles = _block_styles(adapter)
    total = whole = 0
    for path in adapted:
        linear = model.get_submodule(path)
        a, b = lora.rank * linear.in_features, lora.rank * linear.out_features
        total += a + b
        style = styles.get(path.split(".", len(adapter.blocks_path.split(".")) + 1)[-1], "")
        whole += a if style.startswith("colwise") else b if style.startswith("rowwise") else a + b
    layers = max(len(model.get_submodule(adapter.blocks_path)), 1)
    return spec.replace(lora=Lora(rank=lora.rank, alpha=lora.alpha, targets=lora.targets, dropout=lora.dropout,
                                  adapter_params=round(total / layers), whole_params=round(whole / layers),
                                  activation_share=share))


MEASURED_SEQ = 64
"""Tokens of the sequence `activation_share` runs on meta (the share is a ratio per token: shapes only)."""


def activation_share(adapter, adapted: nn.Module) -> float:
    """Bytes autograd keeps for backward inside the blocks of `adapted` (the base frozen, adapters on it) over those
    of the same model with every weight trained, over one forward of the whole model on meta (so the first block
    sees the embedding's output as it does in training); 1 where the model cannot run on meta. `adapted` is left as
    it came."""
    from plait.models.adapter import get_module

    def saved_in_blocks(model: nn.Module) -> float:
        depth, saved = [0], {}
        blocks = list(get_module(model, adapter.blocks_path).children())
        hooks = [h for block in blocks for h in (
            block.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1)),
            block.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1)))]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            # a weight (or its transposed view, which mm keeps for the input's gradient) is no activation; views of
            # one tensor (a projection's input flattened by each linear that reads it) are one; held: a freed
            # tensor's id would be reused
            base = tensor if tensor._base is None else tensor._base
            if depth[0] and not isinstance(base, nn.Parameter):
                saved[id(base)] = (base, base.numel() * base.element_size())
            return tensor

        tokens = torch.zeros(1, MEASURED_SEQ, dtype=torch.long, device="meta")
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                adapter.forward(model, tokens)
        finally:
            for hook in hooks:
                hook.remove()
        return float(sum(nbytes for _, nbytes in saved.values()))

    trainable = {param: param.requires_grad for param in adapted.parameters()}
    try:
        frozen = saved_in_blocks(adapted)
        for param in trainable:  # the same model with every weight trained (its adapters' few r-wide tensors too)
            param.requires_grad_(True)
        trained = saved_in_blocks(adapted)
    except Exception:  # a class whose forward needs real values: priced as full fine-tuning
        return 1.0
    finally:
        for param, requires in trainable.items():
            param.requires_grad_(requires)
    return min(frozen / trained, 1.5) if trained > 0 else 1.0


def _block_styles(adapter) -> dict[str, str]:
    """Block-relative path -> the adapter's tensor-parallel style ({} for a model without a tensor plan)."""
    try:
        return dict(adapter.tp_plan().block)
    except (ConfigError, NotImplementedError):
        return {}


def merged_state(state: dict[str, torch.Tensor], lora: Lora) -> dict[str, torch.Tensor]:
    """A full state dict with its adapters folded into their weights (W + scale·B·A) and left out: the base
    model's names and shapes, what `from_pretrained` loads."""
    out = {name: tensor for name, tensor in state.items() if not is_adapter(name)}
    for name in state:
        if name.endswith("lora_A.weight"):
            weight = adapted_weight(name)
            a, b = state[name], state[name.replace("lora_A", "lora_B")]
            delta = (b.double() @ a.double()) * lora.scale
            out[weight] = (out[weight].double() + delta).to(out[weight].dtype)
    return out


def peft_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a full state dict under the names peft's adapter files use (PeftModelForCausalLM's
    `base_model.model.` prefix, no adapter name)."""
    return {f"base_model.model.{name}": tensor for name, tensor in state.items() if is_adapter(name)}


def adapted_modules(state_names) -> list[str]:
    """The leaf names of the adapted modules (peft's target_modules for an adapter folder): `q_proj`, `v_proj`."""
    return sorted({name.split(".")[-3] for name in state_names if is_adapter(name)})
