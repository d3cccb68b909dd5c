"""A small DLRM-style recommender: dense features through a bottom MLP, sparse features looked up in an
embedding table, their pairwise dot products, a top MLP, binary cross-entropy. Its table (4 MiB) is the model's
memory: plan it with a per-device budget the whole table does not fit (README, "Any module"), and the solver
splits it. With `--table-optimizer sgd` the table trains by a fused row-wise SGD (plait.execute.embedding_tables): a rank
holds its share of the weights alone, so on 8 ranks the table is 5.3x a rank's 0.75 MiB budget.

    build() -> the module; forward(dense, sparse, clicks) returns the loss.
    batch(batch_size, generator) -> (dense [b, 16], sparse ids [b, 4], clicks [b]).
"""

import torch
import torch.nn.functional as F
from torch import nn

ROWS, DIM, DENSE, FEATURES = 32768, 32, 16, 4


class DLRM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(ROWS, DIM)
        self.bottom = nn.Sequential(nn.Linear(DENSE, 64), nn.ReLU(), nn.Linear(64, DIM))
        pairs = (FEATURES + 1) * FEATURES // 2
        self.top = nn.Sequential(nn.Linear(DIM + pairs, 64), nn.ReLU(), nn.Linear(64, 1))
        rows, cols = torch.triu_indices(FEATURES + 1, FEATURES + 1, offset=1)
        self.register_buffer("pair_index", rows * (FEATURES + 1) + cols, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor, clicks: torch.Tensor) -> torch.Tensor:
        d = self.bottom(dense)                                                 # [b, DIM]
        e = self.table(sparse)                                                 # [b, FEATURES, DIM]
        features = torch.cat([d.unsqueeze(1), e], dim=1)                       # [b, F+1, DIM]
        dots = (features @ features.transpose(1, 2)).flatten(1)[:, self.pair_index]
        logits = self.top(torch.cat([d, dots], dim=1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, clicks)


def build() -> nn.Module:
    return DLRM()


def batch(batch_size: int, generator: torch.Generator):
    return (torch.randn(batch_size, DENSE, generator=generator),
            torch.randint(0, ROWS, (batch_size, FEATURES), generator=generator),
            torch.randint(0, 2, (batch_size,), generator=generator).float())
