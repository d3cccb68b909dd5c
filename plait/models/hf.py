"""The Hugging Face adapter: causal LMs from transformers, run unchanged (ModelSpec.source = "hf:<model dir>").

Families (model_type): llama, mistral, qwen2, qwen3, gemma (decoder layers under ``model.layers``, rotary
tables computed once per stage by ``model.rotary_emb``) and gpt2 (``transformer.h``, learned positions,
Conv1D projections, tied embeddings). The tensor-parallel plan of the llama-like families is the class's
own ``base_model_tp_plan`` (norms and sequence-parallel gathers added from the module tree); GPT-2 has
none, so it is written here.

What plait changes when it builds a model, and why:

* dropout off (``*_pdrop``, ``attention_dropout`` = 0): a parallel run then computes exactly what one
  process does, and the cost model has no dropout term;
* attention runs through ``"plait_sdpa"``, transformers' own SDPA function registered under a name of
  plait's, so that selective recompute of the math path can checkpoint exactly the attention core, the
  math path (ModelSpec.attention = "math") runs SDPA's MATH backend, and context parallelism can
  exchange keys and values;
* after `to_empty`, the non-persistent buffers (rotary ``inv_freq``, Gemma's embedding scale) are
  computed again from the config (they hold garbage otherwise; the loss then differs by ~1e-4).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from plait.errors import ConfigError
from plait.models.adapter import ModelAdapter, StageContext, TensorPlan, get_module, register

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma")
FAMILIES = LLAMA_LIKE + ("gpt2",)
ATTENTION = "plait_sdpa"
_TP_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": "head_norm",
              "packed_colwise": "colwise_packed:2"}


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
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import checkpoint

    def attend(module: nn.Module, query, key, value, attention_mask, **kwargs):
        if getattr(module, "plait_math", False):  # ModelSpec.attention = "math": SDPA's unfused backend
            with sdpa_kernel(SDPBackend.MATH):
                return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def plait_sdpa(module: nn.Module, query, key, value, attention_mask, **kwargs):
        core = getattr(module, "plait_attention", None)
        if core is None:
            fn, args = functools.partial(attend, **kwargs), (module, query, key, value, attention_mask)
        else:  # context parallelism: plait's core exchanges keys and values ([b, heads, s, d]; HF wants [b, s, h, d])
            def fn(q, k, v):
                return core(q, k, v, scale=kwargs.get("scaling")).transpose(1, 2).contiguous(), None
            args = (query, key, value)
        if getattr(module, "plait_recompute", False):
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    AttentionInterface.register(ATTENTION, plait_sdpa)


class HFAdapter(ModelAdapter):
    """llama, mistral, qwen2, qwen3, gemma: embed_tokens -> layers -> norm -> lm_head."""

    blocks_path = "model.layers"
    pre = ("model.embed_tokens",)
    post = ("model.norm", "lm_head")
    shared = ("model.rotary_emb",)
    residual_outputs = ("self_attn.o_proj.weight", "mlp.down_proj.weight")

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.config_dict = read_config(spec.source)
        self.family = self.config_dict.get("model_type")
        if self.family not in FAMILIES:
            raise ConfigError(f"Hugging Face model_type {self.family!r} is not supported; supported: "
                              f"{', '.join(FAMILIES)}")
        self.init_std = float(self.config_dict.get("initializer_range", 0.02))
        if spec.tied_embeddings:
            self.tied = {"lm_head.weight": self.pre[0] + ".weight"}

    # ---- building ------------------------------------------------------------------------
    def hf_config(self):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model_dir(self.spec.source)), local_files_only=True)
        for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                    "summary_first_dropout"):
            if hasattr(config, key):
                setattr(config, key, 0.0)
        config.use_cache = False
        _register_attention()
        config._attn_implementation = ATTENTION
        return config

    def build(self, device: str | torch.device = "meta") -> nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.device(device):
            model = AutoModelForCausalLM.from_config(self.hf_config(), attn_implementation=ATTENTION,
                                                     dtype=torch.get_default_dtype())
        if self.spec.attention == "math":
            for sub in self._attention_modules(model):
                sub.plait_math = True
        return model

    @staticmethod
    def _attention_modules(root: nn.Module) -> list[nn.Module]:
        """The modules that call the registered attention function (transformers' attention layers)."""
        return [sub for sub in root.modules() if hasattr(sub, "is_causal") and hasattr(sub, "config")]

    def reset_buffers(self, module: nn.Module) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        for sub in module.modules():
            if type(sub).__name__.endswith("RotaryEmbedding"):
                kind = getattr(sub, "rope_type", "default")
                init = sub.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
                device = sub.inv_freq.device
                inv_freq, sub.attention_scaling = init(sub.config, device=device)
                sub.inv_freq = inv_freq.to(device)
                sub.original_inv_freq = inv_freq.clone().to(device)
            if hasattr(sub, "scalar_embed_scale"):  # Gemma's scaled embedding
                sub.embed_scale = torch.tensor(sub.scalar_embed_scale, device=sub.embed_scale.device)

    # ---- one stage -----------------------------------------------------------------------
    def embed(self, stage: nn.Module, tokens: torch.Tensor, ctx: StageContext) -> torch.Tensor:
        return stage.model.embed_tokens(tokens)

    def block_kwargs(self, stage: nn.Module, hidden: torch.Tensor, ctx: StageContext) -> dict[str, Any]:
        position_ids = ctx.positions[None]
        # rotary tables of the whole sequence (global positions), though under SP `hidden` holds a slice
        probe = hidden.new_empty(0) if hidden.is_floating_point() else torch.empty(0)
        return {"position_embeddings": stage.model.rotary_emb(probe, position_ids=position_ids),
                "position_ids": position_ids, "attention_mask": None}

    def head(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return stage.lm_head(stage.model.norm(hidden))

    def forward(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens).logits

    # ---- parallelism as data -------------------------------------------------------------
    def tp_plan(self) -> TensorPlan:
        config = self.hf_config()
        plan = dict(getattr(config, "base_model_tp_plan", None) or {})
        if not plan:
            raise ConfigError(f"{self.family} declares no tensor-parallel plan (base_model_tp_plan); use tp=1")
        block: dict[str, str] = {}
        for pattern, style in plan.items():
            if not pattern.startswith("layers.*."):
                continue
            if style not in _TP_STYLES:
                raise ConfigError(f"{self.family}: tensor-parallel style {style!r} of {pattern} is not supported; "
                                  f"use tp=1")
            block[pattern.removeprefix("layers.*.")] = _TP_STYLES[style]
        for parent in sorted({name.rsplit(".", 1)[0] for name, s in block.items() if s.startswith("colwise")}):
            block.setdefault(parent, "gather_input")
        for name in self._block_norms():
            block.setdefault(name, "norm")
        root = {"model.embed_tokens": "embedding", "model.norm": "final_norm", "lm_head": "output"}
        return TensorPlan(block=block, root=root)

    @functools.cached_property
    def _norm_names(self) -> tuple[str, ...]:
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            config = self.hf_config()
            config.num_hidden_layers = 1
            model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION)
        block = get_module(model, self.blocks_path)[0]
        return tuple(name for name, child in block.named_children() if type(child).__name__.endswith("Norm"))

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

    def is_norm(self, name: str) -> bool:
        return name.rsplit(".", 2)[-2].endswith(("norm", "layernorm")) if "." in name else False

    def initial_tensor(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        if self.family == "gemma" and self.is_norm(self.canonical(name)):
            return torch.zeros(shape)  # Gemma's RMSNorm scales by (1 + weight)
        return super().initial_tensor(name, shape, seed)


class GPT2Adapter(HFAdapter):
    """GPT-2: wte + wpe -> h -> ln_f -> lm_head (tied to wte); Conv1D projections, fused q|k|v."""

    blocks_path = "transformer.h"
    pre = ("transformer.wte", "transformer.wpe", "transformer.drop")
    post = ("transformer.ln_f", "lm_head")
    shared = ()
    residual_outputs = ("attn.c_proj.weight", "mlp.c_proj.weight")

    def embed(self, stage: nn.Module, tokens: torch.Tensor, ctx: StageContext) -> torch.Tensor:
        t = stage.transformer
        return t.drop(t.wte(tokens) + t.wpe(ctx.positions[None]))

    def block_kwargs(self, stage: nn.Module, hidden: torch.Tensor, ctx: StageContext) -> dict[str, Any]:
        return {"attention_mask": None}

    def head(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return stage.lm_head(stage.transformer.ln_f(hidden))

    def tp_plan(self) -> TensorPlan:
        block = {"ln_1": "norm", "attn": "gather_input", "attn.c_attn": "colwise_packed:3", "attn.c_proj": "rowwise",
                 "ln_2": "norm", "mlp": "gather_input", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}
        root = {"transformer.wte": "embedding", "transformer.wpe": "position_embedding",
                "transformer.ln_f": "final_norm", "lm_head": "output"}
        return TensorPlan(block=block, root=root)

    def after_tensor_parallel(self, block: nn.Module, tp: int) -> None:
        # GPT2Attention splits its fused projection's output by split_size = the full hidden size; each
        # tensor rank holds its q, k and v slices side by side, hidden/tp wide each.
        block.attn.split_size = block.attn.embed_dim // tp

    def is_norm(self, name: str) -> bool:
        return ".ln_" in f".{name}"


def hf_adapter(spec) -> HFAdapter:
    family = read_config(spec.source).get("model_type")
    return GPT2Adapter(spec) if family == "gpt2" else HFAdapter(spec)


register("hf", hf_adapter)
