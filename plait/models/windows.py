"""Attention kernels that compute only what a layer's mask keeps, instead of SDPA over the whole masked square.

* A sliding-window layer over a sequence longer than about twice its window, band by band (plait.spec.attention's
  "banded" kernel): exactly the scores the class's mask keeps, about 2 s W of the s^2 a dense kernel computes;
* packed documents (plait.train.documents) document by document (`attention_by_document`): each document's own
  causal square, the pieces grouped by length, never the scores across documents.

Band by band:

The queries are cut into chunks of W; the keys a query of chunk i can see (fewer than W positions behind it) all lie
in chunks i - 1 and i, so chunk i attends to those 2 W keys through the band of the class's own boolean mask
([b, 1, s, s], sliding window and packed documents alike) that covers them. The mask decides what is seen, as on one
process; the band only leaves out scores the mask would have discarded. Queries past the end of the sequence
(padding up to a whole chunk) see themselves only, so no row of the softmax is empty, and are dropped.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from plait.spec.attention import window_kernel


def layer_window(module: torch.nn.Module, kwargs: dict) -> int | None:
    """The sliding window of the attention layer `module`: what its class passes the attention function, or the
    attribute it keeps (Qwen2-MoE passes none); None for a layer over the whole sequence."""
    window = kwargs.get("sliding_window")
    if window is None:
        window = getattr(module, "sliding_window", None)
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def runs_banded(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, window: int | None,
                kwargs: dict) -> bool:
    """Whether this call computes band by band: a boolean [b, 1, s, s] mask of a self-attention call whose window
    makes the band cheaper than the square, and nothing else on the scores (no attention sinks, soft-capping)."""
    if window is None or mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return False
    s = query.shape[2]
    if key.shape[2] != s or tuple(mask.shape[-2:]) != (s, s) or kwargs.get("s_aux") is not None \
            or kwargs.get("softcap") is not None:
        return False
    return window_kernel(s, window) == "banded"


def banded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, window: int,
                     scale: float | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v of [b, heads, s, d] queries (keys and values with as many or fewer heads) under
    the boolean `mask` [b or 1, 1, s, s], whose kept keys lie within `window` positions behind each query; returns
    [b, s, heads, d], as transformers' attention functions do."""
    b, heads, s, d = query.shape
    if key.shape[1] != heads:  # grouped-query attention: each key/value head serves heads / kv_heads queries
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    chunks = math.ceil(s / window)
    pad = chunks * window - s
    q = F.pad(query, (0, 0, 0, pad)).reshape(b, heads, chunks, window, d)
    # keys of chunk i: padded positions i·W .. i·W + 2W (one chunk of nothing before the first)
    k = F.pad(key, (0, 0, window, pad)).unfold(2, 2 * window, window).transpose(-1, -2)
    v = F.pad(value, (0, 0, window, pad)).unfold(2, 2 * window, window).transpose(-1, -2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=_band(mask, window, chunks, s), scale=scale)
    return out.reshape(b, heads, chunks * window, d)[:, :, :s].transpose(1, 2).contiguous()


def _band(mask: torch.Tensor, window: int, chunks: int, s: int) -> torch.Tensor:
    """[B, 1, chunks, W, 2W]: for chunk i, the mask's rows i·W .. (i+1)·W against its columns (i-1)·W .. (i+1)·W;
    padding rows see their own (zero) key only."""
    pad = chunks * window - s
    padded = F.pad(mask, (window, pad, 0, pad), value=False)  # [B, 1, chunks·W, (chunks+1)·W]
    rows = padded.reshape(mask.shape[0], 1, chunks, window, (chunks + 1) * window)
    columns = (torch.arange(chunks, device=mask.device)[:, None] * window
               + torch.arange(2 * window, device=mask.device)[None, :])  # [chunks, 2W]
    index = columns[None, None, :, None, :].expand(mask.shape[0], 1, chunks, window, 2 * window)
    band = torch.gather(rows, -1, index)
    if pad:
        beyond = (torch.arange(chunks * window, device=mask.device) >= s).reshape(chunks, window)
        column = torch.arange(2 * window, device=mask.device)
        own = column[None, :] == window + torch.arange(window, device=mask.device)[:, None]
        band = band | (beyond[:, :, None] & own[None])
    return band


_SEGMENTS: list = [None, None]
"""(weak reference to the last position ids, their segments): every layer of a forward is handed the same tensor,
read back to the host once."""


def document_segments(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, length) of each document piece of rows [b, s] of position ids restarting at 0 where a document
    begins (plait.train.documents)."""
    import weakref

    if _SEGMENTS[0] is not None and _SEGMENTS[0]() is positions:
        return _SEGMENTS[1]
    segments = _segments(positions)
    _SEGMENTS[:] = [weakref.ref(positions), segments]
    return segments


def _segments(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    b, s = positions.shape
    starts = (positions == 0).clone()
    starts[:, 0] = True
    out = []
    for row in range(b):
        begins = torch.nonzero(starts[row]).flatten().tolist()
        out += [(row, a, e - a) for a, e in zip(begins, begins[1:] + [s])]
    return out


def runs_by_document(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, window: int | None,
                     kwargs: dict) -> bool:
    """Whether this call attends document by document: packed documents (position ids that restart, with the
    class's mask for them), no window shorter than the sequence (that runs band by band, documents included), and
    nothing else on the scores."""
    positions = kwargs.get("position_ids")
    if mask is None or mask.dtype != torch.bool or not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return False
    s = query.shape[2]
    if key.shape[2] != s or positions.shape != (query.shape[0], s) or tuple(mask.shape[-2:]) != (s, s) \
            or kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None:
        return False
    if window is not None and window < s:
        return False
    return len(document_segments(positions)) > positions.shape[0]  # read once a forward, not once a layer


def attention_by_document(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                          scale: float | None = None) -> torch.Tensor:
    """Causal attention within each packed document of [b, heads, s, d] queries (keys and values with as many or
    fewer heads), documents given by `positions` [b, s]; returns [b, s, heads, d]. The documents' pieces are grouped
    by length (powers of two), each group right-padded to its longest and run through SDPA's causal path: a
    padded position comes after every real one, so no real query sees it, and the scores across documents are never
    computed (about the sum of the documents' own causal squares)."""
    b, heads, s, d = query.shape
    if key.shape[1] != heads:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    flat = [t.transpose(1, 2).reshape(b * s, heads, d) for t in (query, key, value)]  # [b·s, heads, d]
    out = query.new_zeros(b * s, heads, d)
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for row, start, length in document_segments(positions):
        groups.setdefault(1 << (length - 1).bit_length(), []).append((row, start, length))
    for width, pieces in groups.items():
        first = torch.tensor([row * s + start for row, start, _ in pieces], device=query.device)
        lengths = torch.tensor([length for _, _, length in pieces], device=query.device)
        offset = torch.arange(width, device=query.device)
        index = first[:, None] + torch.minimum(offset[None, :], lengths[:, None] - 1)  # [pieces, width], clipped
        q, k, v = (t[index].transpose(1, 2) for t in flat)  # [pieces, heads, width, d]
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)
        real = offset[None, :] < lengths[:, None]
        out = out.index_put((index[real],), attended[real])
    return out.reshape(b, s, heads, d)
