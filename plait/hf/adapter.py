"""The Hugging Face adapter: any transformers causal LM, run unchanged (ModelSpec.source = "hf:<model dir>").

No family is written here. From the class (plait.hf.structure): the decoder layers (named by its
``base_model_pp_plan``, or its one ModuleList of identical blocks), the modules before and after them, tied
parameters, norms; each pipeline stage runs the class's own forward around its layers (so embedding scales,
learned positions, rotary tables, soft-capped logits are the class's); the tensor-parallel plan is its
``base_model_tp_plan`` (norms and sequence-parallel gathers added from the module tree), translated style by
style (TP_STYLES); GPT-2, which declares none, has plait's written as data (WRITTEN_TP_PLANS).

What plait changes when it builds a model, and why:

* dropout off (every ``*dropout*`` / ``*_pdrop`` config value, every nn.Dropout): a parallel run then computes
  exactly what one process does, and the cost model has no dropout term;
* attention runs through ``"plait_sdpa"``, transformers' own SDPA function registered under a name of
  plait's, so that selective recompute of the math path can checkpoint exactly the attention core, the
  math path (ModelSpec.attention = "math") runs SDPA's MATH backend, and context parallelism can
  exchange keys and values. transformers' SDPA mask function is registered under that name too, so the class
  builds the masks it declares, layer by layer: none where attention is plain causal (SDPA's causal path), its
  sliding window on the layers that slide (Mistral, Starcoder2, Qwen2's window layers, Gemma 2/3's local ones),
  and the block-diagonal mask of packed documents that transformers reads from position ids restarting at 0.
  A window far shorter than the sequence is computed band by band, packed documents each on its own
  (plait.models.windows: only the scores the mask keeps); context parallelism's attention applies the window and
  the documents itself (plait/execute/context.py). A class whose layers
  read the mask themselves gets a 4-D causal one (HFAdapter.needs_causal_mask);
* parameters a text-only forward never reaches (a multimodal class's encoders) are frozen
  (HFAdapter.untrained_parameters);
* after `to_empty`, every buffer is copied from the class's own construction with parameters on meta (they
  hold garbage otherwise; the loss then differs by ~1e-4).
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from plait.errors import ConfigError
from plait.legality import HF_TP_STYLES, PLAIT_STYLE, under_class_experts, under_replicated_modules
from plait.models.adapter import ModelAdapter, StageContext, TensorPlan, get_module, is_norm_module, register
from plait.hf.experts import moe_tensor_styles
from plait.hf.flow import whole_module
from plait.hf.structure import (Structure, around_layers, causal_mask, discover, reference_buffers,
                                      untrained_parameters)
from plait.models.windows import (attention_by_document, banded_attention, layer_window, runs_banded,
                                  runs_by_document)

ATTENTION = "plait_sdpa"
EAGER = "plait_eager"
UNMASKED = {ATTENTION: "plait_sdpa_unmasked", EAGER: "plait_eager_unmasked"}
"""The same attentions without the class's masks (plain causal): what a forward on `meta` runs, where the class's
mask building reads values (transformers' packed-document detection) that meta tensors do not have."""


def model_dir(source: str) -> Path:
    path = Path(source.removeprefix("hf:")).expanduser()
    return path.parent if path.name == "config.json" else path


def read_config(source: str) -> dict[str, Any]:
    config = model_dir(source) / "config.json"
    if not config.is_file():
        raise ConfigError(f"Hugging Face model {source!r}: {config} does not exist; give a model directory "
                          f"holding config.json")
    return json.loads(config.read_text())


@functools.lru_cache(maxsize=1)
def _register_attention() -> None:
    """transformers' SDPA attention under plait's name; checkpointed where a module asks for it."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import checkpoint

    def attend(module: nn.Module, query, key, value, attention_mask, **kwargs):
        window = layer_window(module, kwargs)
        if runs_banded(query, key, attention_mask, window, kwargs):  # a window far shorter than the sequence
            def run():
                return banded_attention(query, key, value, attention_mask, window, kwargs.get("scaling")), None
        elif runs_by_document(query, key, attention_mask, window, kwargs):  # packed documents, each on its own
            def run():
                return attention_by_document(query, key, value, kwargs["position_ids"], kwargs.get("scaling")), None
        else:
            def run():
                return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if getattr(module, "plait_math", False):  # ModelSpec.attention = "math": SDPA's unfused backend
            with sdpa_kernel(SDPBackend.MATH):
                return run()
        return run()

    def plait_sdpa(module: nn.Module, query, key, value, attention_mask, **kwargs):
        core = getattr(module, "plait_attention", None)
        if core is None:
            fn, args = functools.partial(attend, **kwargs), (module, query, key, value, attention_mask)
        else:  # context parallelism: plait's core exchanges keys and values ([b, heads, s, d]; HF wants [b, s, h, d])
            window = layer_window(module, kwargs)  # the layer's sliding window (None: the whole sequence)

            def fn(q, k, v):
                return core(q, k, v, scale=kwargs.get("scaling"), window=window,
                            positions=kwargs.get("position_ids")).transpose(1, 2).contiguous(), None
            args = (query, key, value)
        if getattr(module, "plait_recompute", False):
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def plait_eager(module: nn.Module, query, key, value, attention_mask, **kwargs):
        """The class's own eager attention (its module's eager_attention_forward: soft-capping and all), under the
        masks the class builds (boolean, or None where plain causal), as the additive mask that code expects."""
        import sys

        if getattr(module, "plait_attention", None) is not None:  # never attend to local keys only in silence
            raise NotImplementedError(f"{type(module).__name__} runs its class's own eager attention, which context "
                                      f"parallelism cannot swap; use cp=1")
        if attention_mask is None:  # plain causal: the mask function skipped it, as it does for SDPA
            q_len, k_len = query.shape[-2], key.shape[-2]
            attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
        if attention_mask.dtype == torch.bool:  # the class's eager code adds its mask to the scores
            attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min)
            attention_mask = attention_mask if attention_mask.dim() == 4 else attention_mask[None, None]
        own = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
        fn = functools.partial(own, **kwargs)
        if getattr(module, "plait_recompute", False):
            return checkpoint(fn, module, query, key, value, attention_mask, use_reentrant=False)
        return fn(module, query, key, value, attention_mask)

    AttentionInterface.register(ATTENTION, plait_sdpa)
    AttentionInterface.register(EAGER, plait_eager)
    AttentionInterface.register(UNMASKED[ATTENTION], plait_sdpa)  # no mask function: the class builds none
    AttentionInterface.register(UNMASKED[EAGER], plait_eager)
    # the masks the class declares (windows, packed documents), as boolean masks or None where plain causal
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    AttentionMaskInterface.register(EAGER, sdpa_mask)


@contextlib.contextmanager
def _unmasked(model: nn.Module) -> Iterator[None]:
    """`model` runs plait's attention without the class's masks (UNMASKED) while in the block."""
    used = model.config._attn_implementation
    if used not in UNMASKED:
        yield
        return
    model.set_attn_implementation(UNMASKED[used])
    try:
        yield
    finally:
        model.set_attn_implementation(used)


WRITTEN_TP_PLANS: dict[str, dict[str, Any]] = {
    # GPT-2 declares no tensor-parallel plan; plait's, as data (plait's style names; norms and sequence-parallel
    # gathers are added as for any class). Its attention splits the fused q|k|v output by split_size (the full
    # hidden width): under tp each rank holds q, k and v slices hidden/tp wide.
    "gpt2": {"block": {"attn.c_attn": "colwise_packed:3", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                       "mlp.c_proj": "rowwise"},
             "divided_by_tp": ("attn.split_size",)},
}
TP_STYLES = HF_TP_STYLES  # the rule lives in plait.legality, which refuses other styles before ranks start


def attention_for(config: Any) -> str:
    """plait's SDPA attention, or the class's own "eager" one where the class says SDPA does not compute its
    attention (soft-capped scores: Gemma 2); then selective recompute checkpoints nothing of it and context
    parallelism cannot swap it."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return ATTENTION if getattr(model_class, "_supports_sdpa", True) else EAGER


