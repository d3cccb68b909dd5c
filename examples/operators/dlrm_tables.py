"""A DLRM with several embedding tables of odd sizes (as a recommender's are: row counts no degree divides, one
table far larger than the rest), pooled lookups (several ids per feature, summed), a bottom MLP over dense features,
pairwise dot products, a top MLP, binary cross-entropy.

The lookups are nn.EmbeddingBag(mode="sum") over each feature's ids: torch 2.13's DTensor has no rule for
embedding_bag, and plait runs a bag of fixed size as a lookup and a sum (plait.models.embedding_bags), which DTensor
splits and plait's fused row-wise optimizers train.

    build() -> the module; forward(dense, sparse, clicks) returns the loss.
    batch(batch_size, generator) -> (dense [b, DENSE], sparse ids [b, len(TABLES), IDS], clicks [b]); the ids of
    table t are drawn from a Zipf-like skew (a few rows hot), as real traffic is.
"""

import torch
import torch.nn.functional as F
from torch import nn

TABLES = (100_003, 25_013, 4_099, 1_009, 97)
"""Rows per table: 12.2 MiB, 3.1 MiB, 0.5 MiB, 0.12 MiB and 12 KiB at DIM 32 in fp32."""
DIM, DENSE, IDS = 32, 13, 4


class DLRMTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, DIM, mode="sum") for rows in TABLES)
        self.bottom = nn.Sequential(nn.Linear(DENSE, 64), nn.ReLU(), nn.Linear(64, DIM))
        features = len(TABLES) + 1
        rows, cols = torch.triu_indices(features, features, offset=1)
        self.register_buffer("pair_index", rows * features + cols, persistent=False)
        self.top = nn.Sequential(nn.Linear(DIM + len(rows), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor, clicks: torch.Tensor) -> torch.Tensor:
        d = self.bottom(dense)                                                  # [b, DIM]
        pooled = [table(sparse[:, t]) for t, table in enumerate(self.tables)]  # each [b, DIM]
        features = torch.stack([d, *pooled], dim=1)                             # [b, T+1, DIM]
        dots = (features @ features.transpose(1, 2)).flatten(1)[:, self.pair_index]
        logits = self.top(torch.cat([d, dots], dim=1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, clicks)


def skewed_ids(rows: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Ids with a Zipf-like skew: id = floor(rows * u^3) for uniform u, so the first rows are drawn most."""
    return (rows * torch.rand(shape, generator=generator) ** 3).long().clamp_(max=rows - 1)


def build() -> nn.Module:
    return DLRMTables()


def batch(batch_size: int, generator: torch.Generator):
    dense = torch.randn(batch_size, DENSE, generator=generator)
    sparse = torch.stack([skewed_ids(rows, (batch_size, IDS), generator) for rows in TABLES], dim=1)
    clicks = torch.randint(0, 2, (batch_size,), generator=generator).float()
    return dense, sparse, clicks
