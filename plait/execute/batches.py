"""Which rows of the global batch each rank trains on, and the synthetic batches `check` uses (random tokens; with
`chat`, targets masked as chat training masks its prompts).

Data-parallel rank r takes rows r·local:(r+1)·local of the global batch (local =
micro_batch · num_micro_batches); ranks of one tensor group and of one pipeline take the
same rows (only the first and last pipeline stages read them)."""

from __future__ import annotations

import torch

from plait.models.adapter import IGNORE_INDEX
from plait.plan import Plan


def dp_shard(plan: Plan, global_rows: torch.Tensor, dp_rank: int) -> torch.Tensor:
    """This dp rank's rows of a [global_batch, ...] tensor."""
    local = plan.micro_batch * plan.num_micro_batches
    if global_rows.shape[0] != local * plan.dp:
        raise ValueError(f"batch has {global_rows.shape[0]} rows, the plan's global batch is {local * plan.dp}")
    return global_rows[dp_rank * local:(dp_rank + 1) * local]


def batch_for_step(plan: Plan, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (tokens, targets) of shape [global_batch, seq_len] for one step, the same on every
    rank and process: the next-token targets of a random token stream."""
    generator = torch.Generator().manual_seed(seed * 7919 + step + 1)
    stream = torch.randint(0, plan.model.vocab_size, (plan.train.global_batch, plan.train.seq_len + 1),
                           generator=generator)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def chat_batch_for_step(plan: Plan, seed: int, step: int, documents: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`batch_for_step` with its targets masked as chat training masks them (plait.train.chat): each row alternates
    untrained prompt spans and trained answer spans of random lengths, so rows, and the micro-batches and ranks
    holding them, train very different numbers of tokens; the last row is all prompt (no trained target at all).
    With `documents`, rows hold packed conversations too: the third element gives each token's position in its
    conversation (plait.train.documents), else it is None."""
    tokens, targets = batch_for_step(plan, seed, step)
    generator = torch.Generator().manual_seed(seed * 7919 + step + 104729)
    positions = packed_positions(targets.shape, generator) if documents else None
    rows, length = targets.shape
    trained = torch.zeros(rows, length, dtype=torch.bool)
    for row in range(rows - 1 if rows > 1 else rows):
        position, answer = 0, False
        while position < length:
            span = int(torch.randint(1, max(2, length // 2), (1,), generator=generator))
            trained[row, position:position + span] = answer
            position, answer = position + span, not answer
        if not trained[row].any():  # every row but the last trains something
            trained[row, -1] = True
    return tokens, targets.masked_fill(~trained, IGNORE_INDEX), positions


def packed_positions(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """Position ids [rows, seq] of rows packing one to three documents each (cut at random places): 0 where a
    document begins, counting up within it."""
    rows, length = shape
    positions = torch.empty(rows, length, dtype=torch.long)
    for row in range(rows):
        cuts = sorted(set(torch.randint(1, length, (int(torch.randint(0, 3, (1,), generator=generator)),),
                                        generator=generator).tolist()))
        starts = [0, *cuts]
        for start, end in zip(starts, [*cuts, length]):
            positions[row, start:end] = torch.arange(end - start)
    return positions
