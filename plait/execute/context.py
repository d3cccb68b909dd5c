"""Context parallelism: each rank of a "cp" group holds a slice of every sequence, and attention sees the others'.

Load balance under a causal mask (Liu et al., Ring Attention; Megatron's and torchtitan's layout): the sequence is
cut into 2·cp chunks and rank r holds chunks r and 2·cp - 1 - r, so every rank has as many early tokens (little
to attend to) as late ones. Each rank's tokens keep their global positions (rotary tables, learned positions,
the causal mask), and its loss is the mean over its tokens: the data-parallel reduction over the flattened
(dp, cp) ranks then averages the gradients exactly as one process would over the whole sequence.

Two ways to see the other ranks' keys and values, chosen by the cost model (plait.cost), both proven equal to
one process:

* "all_gather": all-gather K and V along the sequence (autograd: the backward reduce-scatters their gradients)
  and attend with a causal mask on global positions. Ring attention's arithmetic without its pipelining of the
  gather behind compute (Llama 3's choice; on CPU processes sharing cores there is no engine to overlap with).
  Traffic per layer: the K and V of the whole sequence, (cp - 1)/cp of it per rank.
* "all_to_all": DeepSpeed-Ulysses. Four all-to-alls (q, k, v, and the output back) swap the sequence split for a
  head split: each rank then attends over the whole sequence for heads/cp of the heads. Traffic per layer: q, k,
  v and the output of the local tokens, (cp - 1)/cp of it; needs the local heads divisible by cp.

Packed documents (plait.train.documents) stay apart: the class hands its attention each token's position in its
document, which restarts at 0 where a document begins; the ranks all-gather these few integers, number the
documents along the whole sequence, and a key is seen only from its own document (both kinds).

A layer that attends within a sliding window (its class passes ``sliding_window``: Mistral, Starcoder2, Gemma's
local layers) keeps a key only where query position - key position < window, on global positions, in both kinds:
the same keys the class's own mask keeps on one process.

torch's own `context_parallel` (ring attention through SDPA) has no CPU kernel for causal attention in torch 2.13,
so plait's attention exchanges keys and values itself on every device.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from plait.torch_internals import all_gather_single_autograd, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

KINDS = ("all_gather", "all_to_all")


def cp_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens context rank `rank` holds: chunks r and 2·cp - 1 - r of 2·cp."""
    if cp == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


