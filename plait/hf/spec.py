"""The ModelSpec of a Hugging Face causal LM, measured on `meta` from the class itself (no weights, no compute).

Each decoder layer is run on meta under FlopCounterMode with exactly what the class passes it (rotary tables,
masks: plait.hf.structure.around_layers), at two sequence lengths (plait.models.measure): FLOPs per
token, FLOPs per token and position (attention), parameters and the bytes saved for backward. Layers alike (same
class, same entry of the config's ``layer_types``) are measured once. The shapes legality needs (heads, kv-heads,
widths, vocabulary, experts) are read from the config. For the families the cost model has closed forms for
(plait.spec.load.model_from_hf_config: Llama-like, GPT-2, Mixtral / Qwen3-MoE), those fields come from there and
only the blocks are measured; tests/unit/test_hf_spec.py checks the two agree within 1%.

What the measurement cannot see: FLOPs of operators torch's FlopCounterMode has no formula for (state-space
scans, custom kernels) count as zero, so such a block is priced low; and a layer whose forward needs real data on
meta (data-dependent expert loops) cannot be measured: it is priced from its config's closed form where there is
one, else refused in one line.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from plait.errors import ConfigError
from plait.legality import NO_TENSOR_PLAN, PLAIT_STYLE
from plait.models.adapter import get_module, is_norm_module
from plait.spec.load import WINDOW_KEYS, window_fields
from plait.torch_internals import tree_map
from plait.spec.model import BlockCost, ModelSpec

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Config keys transformers' MoE classes name their routed experts by."""


def _first(config: Any, *keys: str, default: Any = None) -> Any:
    for key in keys:
        value = getattr(config, key, None)
        if value is not None:
            return value
    return default


def config_fields(config: Any, structure, meta_model: nn.Module) -> dict[str, Any]:
    """ModelSpec shape fields read from any transformers config (attribute_map spells GPT-2's n_embd hidden_size)."""
    hidden = int(config.hidden_size)
    heads = int(_first(config, "num_attention_heads", default=1))
    head_dim = _first(config, "head_dim")
    learned = any(isinstance(get_module(meta_model, p), nn.Embedding) and p.rsplit(".", 1)[-1] != "embed_tokens"
                  and get_module(meta_model, p).num_embeddings != config.vocab_size for p in structure.pre)
    experts = int(_first(config, *EXPERT_KEYS, default=0) or 0)
    fields = dict(arch="llama", num_layers=len(get_module(meta_model, structure.blocks_path)), hidden_size=hidden,
                  num_heads=heads, num_kv_heads=_first(config, "num_key_value_heads", "multi_query_group_num"),
                  head_dim=int(head_dim) if isinstance(head_dim, int) and head_dim * heads != hidden else None,
                  ffn_hidden_size=_first(config, "intermediate_size", "n_inner", "ffn_hidden_size",
                                         default=4 * hidden) or 4 * hidden,
                  vocab_size=int(config.vocab_size), tied_embeddings=bool(structure.tied),
                  max_seq_len=int(_first(config, "max_position_embeddings", default=2048) or 2048),
                  positions="learned" if learned else "rope",
                  **window_fields({key: getattr(config, key, None) for key in WINDOW_KEYS}))
    if experts:
        fields.update(num_experts=experts, experts_per_token=int(_first(config, "num_experts_per_tok", "top_k",
                                                                        default=1)),
                      moe_ffn_hidden_size=_first(config, "moe_intermediate_size", "intermediate_size"))
    return fields


def _layer_kind(config: Any, index: int, block: nn.Module) -> tuple:
    """Layers alike: one class, one entry of `layer_types`, the same parameters (DeepSeek-V3's first layers hold a
    dense MLP where the others hold experts, in one class)."""
    kinds = getattr(config, "layer_types", None)
    shapes = tuple((name, tuple(p.shape)) for name, p in block.named_parameters())
    return (type(block), kinds[index] if isinstance(kinds, (list, tuple)) and index < len(kinds) else None, shapes)


