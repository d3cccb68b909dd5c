"""A recommender of four embedding tables of one size (row counts no degree divides), nn.EmbeddingBag summing each
feature's ids (plait.models.embedding_bags runs them as a lookup and a pooling), and a small top MLP: with a budget every rank fits one table of, not all four, the per-operator search places them
table-wise, one a rank (tests of table-wise placement, plait.operators.table_wise)."""

import torch
import torch.nn.functional as F
from torch import nn

TABLES, ROWS, DIM, IDS = 4, 4_001, 64, 3
LARGE_ROWS = 40_001


class EqualTables(nn.Module):
    def __init__(self, rows: int = ROWS) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, DIM, mode="sum") for _ in range(TABLES))
        self.top = nn.Sequential(nn.Linear(TABLES * DIM, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids: torch.Tensor, clicks: torch.Tensor) -> torch.Tensor:
        pooled = [torch.tanh(table(ids[:, t])) for t, table in enumerate(self.tables)]
        return F.binary_cross_entropy_with_logits(self.top(torch.cat(pooled, dim=1)).squeeze(1), clicks)


def build() -> nn.Module:
    return EqualTables()


def build_large() -> nn.Module:
    """Tables of LARGE_ROWS (10 MiB each): gathering one whole costs more than broadcasting its looked-up rows."""
    return EqualTables(LARGE_ROWS)


def batch(batch_size: int, generator: torch.Generator):
    ids = (ROWS * torch.rand(batch_size, TABLES, IDS, generator=generator) ** 2).long()
    return ids, torch.randint(0, 2, (batch_size,), generator=generator).float()
