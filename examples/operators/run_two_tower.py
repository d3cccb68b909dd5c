"""A two-tower retrieval model, as a new user brings one: a 200,003-row user table (a row count no degree divides),
an item table read twice (the user's history and the candidate items), nn.MultiheadAttention over the history, a
0-d logit scale (CLIP's), and an in-batch softmax: each user's positive item against the other items of the same
call, so the loss is not a mean over samples (under data parallelism and micro-batches its negatives are the
samples of one call: `plait plan` and `plait check` say so and compare like with like).

    build() -> the issue's size (a 200,003 x 32 user table); build_small() -> 2,003 rows, for tests.
    batch(batch_size, generator) -> {"users": [b], "history": [b, 4], "items": [b]}: a dict, the forward's
    keyword arguments.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

USERS, ITEMS, DIM, HISTORY = 200_003, 65_536, 32, 4
SMALL_USERS, SMALL_ITEMS = 2_003, 1_024


class TwoTower(nn.Module):
    def __init__(self, users: int = USERS, items: int = ITEMS, dim: int = DIM, heads: int = 4) -> None:
        super().__init__()
        self.user_table = nn.Embedding(users, dim)
        self.item_table = nn.Embedding(items, dim)
        self.history = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.user_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
        self.item_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, users: torch.Tensor, history: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        user = self.user_table(users)                                   # [b, d]
        seen = self.item_table(history)                                 # [b, h, d]: the item table's first read
        context, _ = self.history(user.unsqueeze(1), seen, seen)        # [b, 1, d]
        user = F.normalize(self.user_mlp(user + context.squeeze(1)), dim=-1)
        item = F.normalize(self.item_mlp(self.item_table(items)), dim=-1)  # its second read
        logits = self.logit_scale.exp() * user @ item.T                 # [b, b]: in-batch negatives
        return F.cross_entropy(logits, torch.arange(users.shape[0]))    # made on the default device


def build() -> nn.Module:
    return TwoTower()


def build_small() -> nn.Module:
    return TwoTower(SMALL_USERS, SMALL_ITEMS)


def batch(batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {"users": torch.randint(0, SMALL_USERS, (batch_size,), generator=generator),
            "history": torch.randint(0, SMALL_ITEMS, (batch_size, HISTORY), generator=generator),
            "items": torch.randint(0, SMALL_ITEMS, (batch_size,), generator=generator)}