class ContextParallelAttention(nn.Module):
    """Causal softmax(q·kᵀ·scale)·v over [batch, heads, local seq, head_dim] slices whose global positions are
    `positions` on this rank; the other ranks of `cp_mesh` hold the rest of each sequence."""

    def __init__(self, cp_mesh: DeviceMesh, seq_len: int, kind: str = "all_gather") -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"context-parallel kind {kind!r} is not one of {', '.join(KINDS)}")
        self.kind, self.mesh = kind, cp_mesh
        self.positions, self.gathered_positions, self.to_global, self.to_ranks = _tables(
            seq_len, cp_mesh.size(), cp_mesh.get_local_rank())
        self.documents = False
        """Whether this step's rows hold packed documents to keep apart (set by the executor for the whole step)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                window: int | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`window`: the layer's sliding window (None: causal over the whole sequence); `positions` [b, local seq]:
        each local token's position in its document, where the step holds packed documents."""
        documents = self._document_ids(positions) if self.documents else None
        if self.kind == "all_gather":
            return self._all_gather(q, k, v, scale, window, documents)
        return self._all_to_all(q, k, v, scale, window, documents)

    def _document_ids(self, positions: torch.Tensor | None) -> torch.Tensor:
        """[b, s] the number of each token's document along the whole sequence (sequence order)."""
        from plait.torch_internals import all_gather_tensor

        if positions is None:
            raise RuntimeError("this model's attention is not handed its tokens' positions, so context parallelism "
                               "cannot keep packed documents apart: use data.packing = \"padded\" or \"stream\", "
                               "or cp=1")
        positions = positions.expand(-1, len(self.positions)) if positions.shape[-1] == 1 else positions
        gathered = all_gather_tensor(positions.t().contiguous(), 0, self.mesh)  # [s, b], rank order
        in_order = gathered.index_select(0, self.to_global.to(gathered.device)).t()  # [b, s], sequence order
        return (in_order == 0).cumsum(-1)

    def _all_gather(self, q, k, v, scale, window=None, documents=None):
        k_all, v_all = _repeat_kv(q, self._gather(k)), _repeat_kv(q, self._gather(v))  # [b, heads, s, d]
        device = q.device
        mine, gathered = self.positions.to(device), self.gathered_positions.to(device)
        visible = visible_keys(mine, gathered, window)
        if documents is not None:
            visible = visible & (documents[:, None, mine, None] == documents[:, None, None, gathered])
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=visible, scale=scale)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """[b, kv, s_local, d] -> [b, kv, s, d], the ranks' slices side by side (rank order)."""
        gathered = all_gather_single_autograd(t.permute(2, 0, 1, 3).contiguous(), 0, self.mesh)  # [s, b, kv, d]
        return gathered.permute(1, 2, 0, 3)

    def _all_to_all(self, q, k, v, scale, window=None, documents=None):
        cp = self.mesh.size()
        k, v = _repeat_kv(q, k), _repeat_kv(q, v)
        if q.shape[1] % cp:
            raise ValueError(f"all-to-all context parallelism needs the local heads ({q.shape[1]}) divisible by "
                             f"cp={cp}; use the all-gather kind")
        q, k, v = (self._heads_for_sequence(t) for t in (q, k, v))  # [b, heads/cp, s, d], sequence order
        if (window is None or window >= q.shape[2]) and documents is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            order = torch.arange(q.shape[2], device=q.device)
            visible = visible_keys(order, order, window)
            if documents is not None:
                visible = visible & (documents[:, None, :, None] == documents[:, None, None, :])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
        return self._sequence_for_heads(out)

    def _heads_for_sequence(self, t: torch.Tensor) -> torch.Tensor:
        b, heads, s_local, d = t.shape
        cp = self.mesh.size()
        parts = t.reshape(b, cp, heads // cp, s_local, d).transpose(0, 1).contiguous()  # [cp, b, h/cp, s_l, d]
        received = all_to_all_single_autograd(parts.flatten(0, 1), None, None, self.mesh)
        received = received.reshape(cp, b, heads // cp, s_local, d).permute(1, 2, 0, 3, 4)  # source rank major
        whole = received.reshape(b, heads // cp, cp * s_local, d)
        return whole.index_select(2, self.to_global.to(t.device))

    def _sequence_for_heads(self, t: torch.Tensor) -> torch.Tensor:
        b, heads_part, s, d = t.shape
        cp = self.mesh.size()
        ranked = t.index_select(2, self.to_ranks.to(t.device)).reshape(b, heads_part, cp, s // cp, d)
        parts = ranked.permute(2, 0, 1, 3, 4).contiguous()  # [cp (destination), b, h/cp, s_l, d]
        received = all_to_all_single_autograd(parts.flatten(0, 1), None, None, self.mesh)
        received = received.reshape(cp, b, heads_part, s // cp, d).transpose(0, 1)  # [b, cp (head group), ...]
        return received.reshape(b, cp * heads_part, s // cp, d)


def visible_keys(queries: torch.Tensor, keys: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[queries, keys] True where a query at global position `queries[i]` attends to the key at `keys[j]`: causal,
    and within `window` positions (transformers' sliding window: query - key < window) where one is given."""
    behind = queries[:, None] - keys[None, :]
    return (behind >= 0) & (behind < window) if window is not None else behind >= 0


@functools.lru_cache(maxsize=8)
def _tables(seq_len: int, cp: int, rank: int) -> tuple[torch.Tensor, ...]:
    """This rank's positions, every rank's (rank order, as all-gathered), and the permutations between rank and
    sequence order: computed once, shared read-only by the cores of all blocks."""
    gathered = torch.cat([cp_positions(seq_len, cp, r) for r in range(cp)])
    to_global = torch.argsort(gathered)  # rank order -> sequence order
    return cp_positions(seq_len, cp, rank), gathered, to_global, torch.argsort(to_global)


def _repeat_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves heads(q) / heads(kv) query heads."""
    if kv.shape[1] == q.shape[1]:
        return kv
    return kv.repeat_interleave(q.shape[1] // kv.shape[1], dim=1)


def apply_cp(stage: nn.Module, cp_mesh: DeviceMesh, seq_len: int, kind: str) -> None:
    """Every block of a Stage attends through its own ContextParallelAttention (one module shared by all blocks
    breaks torch's module tracking: CommDebugMode in plait's dry run); the stage runs at its global positions."""
    for block in stage.stage_blocks().values():
        core = ContextParallelAttention(cp_mesh, seq_len, kind)
        stage.adapter.set_attention(block, core)
    stage.ctx.positions = cp_positions(seq_len, cp_mesh.size(), cp_mesh.get_local_rank())