def block_caller(adapter, causal_mask: bool | None = None) -> Callable[[int], Callable[[nn.Module, torch.Tensor], Any]]:
    """call(index)(block, x): layer `index` run on hidden states `x` (on meta) with what its class passes it (with a
    4-D causal mask where the class needs one: HFAdapter.needs_causal_mask)."""
    masked = adapter.needs_causal_mask if causal_mask is None else causal_mask
    model = adapter.meta_model
    blocks = get_module(model, adapter.blocks_path)
    hidden = int(adapter.hf_config().hidden_size)
    arguments: dict[int, dict[int, tuple]] = {}

    def call(index: int):
        def run(block: nn.Module, x: torch.Tensor):
            seq = x.shape[1]
            if seq not in arguments:
                calls, _ = _layer_arguments(adapter.model_class, model, blocks_path=adapter.blocks_path,
                                            num_layers=len(blocks), pre=adapter.pre,
                                            positions=torch.arange(seq, device="meta"),
                                            hidden=torch.zeros(1, seq, hidden, device="meta"),
                                            stop_at=len(blocks) - 1, causal_mask=masked)
                arguments[seq] = calls
            _, args, kwargs = arguments[seq][index]
            if x.dtype != torch.float32:  # a 16-bit run's rotary tables and masks are in its dtype too
                args, kwargs = tree_map(lambda t: t.to(x.dtype) if isinstance(t, torch.Tensor)
                                        and t.dtype == torch.float32 else t, (args, kwargs))
            return block(x, *args, **kwargs)
        return run
    return call


def untrained_block_parameters(adapter) -> frozenset[str]:
    """Names of the layers' parameters that get no gradient from a layer's output (a sparse-attention indexer: its
    top-k picks positions, no gradient flows back), found on meta, one layer of each kind."""
    model, config = adapter.meta_model, adapter.hf_config()
    blocks = list(get_module(model, adapter.blocks_path))
    hidden = int(config.hidden_size)
    call, first_of_kind, out = block_caller(adapter), {}, set()
    for index, block in enumerate(blocks):
        first_of_kind.setdefault(_layer_kind(config, index, block), index)
    for index in first_of_kind.values():
        named = [(n, p) for n, p in blocks[index].named_parameters() if p.requires_grad]
        try:
            with experts_batched(model):
                result = call(index)(blocks[index], torch.zeros(1, 8, hidden, device="meta", requires_grad=True))
            result = result[0] if isinstance(result, tuple) else result
            grads = torch.autograd.grad(result.sum(), [p for _, p in named], allow_unused=True)
        except Exception:  # a layer that does not run on meta: nothing is frozen
            continue
        unused = {n for (n, _), g in zip(named, grads) if g is None}
        for other, block in enumerate(blocks):
            if _layer_kind(config, other, block) == _layer_kind(config, index, blocks[index]):
                out.update(f"{adapter.blocks_path}.{other}.{n}" for n in unused)
    return frozenset(out)


WHOLE_STYLES = ("replicate", "replicate_module")
"""plait's styles (plait.models.adapter.STYLES) of modules every tensor rank holds and computes whole."""


def replicated_paths(tp_plan: dict[str, str]) -> tuple[str, ...]:
    """Block-relative paths of the modules a tensor plan keeps whole on every tensor rank (priced as such:
    BlockCost.replicated_*), each with ":Class" where only the layers whose module is of that class replicate it
    (plait.hf.flow.whole_module)."""
    from plait.legality import HF_TP_STYLES, PLAIT_STYLE

    out = []
    for pattern, style in tp_plan.items():
        name, _, owner = HF_TP_STYLES.get(style, style.removeprefix(PLAIT_STYLE)).partition(":")
        if (style.startswith(PLAIT_STYLE) or style in HF_TP_STYLES) and name in WHOLE_STYLES:
            out.append(pattern.split("*.", 1)[-1] + (f":{owner}" if owner else ""))
    return tuple(out)


def measure_blocks(adapter, replicated: tuple[str, ...] = ()) -> tuple[BlockCost, ...]:
    """Each decoder layer of `adapter`'s class measured on meta, called as the class calls it; `replicated`: paths of
    modules tensor parallelism keeps whole (replicated_paths)."""
    model, config = adapter.meta_model, adapter.hf_config()
    blocks = list(get_module(model, adapter.blocks_path))
    hidden = int(config.hidden_size)
    call = block_caller(adapter)
    measured: dict[tuple, BlockCost] = {}
    costs = []
    with experts_batched(model):
        for index, block in enumerate(blocks):
            costs.append(_measure_one(adapter, config, index, block, hidden, call, measured, replicated))
    return tuple(costs)


class LayerInputsFromTokens(Exception):
    """The class's forward cannot run around its layers with only hidden states passed between them."""


