"""nn.EmbeddingBag as a lookup and a pooling: torch 2.13's DTensor has no rule for embedding_bag (a plan could only
keep its table whole and run it replicated), and plait's fused row-wise optimizers train lookups. A bag of fixed
size (a 2-D input of ids, mode "sum" or "mean", per-sample weights or none, no padding index or max norm) computes
the same as nn.Embedding's lookup then a sum or mean over each bag; `PooledEmbedding` is that, with the bag's own
weight (the same parameter, under the same name): the per-operator planner prices the lookup (row-, column-,
table-wise, replicated) and the pooling as it does any lookup, and every side of a run (the plan's capture, its ranks,
`plait check`'s one process) builds the module the same way (plait.models.factory.build_factory_module). Bags given
as a flat input with offsets, mode "max", a padding index or a max norm stay nn.EmbeddingBag: replicated, and named
among the operators without a rule."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PooledEmbedding(nn.Embedding):
    """An nn.EmbeddingBag of fixed-size bags as a lookup (`lookup`, which a fused table's optimizer replaces) and
    its pooling; see the module docstring."""

    mode: str = "sum"

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if offsets is not None or ids.dim() != 2:
            raise ValueError(f"{type(self).__name__}: bags as a 2-D tensor of ids only (got {ids.dim()}-D"
                             f"{' with offsets' if offsets is not None else ''})")
        rows = self.lookup(ids)
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.unsqueeze(-1)
        return rows.sum(dim=1) if self.mode == "sum" else rows.mean(dim=1)


def poolable(bag: nn.EmbeddingBag) -> bool:
    return (type(bag) is nn.EmbeddingBag and bag.mode in ("sum", "mean") and bag.padding_idx is None
            and bag.max_norm is None and not bag.scale_grad_by_freq and not bag.sparse)


def pool_embedding_bags(model: nn.Module) -> nn.Module:
    """Every poolable nn.EmbeddingBag of `model` replaced by a PooledEmbedding holding its weight (in place)."""
    for name, module in list(model.named_modules()):
        for leaf, child in list(module.named_children()):
            if isinstance(child, nn.EmbeddingBag) and poolable(child):
                pooled = PooledEmbedding.__new__(PooledEmbedding)
                nn.Module.__init__(pooled)
                pooled.num_embeddings, pooled.embedding_dim = child.num_embeddings, child.embedding_dim
                pooled.padding_idx, pooled.max_norm, pooled.norm_type = None, None, child.norm_type
                pooled.scale_grad_by_freq, pooled.sparse, pooled.mode = False, False, child.mode
                pooled.weight = child.weight
                setattr(module, leaf, pooled)
    return model
