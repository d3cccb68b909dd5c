"""Model adapters: what the executor (and, through the ModelSpec, the planner) needs from a model family.

An adapter describes one family of decoder-only models without changing their code:

* ``build(device)``: the whole model as its author builds it (on ``meta`` for planning and before
  sharding); its own ``forward`` is the single-process truth `plait check` compares with;
* ``blocks_path``: the repeated blocks (the unit of pipeline cuts, FSDP and activation checkpointing);
  ``pre`` / ``post``: the modules that run before and after them (embedding, final norm, head);
  ``shared``: modules every pipeline stage needs (rotary tables);
* ``embed`` / ``block_kwargs`` / ``head``: how one pipeline stage runs its share (plait.models.stage);
* ``tp_plan()``: tensor parallelism as data, module pattern -> style name (`TensorPlan`);
* ``tied``: parameter aliases (the output layer sharing the embedding);
* ``initial_tensor(name, shape, seed)``: deterministic initial weights per parameter, so any shard
  or stage builds alone and equals the single-process model;
* ``loss(logits, targets)``; ``selective(block)``: what "selective" recompute checkpoints in a block.

Adapters: plait's reference decoders (plait.models.reference_adapter), Hugging Face causal LMs
(plait.hf.adapter) and a user's own module (plait.models.factory). `adapter_for(spec)` picks one from
`ModelSpec.source`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from plait.spec import ModelSpec

IGNORE_INDEX = -100
"""A target the loss skips (torch's cross_entropy default): chat mode's untrained tokens (plait.train.chat)."""

STYLES = {
    # inside a block (patterns relative to the block)
    "colwise": "output features split over tp (Linear, or HF Conv1D)",
    "colwise_packed": "K fused projections (q|k|v, gate|up), each split over tp: 'colwise_packed:3'",
    "rowwise": "input features split over tp; outputs summed (all-reduce, or reduce-scatter under SP)",
    "colwise_kv": "a key or value projection of N kv heads: 'colwise_kv:N'; column-wise, or each head replicated "
                  "over the tp / N ranks that read it where N < tp (Megatron-LM's multi-query tensor parallelism)",
    "colwise_gather": "column-wise, its output gathered whole on every tensor rank (what follows runs replicated)",
    "rowwise_split": "row-wise on a whole (replicated) input, each rank taking its slice of the input features",
    "norm": "a norm over hidden: replicated, or on sequence slices under sequence parallelism",
    "head_norm": "a norm over head_dim of tp-sharded heads (Qwen3's q_norm / k_norm)",
    "gather_input": "under sequence parallelism, gather the module's hidden-state input over the sequence",
    "experts": "mixture-of-experts experts: split over ep (and their inner width over tp)",
    "moe_block": "a module holding a transformers class's experts: activations whole inside it, the sequence "
                 "gathered at its input and sliced at its output under SP (plait/hf/expert_parallel.py)",
    "replicate": "kept whole on every tensor rank (parameters replicated), run on local values on its input as it "
                 "comes: exact where that input is whole and the same on every rank (its gradients then are too)",
    "replicate_module": "a module and all it holds whole on every tensor rank, run on local values (no collective "
                        "inside); under SP its input gathered and its output cut back to the rank's sequence slice",
    "sharded_input": "parameters replicated, run on a column-wise output split along its last dim (gradients summed)",
    "local_param": "a bare parameter of a module (attention sinks, per head) split along its first dim, read as the "
                   "rank's slice while its module runs (transformers' 'local_params')",
    "mla_kv_a": "latent attention's kv_a_proj: replicated, its last N (rotary) features' gradient summed: 'mla_kv_a:N'",
    # around the blocks (paths from the root)
    "embedding": "vocabulary-parallel embedding (rows split over tp, any vocabulary size)",
    "position_embedding": "learned positions: replicated (sliced along the sequence under SP)",
    "final_norm": "the norm after the last block",
    "output": "the output layer, vocabulary split over tp, with a loss that never gathers the logits",
}


@dataclass(frozen=True)
class TensorPlan:
    """Tensor parallelism as data: module pattern -> style name (see STYLES). `block` patterns are relative to a
    block (e.g. "self_attn.q_proj"), `root` ones to the model (e.g. "model.embed_tokens")."""

    block: dict[str, str]
    root: dict[str, str]

    def __post_init__(self) -> None:
        for pattern, style in {**self.block, **self.root}.items():
            if style.split(":")[0] not in STYLES:
                raise ValueError(f"tensor plan entry {pattern!r}: style {style!r} is not one of {', '.join(STYLES)}")


@dataclass
class StageContext:
    """What the blocks of one stage need besides the hidden states: the global positions of this rank's tokens
    (under context parallelism a slice of the sequence; [rows, s] position ids restarting at each document of the
    micro-batch running, where the adapter takes_positions), and the adapter's per-step tables."""

    positions: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)