def _layer_arguments(*args, **kwargs):
    """What the class passes its layers, found as a pipeline stage finds it: its forward with the modules before the
    layers left out and hidden states handed in. A class whose layers take inputs computed from the token ids
    (Gemma 3n's and Gemma 4's per-layer embeddings) or hand values on to the next layer (GLM-MoE-DSA's top-k
    indices) fails here: plait's stages pass on hidden states only."""
    from plait.hf.structure import around_layers

    try:
        return around_layers(*args, **kwargs)
    except Exception as error:
        raise LayerInputsFromTokens(f"{type(error).__name__}: {str(error).splitlines()[0][:120]}") from error


@contextlib.contextmanager
def experts_batched(model: nn.Module):
    """transformers' experts in their "batched_mm" form while measuring: each token's top-k experts' weights
    gathered and multiplied, which runs on meta (the eager loop over routed experts needs real routing) and counts
    exactly the routed FLOPs."""
    configs = {id(sub.config): sub.config for sub in model.modules()
               if hasattr(sub, "_is_expert_parallel") and hasattr(sub, "config")}
    saved = {key: config._experts_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            config._experts_implementation = "batched_mm"
        yield
    finally:
        for key, config in configs.items():
            config._experts_implementation = saved[key]


def _measure_one(adapter, config, index: int, block: nn.Module, hidden: int, call, measured: dict,
                 replicated: tuple[str, ...] = ()) -> BlockCost:
    """Layer `index` measured, or the measurement of an earlier layer of its kind."""
    from plait.hf.flow import whole_module
    from plait.models.measure import measure_block

    kind = _layer_kind(config, index, block)
    if kind not in measured:
        try:
            whole = tuple(entry.partition(":")[0] for entry in replicated if whole_module(block, entry) is not None)
            measured[kind] = _with_experts(measure_block(block, hidden, call(index), whole), block, config)
        except LayerInputsFromTokens as error:
            raise ConfigError(f"Hugging Face model type {adapter.family!r}: its forward cannot run around its "
                              f"layers ({type(block).__name__}) with only hidden states passed between them "
                              f"({error}): its layers take or hand on more (inputs computed from the token ids, "
                              f"values passed from layer to layer), and plait's stages pass on hidden states only "
                              f"[rule hf-layers-pass-hidden-states]") from None
        except Exception as error:  # a forward that needs real data
            import transformers

            raise ConfigError(f"Hugging Face model type {adapter.family!r}: layer {index} ({type(block).__name__}) "
                              f"cannot run on meta to be measured ({type(error).__name__}: "
                              f"{str(error).splitlines()[0][:120]}) on transformers {transformers.__version__}; "
                              f"a newer transformers may run such a layer "
                              f"on meta (Mixtral's experts call torch.nonzero on 5.17, not on 5.24) "
                              f"[rule hf-layer-measured-on-meta]") from None
    return measured[kind]


def _with_experts(cost: BlockCost, block: nn.Module, config: Any) -> BlockCost:
    """`cost` with the part of it that is the block's routed experts (transformers' experts modules): their
    parameters, and 2 FLOPs per weight of each token's top-k experts -- what the measurement counted for them
    (the batched form runs exactly the routed slots), which the cost model splits over ep and stretches by the
    router's imbalance (plait.cost.compute.expert_flops)."""
    import dataclasses

    from plait.hf.experts import class_experts

    experts = [module for _, module in class_experts(block)]
    if not experts:
        return cost
    params = sum(p.numel() for module in experts for p in module.parameters())
    top_k = int(_first(config, "num_experts_per_tok", "top_k", default=1))
    flops = sum(2.0 * top_k * sum(p.numel() for p in m.parameters()) / m.num_experts for m in experts)
    return dataclasses.replace(cost, expert_params=params, expert_flops_per_token=min(flops, cost.flops_per_token),
                               **_eager_loop_bytes(cost, top_k * len(experts), int(config.hidden_size)))


EAGER_SLOT_BYTES = 16
"""Bytes per routed slot the eager loop keeps besides the batched form's tensors: the slot's token index (int64) and
its routing weight, each gathered per expert (scaled-down Mixtral on CPU, tests/unit/test_class_activations.py)."""


def _eager_loop_bytes(cost: BlockCost, slots: int, hidden: int) -> dict[str, float]:
    """The measured bytes per token corrected from the batched form measured on meta to the eager loop over routed
    experts the run takes (plait.hf.adapter: `_experts_implementation = "eager"`): per slot it also keeps its weighted
    output (h, in the compute dtype; under autocast the batched form kept as much in its own casts) and
    EAGER_SLOT_BYTES."""
    fields = {"activation_bytes_per_token": 4, "half_activation_bytes_per_token": 2,
              "autocast_activation_bytes_per_token": 0}
    return {name: getattr(cost, name) + slots * (hidden * width + EAGER_SLOT_BYTES)
            for name, width in fields.items() if getattr(cost, name)}


def unplaced_modules(blocks: nn.ModuleList, tp_plan: dict[str, str], call=None, hidden: int = 0) -> dict[str, str]:
    """Modules of the blocks holding parameters the tensor-parallel plan places nowhere, each with the style it can
    run under. Inside a MoE block activations are whole, so what the plan leaves there (the router) is kept whole
    (plait.hf.experts.moe_tensor_styles). Elsewhere ({pattern: "plait:replicate" | "plait:sharded_input" |
    UNPLACED}) plait.hf.flow finds which is exact from one forward on meta, with `call` from block_caller;
    an UNPLACED one could see part of its input and keep a partial gradient nobody sums, so legality refuses tp.
    Norms are taken as placed: the block's own ones (over the whole hidden states) get plait's "norm" style, and a
    class's plan marks a norm over sharded heads (replicated_with_grad_allreduce), so an unmarked one reads whole
    (gathered) projections (OLMo 2's q_norm after colwise_gather_output)."""
    from plait.legality import PLAIT_STYLE, UNPLACED
    from plait.hf.experts import MOE_BLOCK, moe_tensor_styles
    from plait.hf.flow import REPLICATE_MODULE, unplaced_styles

    leaf = next((pattern.split(".*.", 1)[0] for pattern in tp_plan if ".*." in pattern), "layers")
    placed = [pattern.split("*.", 1)[-1] for pattern in tp_plan]
    moe = moe_tensor_styles(list(blocks), placed)
    out = {f"{leaf}.*.{path}": PLAIT_STYLE + style for path, style in moe.items()}
    moe_blocks = [path for path, style in moe.items() if style == MOE_BLOCK]
    styles = {path: style for path, style in zip(placed, tp_plan.values())
              if not any(path.startswith(block + ".") for block in moe_blocks)}
    styles.update({path: MOE_BLOCK for path in moe_blocks})  # whole in, whole out: the walk stops there
    found_by_block: list[dict[str, str]] = []
    for index, block in enumerate(blocks):  # layers of one class may differ (hybrids: linear or full attention)
        def run(module: nn.Module, index: int = index):
            with experts_batched(module):
                return call(index)(module, torch.zeros(1, 8, hidden, device="meta", requires_grad=True))

        found = unplaced_styles(block, styles, run if call is not None else _no_run, UNPLACED)
        for path, style in found.items():
            pattern = f"{leaf}.*.{path}"
            mark = style if style == UNPLACED else PLAIT_STYLE + style
            if out.get(pattern, mark) != mark:  # layers disagree: nothing is proven for the pattern
                mark = UNPLACED
            out[pattern] = mark
        found_by_block.append(found)
    for pattern, mark in out.items():
        if mark == PLAIT_STYLE + REPLICATE_MODULE:
            out[pattern] = _replicated_in_every_layer(pattern.split(".*.", 1)[-1], blocks, found_by_block, styles)
    return out


def _replicated_in_every_layer(path: str, blocks, found_by_block: list[dict[str, str]], styles: dict[str, str]) -> str:
    """The mark of a root some layers replicate (REPLICATE_MODULE) for every layer: plain where every other layer's
    module at `path` is a norm (it runs whole there too: AXK2's first layer); "replicate_module:Class" where the
    replicated layers' modules are all of one class that holds nothing the plan places, and every other layer's is
    of another class the plan places inside (a hybrid's full attention: MiniMax), which keeps its own styles;
    UNPLACED otherwise."""
    from plait.legality import PLAIT_STYLE, UNPLACED
    from plait.hf.flow import REPLICATE_MODULE

    def placed_inside(block: nn.Module) -> bool:
        return any(p.startswith(path + ".") and get_module(block, p) is not None for p in styles)

    layers = [(block, found.get(path) == REPLICATE_MODULE) for block, found in zip(blocks, found_by_block)
              if get_module(block, path) is not None]
    others = [block for block, replicated in layers if not replicated]
    if all(is_norm_module(get_module(block, path)) for block in others):
        return PLAIT_STYLE + REPLICATE_MODULE
    whole = {type(get_module(block, path)).__name__ for block, replicated in layers if replicated}
    if len(whole) == 1 and not any(placed_inside(block) for block, replicated in layers if replicated) \
            and all(placed_inside(block) and type(get_module(block, path)).__name__ not in whole for block in others):
        return f"{PLAIT_STYLE}{REPLICATE_MODULE}:{whole.pop()}"
    return UNPLACED


def _no_run(module: nn.Module):
    raise RuntimeError("no forward to read the data flow from")


def expert_plan_of(config: Any, blocks: nn.ModuleList) -> dict[str, str]:
    """The block entries of a class's expert-parallel plan ("layers.*.mlp.experts" -> "ep_dispatch_experts"); a
    dispatch onto a module that is no transformers experts module (plait.hf.experts) is written as that
    reason, which legality refuses."""
    from plait.hf.experts import is_class_experts

    plan = {k: v for k, v in (getattr(config, "base_model_ep_plan", None) or {}).items() if ".*." in k}
    for pattern, style in plan.items():
        path = pattern.split(".*.", 1)[1]
        if style == "ep_dispatch_experts" and not any(is_class_experts(m) for b in blocks
                                                      if (m := get_module(b, path)) is not None):
            plan[pattern] = "ep_dispatch_experts onto no transformers experts module"
    return plan


def derived_plan(adapter, fields: dict[str, Any]) -> dict[str, str]:
    """The tensor plan plait derives for a class that declares none (plait.hf.tensor_plan), or the one entry
    NO_TENSOR_PLAN saying why there is none, which legality names when tp > 1 is asked for. `fields`: the model's
    shapes (ModelSpec fields)."""
    from plait.hf.tensor_plan import Heads, derived_tensor_plan

    try:
        plan, why = derived_tensor_plan(adapter, Heads.of(fields))
    except Exception as e:  # a layer plait cannot take apart: no tensor plan, and every other plan still runs
        plan, why = {}, f"its layers could not be read ({type(e).__name__})"
    return plan if plan else {NO_TENSOR_PLAN: why}


def hf_model_spec(directory: str | Path, *, name: str, closed_form: dict[str, Any] | None = None) -> ModelSpec:
    """The ModelSpec of the Hugging Face model in `directory` (config.json), its blocks measured on meta.

    `closed_form`: ModelSpec fields from the cost model's formulas for this family (shapes and features), used
    instead of the generic reading of the config where given."""
    from plait.hf.adapter import HFAdapter, tensor_plan_of

    source = "hf:" + str(Path(directory).resolve())
    # the adapter reads only the source of its spec until it runs
    probe = HFAdapter(ModelSpec(name=name, source=source, num_layers=1, hidden_size=1, num_heads=1, vocab_size=1))
    config = probe.hf_config()
    structure, model = probe.structure, probe.meta_model
    fields = closed_form or config_fields(config, structure, model)
    aliases = {alias for alias, _ in structure.tied}

    def params_of(paths: tuple[str, ...]) -> int:
        return sum(p.numel() for n, p in model.named_parameters(remove_duplicate=False)
                   if n not in aliases and any(n.startswith(path + ".") for path in paths))

    tp_plan = tensor_plan_of(config) or derived_plan(probe, fields)
    layers = get_module(model, structure.blocks_path)
    if tp_plan and NO_TENSOR_PLAN not in tp_plan:
        from plait.hf.tensor_plan import DERIVED_STYLES

        flow_styles = {k: v.removeprefix(PLAIT_STYLE) if v in DERIVED_STYLES else v for k, v in tp_plan.items()}
        tp_plan.update(unplaced_modules(layers, flow_styles, block_caller(probe), int(config.hidden_size)))
    blocks = measure_blocks(probe, replicated_paths(tp_plan))
    try:
        return ModelSpec(**{**fields, "name": name, "source": source, "blocks": blocks,
                            "pre_params": params_of(structure.pre), "post_params": params_of(structure.post),
                            "tp_plan": tp_plan, "ep_plan": expert_plan_of(config, layers)})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{directory}/config.json: {e}") from None