def tensor_plan_of(config: Any) -> dict[str, str]:
    """The block entries of a class's tensor-parallel plan ("layers.*.self_attn.q_proj" -> "colwise"), or the one
    plait writes for it, as transformers spells its styles."""
    written = WRITTEN_TP_PLANS.get(getattr(config, "model_type", ""))
    if written:
        return {f"*.{k}": PLAIT_STYLE + v for k, v in written["block"].items()}
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    return {k: v for k, v in plan.items() if ".*." in k}


def _no_dropout(config: Any) -> None:
    for key, value in list(vars(config).items()):
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)


class HFAdapter(ModelAdapter):
    """Any transformers causal LM: the layout, the tensor-parallel plan and the buffers come from the class."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.config_dict = read_config(spec.source)
        self.family = self.config_dict.get("model_type") or "?"
        self.init_std = float(self.config_dict.get("initializer_range", 0.02))
        structure = self.structure
        self.blocks_path, self.pre, self.post = structure.blocks_path, structure.pre, structure.post
        self.tied = dict(structure.tied)
        self.residual_outputs = tuple(f"{p.split('*.', 1)[-1]}.weight" for p, s in tensor_plan_of(self.hf_config())
                                      .items() if s.removeprefix(PLAIT_STYLE) == "rowwise")

    # ---- building ------------------------------------------------------------------------
    def hf_config(self):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model_dir(self.spec.source)), local_files_only=True)
        _no_dropout(config)
        config.use_cache = False
        _register_attention()
        config._attn_implementation = attention_for(config)
        # experts as a loop over the routed ones: any dtype (grouped_mm takes no float64), the class's reference
        config._experts_implementation = "eager"
        return config

    def build(self, device: str | torch.device = "meta", freeze_untrained: bool = True) -> nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.device(device):
            config = self.hf_config()
            model = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation,
                                                     experts_implementation="eager", dtype=torch.get_default_dtype())
        for sub in model.modules():
            if isinstance(sub, nn.Dropout):
                sub.p = 0.0
        if freeze_untrained:
            for name, param in model.named_parameters():
                if name in self.untrained_parameters:
                    param.requires_grad_(False)
        if self.spec.attention == "math":
            for sub in self._attention_modules(model):
                sub.plait_math = True
        return model

    @functools.cached_property
    def meta_model(self) -> nn.Module:
        return self.build("meta", freeze_untrained=False)

    @functools.cached_property
    def untrained_parameters(self) -> frozenset[str]:
        """Parameters the loss never reaches (a multimodal class's image and audio encoders in a text-only forward;
        a sparse-attention indexer, whose top-k selection passes no gradient): frozen, as they would get no
        gradient anyway; data parallelism would otherwise wait for their gradients forever."""
        from plait.hf.spec import untrained_block_parameters

        return untrained_parameters(self.meta_model, self.structure) | untrained_block_parameters(self)

    @property
    def structure(self) -> Structure:
        return _structure(self.spec.source, self.spec.attention, _config_stamp(self.spec.source),
                          lambda: discover(self.meta_model, self.hf_config()))

    @functools.cached_property
    def model_class(self) -> type:
        return type(self.meta_model)

    @staticmethod
    def _attention_modules(root: nn.Module) -> list[nn.Module]:
        """The modules that call the registered attention function (transformers' attention layers)."""
        return [sub for sub in root.modules() if hasattr(sub, "is_causal") and hasattr(sub, "config")]

    def reset_buffers(self, module: nn.Module) -> None:
        """Every buffer as the class's own __init__ computes it (rotary tables, embedding scales, masks)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        reference = reference_buffers(f"{self.spec.source}@{_config_stamp(self.spec.source)}",
                                      functools.partial(self.build, "cpu"))
        for name, buffer in list(module.named_buffers()):
            value = reference.get(name.replace("._checkpoint_wrapped_module", ""))
            if value is None:
                continue
            owner_path, _, leaf = name.rpartition(".")
            owner = get_module(module, owner_path) if owner_path else module
            if isinstance(buffer, DTensor):
                value = distribute_tensor(value.to(buffer.dtype), buffer.device_mesh, buffer.placements)
            else:
                value = value.to(device=buffer.device, dtype=buffer.dtype)
            owner._buffers[leaf] = value

    # ---- one stage: the class's own forward around the layers -----------------------------
    def _around(self, stage: nn.Module, ctx: StageContext, **kwargs):
        return around_layers(self.model_class, stage, blocks_path=self.blocks_path, num_layers=self.num_layers,
                             pre=self.pre, positions=ctx.positions, as_tuple=self.structure.layer_returns_tuple,
                             causal_mask=self.needs_causal_mask, **kwargs)

    @functools.cached_property
    def needs_causal_mask(self) -> bool:
        """Whether the class's layers fail without a mask and run with a 4-D causal one (DeepSeek-V3.2-style sparse
        attention, whose indexer reads the mask itself): then plait hands its forward one. Others get none, and
        attention runs SDPA's causal path."""
        from plait.hf.spec import block_caller, experts_batched

        block = get_module(self.meta_model, self.blocks_path)[0]
        x = torch.zeros(1, 8, int(self.hf_config().hidden_size), device="meta")
        for masked in (False, True):
            try:
                with experts_batched(self.meta_model):
                    block_caller(self, causal_mask=masked)(0)(block, x)
                return masked
            except Exception:
                continue
        return False

    def own_attention(self, model: nn.Module) -> None:
        """transformers' own attention implementation ("sdpa", or "eager" where the class's SDPA does not compute its
        attention) and masks instead of plait's kernels: the reference `plait check` proves them against."""
        model.set_attn_implementation("eager" if attention_for(model.config) == EAGER else "sdpa")

    @functools.cached_property
    def attention_sees_positions(self) -> bool:
        """Whether the class hands its attention function the position ids, which context parallelism's attention
        needs to keep packed documents apart: its first layer run on meta around a stand-in that records them."""
        from plait.hf.spec import block_caller, experts_batched

        seen: list[bool] = []

        class Recorder(nn.Module):
            def forward(self, q, k, v, scale=None, window=None, positions=None):
                seen.append(positions is not None)
                return q

        block = get_module(self.meta_model, self.blocks_path)[0]
        attention = self._attention_modules(block)
        for module in attention:
            module.plait_attention = Recorder()
        try:
            with experts_batched(self.meta_model):
                block_caller(self)(0)(block, torch.zeros(1, 8, int(self.hf_config().hidden_size), device="meta"))
        except Exception:  # a layer that does not run on meta: nothing is proven
            return False
        finally:
            for module in attention:
                del module.plait_attention
        return bool(seen) and all(seen)

    @functools.cached_property
    def num_layers(self) -> int:
        return len(get_module(self.meta_model, self.blocks_path))

    def embed(self, stage: nn.Module, tokens: torch.Tensor, ctx: StageContext) -> torch.Tensor:
        calls, _ = self._around(stage, ctx, tokens=tokens, stop_at=0)
        return calls[0][0]

    def block_kwargs(self, stage: nn.Module, hidden: torch.Tensor, ctx: StageContext) -> dict[str, Any]:
        """What the class passes each layer (rotary tables of the whole sequence, masks, position ids), by layer
        index: found by running its forward around stubs on a stand-in of the full sequence (under sequence
        parallelism `hidden` holds a slice)."""
        full = hidden.new_zeros(hidden.shape[0], ctx.positions.shape[-1], hidden.shape[-1])
        calls, _ = self._around(stage, ctx, hidden=full, stop_at=self.num_layers - 1)
        return {index: (args, kwargs) for index, (_, args, kwargs) in calls.items()}

    def kwargs_of(self, kwargs: dict[str, Any], index: int) -> Any:
        return kwargs[index]

    def run_block(self, block: nn.Module, hidden: torch.Tensor, kwargs: Any) -> torch.Tensor:
        args, kw = kwargs
        out = block(hidden, *args, **kw)
        return out[0] if isinstance(out, tuple) else out

    def head(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        _, out = self._around(stage, stage.ctx, hidden=hidden)
        return out.logits

    @property
    def takes_positions(self) -> bool:
        """Packed documents apart (plait.train.documents): transformers reads position ids restarting at 0 as packed
        sequences and masks each apart; not a class handed its 4-D causal mask, which it takes as it is."""
        return not self.needs_causal_mask

    def forward(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is not None and not self.takes_positions:
            raise ValueError(f"{self.family} reads a 4-D causal mask of its own: it takes no document positions")
        if self.needs_causal_mask:
            return model(input_ids=tokens, attention_mask=causal_mask(tokens.shape[0], tokens.shape[1],
                                                                       tokens.device)).logits
        if tokens.device.type == "meta" and positions is None:
            with _unmasked(model):
                return model(input_ids=tokens).logits
        return model(input_ids=tokens, position_ids=positions).logits

    # ---- parallelism as data -------------------------------------------------------------
    def tp_plan(self) -> TensorPlan:
        config = self.hf_config()
        plan = {**tensor_plan_of(config), **{k: v for k, v in (self.spec.tp_plan or {}).items()
                                             if v.startswith(PLAIT_STYLE)}}  # hf_spec's styles for unplaced modules
        if not plan:
            raise ConfigError(f"{self.family} declares no tensor-parallel plan (base_model_tp_plan); use tp=1")
        blocks_leaf = self.blocks_path.rsplit(".", 1)[-1]
        block: dict[str, str] = {}
        # the experts' own weights: plait/hf/expert_parallel.py; what a replicated module holds runs whole with it
        inside_experts = under_class_experts(plan) | under_replicated_modules(plan)
        for pattern, style in plan.items():
            if pattern in inside_experts:
                continue
            if pattern.startswith("*."):
                block[pattern[2:]] = style.removeprefix(PLAIT_STYLE)
                continue
            if not pattern.startswith(f"{blocks_leaf}.*."):
                continue
            if style.startswith(PLAIT_STYLE):
                block[pattern.removeprefix(f"{blocks_leaf}.*.")] = style.removeprefix(PLAIT_STYLE)
                continue
            if style not in TP_STYLES:
                raise ConfigError(f"{self.family}: tensor-parallel style {style!r} of {pattern} is not supported; "
                                  f"use tp=1")
            block[pattern.removeprefix(f"{blocks_leaf}.*.")] = TP_STYLES[style].format(**vars(config))
        self._local_parameters(block)
        self._mark_key_values(block)
        blocks = list(get_module(self.meta_model, self.blocks_path))
        block.update(moe_tensor_styles(blocks, list(block)))  # the MoE blocks, and what is kept whole in them
        for parent in sorted({name.rsplit(".", 1)[0] for name, s in block.items()
                              if s.startswith("colwise") and "." in name}):
            block.setdefault(parent, "gather_input")
        for name in self._block_norms():
            block.setdefault(name, "norm")
        return TensorPlan(block=block, root=self._root_plan())

    def _local_parameters(self, block_plan: dict[str, str]) -> None:
        """transformers' "local_params" on a module whose bare parameters its plan splits (attention sinks, one per
        head, "colwise"): each such parameter becomes "local_param" (split along its first dim; the module reads
        its rank's slice, as its heads are the rank's), and the module itself keeps its other roles (gathered
        input under sequence parallelism)."""
        owners = [path for path, style in block_plan.items() if style == "local_params"]
        blocks = list(get_module(self.meta_model, self.blocks_path))  # layers may differ (sinks on some only)
        for path, style in list(block_plan.items()):
            if any(isinstance(get_module(block, path), nn.Parameter) for block in blocks):
                owner = path.rpartition(".")[0]
                if owner not in owners or style != "colwise":
                    raise ConfigError(f"{self.family}: its tensor-parallel plan gives parameter {path} style {style!r}"
                                      f" outside a 'local_params' module, which plait does not run; use tp=1")
                block_plan[path] = "local_param"
        for owner in owners:
            del block_plan[owner]

    def _mark_key_values(self, block_plan: dict[str, str]) -> None:
        """Column-wise projections num_kv_heads heads wide (fewer than the query heads) become "colwise_kv", so that
        a tp above num_kv_heads replicates their heads instead of splitting one."""
        heads, kv = self.spec.num_heads, self.spec.num_kv_heads or self.spec.num_heads
        if kv >= heads:
            return
        block = get_module(self.meta_model, self.blocks_path)[0]
        head_dim = self.spec.head_dim or self.spec.hidden_size // heads
        for pattern, style in block_plan.items():
            module = get_module(block, pattern)
            if style == "colwise" and isinstance(module, nn.Linear) and module.out_features == kv * head_dim:
                block_plan[pattern] = f"colwise_kv:{kv}"

    def _root_plan(self) -> dict[str, str]:
        """The modules around the blocks: the token embedding vocabulary-parallel, other embeddings (learned
        positions) replicated, norms after the blocks, the output layer vocabulary-parallel."""
        model, vocab = self.meta_model, self.spec.vocab_size
        root = {}
        for path in self.pre:
            module = get_module(model, path)
            if isinstance(module, nn.Embedding):
                # one that normalizes what it looks up (Inkling's) needs whole rows: a vocabulary-parallel lookup
                # hands its norm partial sums; kept whole, like learned positions
                normalizes = any(True for child in module.children() for _ in child.parameters())
                tied = any(name.startswith(path + ".") for name in self.tied.values())  # shares the output's split
                vocabulary = module.num_embeddings == vocab and not (normalizes and not tied)
                root[path] = "embedding" if vocabulary else "position_embedding"
        for path in self.post:
            module = get_module(model, path)
            if isinstance(module, nn.Linear) and module.out_features == vocab:
                root[path] = "output"
            elif is_norm_module(module):
                root[path] = "final_norm"
        return root

    def after_tensor_parallel(self, block: nn.Module, tp: int) -> None:
        kv = self.spec.num_kv_heads or self.spec.num_heads
        if kv < tp:  # one replicated kv head per rank now serves the rank's heads / tp query heads
            whole = [whole_module(block, entry) for entry in self.replicated_modules]  # these keep every head
            inside = {id(sub) for module in whole if module is not None for sub in module.modules()}
            for attention in self._attention_modules(block):
                if id(attention) in inside:
                    continue
                if hasattr(attention, "num_key_value_groups"):
                    attention.num_key_value_groups = self.spec.num_heads // tp
        if self.derives_tensor_plan:  # the forward reads head counts its rank's projections no longer hold
            from plait.hf.tensor_plan import Heads, divide_head_counts

            divide_head_counts(block, Heads.of(self.spec), tp)
        for path in WRITTEN_TP_PLANS.get(self.family, {}).get("divided_by_tp", ()):
            owner_path, _, attribute = path.rpartition(".")
            owner = get_module(block, owner_path)
            setattr(owner, attribute, getattr(owner, attribute) // tp)

    @functools.cached_property
    def derives_tensor_plan(self) -> bool:
        """Whether tensor parallelism runs the plan plait derived from the class's layers (it declares none)."""
        from plait.hf.tensor_plan import DERIVED_STYLES

        return not tensor_plan_of(self.hf_config()) and any(
            style in DERIVED_STYLES for style in (self.spec.tp_plan or {}).values())

    @property
    def replicated_modules(self) -> tuple[str, ...]:
        """Block-relative entries ("path" or "path:Class") of the modules run whole on every tensor rank
        (plait.hf.flow's replicate_module)."""
        mark = PLAIT_STYLE + "replicate_module"  # or mark:Class (plait.hf.flow.whole_module)
        return tuple(pattern.split("*.", 1)[-1] + style.removeprefix(mark)
                     for pattern, style in (self.spec.tp_plan or {}).items() if style.startswith(mark))

    @functools.cached_property
    def _norm_names(self) -> tuple[str, ...]:
        """The norms among the blocks' children, every layer's (a hybrid's attention layers hold norms its
        linear-attention layers do not: OLMo-Hybrid's post_feedforward_layernorm)."""
        blocks = get_module(self.meta_model, self.blocks_path)
        return tuple(dict.fromkeys(name for block in blocks for name, child in block.named_children()
                                   if is_norm_module(child)))

    def _block_norms(self) -> tuple[str, ...]:
        return self._norm_names

    def set_attention(self, block: nn.Module, core: nn.Module) -> None:
        for attention in self._attention_modules(block):
            attention.plait_attention = core

    def selective(self, block: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> int:
        """The attention core (transformers' SDPA call), through plait's registered attention function."""
        marked = self._attention_modules(block)
        for sub in marked:
            sub.plait_recompute = True
        return len(marked)

    # ---- weights -------------------------------------------------------------------------
    def is_norm(self, name: str) -> bool:
        return self.canonical(name) in self.structure.norm_params

    def initial_tensor(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """GPT-2's scheme (plait.models.adapter), but norms start as the class's own init makes them (ones, or
        zeros where the norm scales by 1 + weight)."""
        name = self.canonical(name)
        if self.is_norm(name):
            return self._norm_initial(name).reshape(shape).clone()
        return super().initial_tensor(name, shape, seed)

    def _norm_initial(self, name: str) -> torch.Tensor:
        import copy

        owner_path, _, leaf = name.rpartition(".")
        module = copy.deepcopy(get_module(self.meta_model, owner_path)).to_empty(device="cpu")
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # a class whose init draws a norm's values draws the same ones on every rank
            for param in module.parameters(recurse=False):
                param.fill_(float("nan"))
            self.meta_model._init_weights(module)
        value = getattr(module, leaf).detach()
        if torch.isnan(value).any():
            return torch.ones_like(value) if leaf == "weight" else torch.zeros_like(value)
        return value


def _config_stamp(source: str) -> float:
    return (model_dir(source) / "config.json").stat().st_mtime


@functools.lru_cache(maxsize=16)
def _structure_cached(source: str, attention: str, stamp: float) -> list:
    return []


def _structure(source: str, attention: str, stamp: float, find) -> Structure:
    """One discovery per model directory and config.json version (it builds the model on meta)."""
    slot = _structure_cached(source, attention, stamp)
    if not slot:
        slot.append(find())
    return slot[0]


def hf_adapter(spec) -> HFAdapter:
    return HFAdapter(spec)


register("hf", hf_adapter)