def _loss_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits in at least fp32 (16-bit logits lose the loss's precision); float64 stays float64 (plait check)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def get_module(root: nn.Module, path: str) -> nn.Module | None:
    module = root
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def set_module(root: nn.Module, path: str, value: nn.Module | None) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = get_module(root, parent_path) if parent_path else root
    setattr(parent, name, value)


def tied_parameters(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """(alias, first name) for every parameter registered under more than one name (tied embeddings)."""
    first: dict[int, str] = {}
    pairs = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            pairs.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    return tuple(pairs)


def is_norm_module(module: nn.Module) -> bool:
    """A norm: any class whose name contains "Norm", but not an embedding or projection that normalizes its output
    (Inkling's InklingNormedEmbedding is an nn.Embedding, initialized as weights are)."""
    return "Norm" in type(module).__name__ and not isinstance(module, (nn.Embedding, nn.Linear))


def norm_parameters(model: nn.Module) -> frozenset[str]:
    """Names of the parameters held directly by norm modules (is_norm_module)."""
    return frozenset(f"{path}.{leaf}" if path else leaf for path, module in model.named_modules()
                     if is_norm_module(module) for leaf, _ in module.named_parameters(recurse=False))


def _name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, name); Python's hash() is salted per process, so not that."""
    value = (seed * 1_000_003) & (2**63 - 1)
    for char in name.encode():
        value = (value * 131 + char) % (2**61 - 1)
    return value


class ModelAdapter:
    """Base class: the generic parts; a family overrides what differs (see the module docstring)."""

    blocks_path: str = "layers"
    pre: tuple[str, ...] = ()
    post: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    tied: dict[str, str] = {}
    """alias parameter name -> canonical name (e.g. "lm_head.weight" -> "model.embed_tokens.weight")."""
    residual_outputs: tuple[str, ...] = ()
    """Name suffixes of the projections that write into the residual stream (scaled init, GPT-2's scheme)."""
    init_std: float = 0.02

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    # ---- building ------------------------------------------------------------------------
    def build(self, device: str | torch.device = "meta") -> nn.Module:
        raise NotImplementedError

    def build_adapted(self, device: str | torch.device = "meta") -> nn.Module:
        """`build(device)` with the spec's LoRA adapters on its frozen base (plait.models.lora; none without
        ModelSpec.lora): the module every plan runs and every single-process reference computes."""
        model = self.build(device)
        if self.spec.lora is not None:
            from plait.models.lora import apply_lora

            apply_lora(model, self.spec.lora, self.blocks_path, self.spec.name)
        return model

    def reset_buffers(self, module: nn.Module) -> None:
        """Recompute non-persistent buffers after `to_empty` (they hold garbage then)."""

    def after_tensor_parallel(self, block: nn.Module, tp: int) -> None:
        """Fix a block's attributes that encode full widths (GPT-2's fused-projection split size)."""

    # ---- running one pipeline stage ------------------------------------------------------
    def embed(self, stage: nn.Module, tokens: torch.Tensor, ctx: StageContext) -> torch.Tensor:
        raise NotImplementedError

    def block_kwargs(self, stage: nn.Module, hidden: torch.Tensor, ctx: StageContext) -> dict[str, Any]:
        """Keyword arguments every block of the stage is called with (rotary tables, masks)."""
        return {}

    def kwargs_of(self, kwargs: dict[str, Any], index: int) -> Any:
        """What block `index` is called with, out of `block_kwargs` (the same for every block, unless an adapter
        keeps them per block)."""
        return kwargs

    def run_block(self, block: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        out = block(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def head(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    takes_positions: bool = False
    """Whether the model runs packed documents apart from per-token position ids (`forward`'s `positions`, a stage's
    StageContext.positions [rows, s]): its attention stays within each document and positions restart there
    (plait.train.documents). plait's own decoders and a user's module do not: they attend across documents."""

    def own_attention(self, model: nn.Module) -> None:
        """Make a whole single-process model attend as its author's code does on its own (plait.execute.reference,
        the truth `plait check` compares with); plait's decoders and a user's module already do."""

    attention_sees_positions: bool = False
    """Whether context parallelism's attention is handed each token's position in its document (it then keeps packed
    documents apart across its ranks, plait/execute/context.py)."""

    def forward(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the whole single-process model (its author's own forward); `positions`: see takes_positions."""
        if positions is not None:
            raise ValueError(f"{type(self).__name__} takes no document positions (takes_positions is False)")
        return model(tokens)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the trained targets of a whole batch; logits [b, s, V], targets [b, s].
        What one process computes for a step (plait.execute.reference); a parallel step assembles the same mean from
        `loss_sum` over its pieces (plait.execute.step_loss)."""
        if not targets.is_meta and not bool((targets != IGNORE_INDEX).any()):  # meta: a dry run's trace, no data
            # every target masked (a chat window with no assistant token): the mean would be 0/0 = NaN and poison the
            # gradients; a zero with the graph attached trains nothing instead (plait.train.chat counts such windows)
            return self.loss_sum(logits, targets)
        return F.cross_entropy(_loss_logits(logits).flatten(0, 1), targets.flatten(0, 1))

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of the next-token cross-entropies of the trained targets (IGNORE_INDEX skipped): 0, with the graph
        attached, where none is trained."""
        return F.cross_entropy(_loss_logits(logits).flatten(0, 1), targets.flatten(0, 1), reduction="sum")

    # ---- parallelism as data -------------------------------------------------------------
    def tp_plan(self) -> TensorPlan:
        raise NotImplementedError

    def moe_modules(self, block: nn.Module) -> list[tuple[str, nn.Module]]:
        """(path in the block, module) of each mixture-of-experts layer of plait's kind (plait.models.moe)."""
        from plait.models.moe import MoE

        return [(name, module) for name, module in block.named_modules() if isinstance(module, MoE)]

    def set_attention(self, block: nn.Module, core: nn.Module) -> None:
        """Make `block` compute softmax(q·kᵀ·scale)·v with `core(q, k, v, scale=None)` ([b, heads, s, d] in and
        out): context parallelism's attention, which sees the other ranks' keys and values."""
        raise NotImplementedError(f"{type(self).__name__} cannot swap its attention (no context parallelism)")

    def selective(self, block: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> int:
        """Selective recompute: wrap (or mark) what of `block` is recomputed; returns how many units."""
        raise NotImplementedError

    # ---- weights -------------------------------------------------------------------------
    def is_norm(self, name: str) -> bool:
        leaf = name.rsplit(".", 2)
        module = leaf[-2] if len(leaf) > 1 else ""
        return "norm" in module or module.startswith("ln_") or module == "ln_f"

    def initial_tensor(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The initial value of parameter `name` (full, unsharded, fp32, CPU): GPT-2's scheme.

        normal(0, init_std) for weights, the residual projections scaled by 1/sqrt(2·layers), zeros for
        biases, ones for norm weights. Each tensor has its own generator seeded from (seed, name), so any
        subset of the model (a stage, a shard) is built alone and equals the single-process model's."""
        name = self.tied.get(name, name)
        leaf = name.rsplit(".", 1)[-1]
        from plait.models.lora import initial_adapter, is_adapter

        if is_adapter(name):
            return initial_adapter(name, shape, torch.Generator().manual_seed(_name_seed(seed, name)))
        if self.is_norm(name):
            return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
        if leaf == "bias":
            return torch.zeros(shape)
        generator = torch.Generator().manual_seed(_name_seed(seed, name))
        std = self.init_std
        if name.endswith(self.residual_outputs):
            std /= math.sqrt(2 * self.spec.num_layers)
        return torch.randn(shape, generator=generator) * std

    def initialize(self, model: nn.Module, seed: int) -> None:
        """Fill a whole (single-process) model with the initial tensors."""
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(self.initial_tensor(name, tuple(param.shape), seed))
        self.reset_buffers(model)

    def canonical(self, name: str) -> str:
        return self.tied.get(name, name)


_ADAPTERS: dict[str, Callable[[ModelSpec], ModelAdapter]] = {}


def register(kind: str, factory: Callable[[ModelSpec], ModelAdapter]) -> None:
    """Adapters by the prefix of ModelSpec.source ("plait", "hf", "module")."""
    _ADAPTERS[kind] = factory


def adapter_for(spec: ModelSpec) -> ModelAdapter:
    kind = spec.source.split(":", 1)[0]
    if kind not in _ADAPTERS:
        import importlib

        importlib.import_module({"plait": "plait.models.reference_adapter", "hf": "plait.hf.adapter",
                                 "module": "plait.models.factory"}[kind])
    return _ADAPTERS[kind](spec)
