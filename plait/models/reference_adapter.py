"""The adapter of plait's reference decoders (plait.models.reference): ModelSpec.source = "plait"."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from plait.models.adapter import ModelAdapter, StageContext, TensorPlan, register
from plait.models.reference import Transformer, rope_tables


class ReferenceAdapter(ModelAdapter):
    blocks_path = "layers"
    pre = ("tok_embeddings", "pos_embeddings")
    post = ("norm", "output")
    residual_outputs = ("attention.wo.weight", "feed_forward.w2.weight", "experts.w2")

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.tied = {"output.weight": "tok_embeddings.weight"} if spec.tied_embeddings else {}

    def build(self, device: str | torch.device = "meta") -> nn.Module:
        with torch.device(device):
            return Transformer(self.spec)

    def embed(self, stage: nn.Module, tokens: torch.Tensor, ctx: StageContext) -> torch.Tensor:
        hidden = stage.tok_embeddings(tokens)
        positions = getattr(stage, "pos_embeddings", None)  # None: a model without learned positions
        if positions is not None:
            hidden = hidden + positions(ctx.positions[None])  # [b, s, h] + [1, s, h]
        return hidden

    def block_kwargs(self, stage: nn.Module, hidden: torch.Tensor, ctx: StageContext) -> dict[str, Any]:
        if self.spec.positions != "rope":
            return {}
        return {"rope": rope_tables(ctx.positions, self.spec.head_dim, self.spec.rope_theta)}

    def head(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return stage.output(stage.norm(hidden))

    def tp_plan(self) -> TensorPlan:
        block = {
            "attention_norm": "norm",
            "attention": "gather_input",
            "attention.wq": "colwise",
            "attention.wk": "colwise",
            "attention.wv": "colwise",
            "attention.wo": "rowwise",
            "ffn_norm": "norm",
            "feed_forward": "gather_input",
            "feed_forward.w1": "colwise",
            "feed_forward.w2": "rowwise",
            "feed_forward.w3": "colwise",
        }
        if self.spec.qk_norm:
            block.update({"attention.q_norm": "head_norm", "attention.k_norm": "head_norm"})
        if self.spec.num_experts:  # the experts themselves are split by plait/execute/expert.py
            block["feed_forward.router"] = "replicate"
            for name in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
                block.pop(name)
        root = {"tok_embeddings": "embedding", "pos_embeddings": "position_embedding", "norm": "final_norm",
                "output": "output"}
        return TensorPlan(block=block, root=root)

    def set_attention(self, block: nn.Module, core: nn.Module) -> None:
        block.attention.core = core

    def selective(self, block: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> int:
        """The attention core, softmax(q·kᵀ)·v (Korthikanti et al. 2022, section 4.2)."""
        block.attention.core = wrap(block.attention.core)
        return 1


register("plait", ReferenceAdapter)
