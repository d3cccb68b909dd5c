"""transformers' own experts modules, as plait reads them (no family written here).

transformers 5 writes every mixture-of-experts MLP's routed experts as one module of stacked 3-D weights
(`gate_up_proj` [E, 2I, h] and `down_proj` [E, h, I]; transposed, [E, h, 2I] and [E, I, h], where the class says
`is_transposed`; biases [E, 2I] and [E, h] where `has_bias`), decorated by `use_experts_implementation`, which marks
it `_is_expert_parallel` and gives it one calling convention: `experts(hidden [T, h], top_k_index [T, k],
top_k_weights [T, k]) -> [T, h]`, each token's k experts weighted and summed. Its parent module (the "MoE block":
router, experts, shared experts) is what the decoder layer calls.

What follows from that, for the executor (plait/hf/expert_parallel.py) and the ModelSpec (plait/hf/spec.py):

* expert parallelism splits the first dimension (E) of every weight over the ep ranks;
* tensor parallelism splits each expert's inner width I as Megatron splits an MLP: gate|up by columns (each half on
  its own: rank r holds the r-th slice of gate and of up), down by rows, the partial outputs summed;
* inside a MoE block under tensor parallelism every activation is whole on every tensor rank: the modules the
  class's tensor plan places nowhere there (the router, a shared expert's gate) are kept whole too
  (`MOE_REPLICATE`), and their gradients are whole on every rank, since the experts' routing weights enter through
  Megatron's f operator (their gradient summed over the tensor ranks).
"""

from __future__ import annotations

from torch import nn

from plait.models.adapter import is_norm_module

GATED = ("gate_up_proj", "up_proj")
"""Weights (and, with `_bias`, biases) whose output is the experts' inner width."""
DOWN = "down_proj"
MOE_BLOCK = "moe_block"
"""plait's style of a module holding class experts (plait.models.adapter.STYLES)."""
MOE_REPLICATE = "replicate"
"""plait's style of a module inside a MoE block that the class's tensor plan places nowhere."""


def is_class_experts(module: nn.Module) -> bool:
    """A transformers experts module (stacked 3-D weights, the `use_experts_implementation` calling convention)."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "num_experts") and any(
        p.dim() == 3 for p in module.parameters(recurse=False))


def class_experts(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every class experts module under `root`."""
    return [(path, module) for path, module in root.named_modules() if path and is_class_experts(module)]


def moe_blocks(root: nn.Module) -> list[str]:
    """Paths under `root` of the modules whose child is a class experts module (the MoE blocks)."""
    return sorted({path.rpartition(".")[0] for path, _ in class_experts(root)} - {""})


def inner_dim(experts: nn.Module, name: str) -> int | None:
    """The dimension of weight `name` along each expert's inner width I (what tensor parallelism splits); None for
    the down projection's bias ([E, h])."""
    transposed = bool(getattr(experts, "is_transposed", False))
    if name in GATED:
        return 2 if transposed else 1
    if name == DOWN:
        return 1 if transposed else 2
    if name.removesuffix("_bias") in GATED:
        return 1
    return None


def hidden_dim(experts: nn.Module, name: str) -> int:
    """The dimension of weight `name` that neither expert nor tensor parallelism splits, along which data
    parallelism shards the experts (plait.models.moe.Experts.HIDDEN_DIM's counterpart): h, or for the gate|up bias
    ([E, 2I]) its inner width."""
    transposed = bool(getattr(experts, "is_transposed", False))
    if name in GATED:
        return 1 if transposed else 2
    if name == DOWN:
        return 2 if transposed else 1
    return 1


def packed_parts(experts: nn.Module, name: str) -> int:
    """How many projections a weight stacks along its inner width: 2 for gate|up concatenated (each split over tp
    on its own), 1 otherwise (an interleaved gate/up pairs each column with its neighbour, which a contiguous split
    keeps together)."""
    concatenated = bool(getattr(experts, "is_concatenated", True)) and bool(getattr(experts, "has_gate", True))
    return 2 if concatenated and name.removesuffix("_bias") == "gate_up_proj" else 1


def moe_tensor_styles(blocks: list[nn.Module], placed: list[str]) -> dict[str, str]:
    """plait's tensor styles for the MoE blocks of `blocks` (paths relative to a block): each MoE block
    `MOE_BLOCK`, and each module inside one that holds parameters and lies under none of the `placed` patterns
    (the router, a shared expert's gate; not norms, which plait keeps whole anyway) `MOE_REPLICATE`."""
    out: dict[str, str] = {}
    replicated: list[str] = []
    for block in blocks:
        experts = {path for path, _ in class_experts(block)}
        for parent in moe_blocks(block):
            out[parent] = MOE_BLOCK
            owner = block.get_submodule(parent)
            for sub_path, module in owner.named_modules():
                path = f"{parent}.{sub_path}" if sub_path else parent
                if not sub_path or path in experts or not any(True for _ in module.parameters(recurse=False)):
                    continue
                if any(path == p or path.startswith(p + ".") for p in [*placed, *replicated]) or is_norm_module(module):
                    continue  # placed by the class, inside a module already kept whole, or a norm
                out[path] = MOE_REPLICATE
                replicated.append(path)
    return out
