"""A two-tower retrieval model (a dual encoder, as CLIP trains its image and text towers): a user tower over a user
table and the user's history of items (attention over it), an item tower over the item table (read a second time),
a learned temperature held as a scalar parameter (CLIP's logit_scale), and the in-batch softmax loss: each user's
positive item against the other users' items in the batch.

    build() -> the module; forward(users, history, items) returns the loss.
    batch(batch_size, generator) -> (user ids [b], history item ids [b, HISTORY], positive item ids [b]).

The tables have row counts no tensor-parallel degree divides (200,003 and 131,071 rows, as real tables do): a row
split gives the first ranks one row more. The item table is 16 MiB in fp32. Under data parallelism the in-batch
softmax sees each rank's share of the batch: fewer negatives per rank than one process, so the loss is not a mean
over samples of the same thing (the plan says so; `plait check` compares like with like).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

USERS, ITEMS, DIM, HISTORY, HEADS = 200_003, 131_071, 32, 8, 4


class DualEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user_table = nn.Embedding(USERS, DIM)
        self.item_table = nn.Embedding(ITEMS, DIM)
        self.history = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.user_tower = nn.Sequential(nn.Linear(2 * DIM, 64), nn.ReLU(), nn.Linear(64, DIM))
        self.item_tower = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, DIM))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, users: torch.Tensor, history: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        seen = self.item_table(history)                                       # [b, HISTORY, DIM]
        attended, _ = self.history(seen, seen, seen, need_weights=False)
        user = self.user_tower(torch.cat([self.user_table(users), attended.mean(dim=1)], dim=1))
        item = self.item_tower(self.item_table(items))                        # the item table's second read
        logits = self.logit_scale.exp() * F.normalize(user, dim=1) @ F.normalize(item, dim=1).T
        return F.cross_entropy(logits, torch.arange(logits.shape[0], device=logits.device))


def build() -> nn.Module:
    return DualEncoder()


def batch(batch_size: int, generator: torch.Generator):
    return (torch.randint(0, USERS, (batch_size,), generator=generator),
            torch.randint(0, ITEMS, (batch_size, HISTORY), generator=generator),
            torch.randint(0, ITEMS, (batch_size,), generator=generator))
