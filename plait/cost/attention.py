"""How much of the s x s attention square a layer's kernel computes under a sliding window or over packed
documents: the rule the executor follows (plait.models.windows asks `window_kernel`) and the factor the cost model
prices it with.

A layer with a sliding window W (its class's ``sliding_window``; a query attends to the keys fewer than W positions
behind it) runs one of three kernels over a sequence of s tokens:

* "causal", s <= W: the window covers the whole sequence; SDPA's causal path (its fused kernels skip the blocks
  above the diagonal: half the square, as a layer without a window);
* "banded", where it computes less than the whole square (ceil(s / W) · 2 W^2 < s^2, from about s > 2 W on): the
  queries cut into chunks of W, each attending to its own chunk and the one before it (exactly the window's keys)
  with a [W, 2 W] mask: ceil(s / W) rectangles of W x 2 W, about 2 s W of the s^2 pairs; what the math path keeps
  for backward (its probabilities) shrinks alike;
* "dense" otherwise (W < s up to about 2 W): SDPA over the whole square with the window as a boolean mask, which
  the kernels cannot skip blocks of (the whole square).

Up to about 4 W the banded kernel computes more than the causal half of the square would, but less than the dense
one, and it holds no s x s mask; past 4 W it computes less than a layer without a window.

Packed documents kept apart (plait.train.documents) are attended document by document on a layer without a window
shorter than the sequence: each document's own causal square, never the scores across documents. Rows of s tokens
packing documents of d tokens on average compute (s / d) · d (d + 1) / 2 = s (d + 1) / 2 pairs of the causal
s (s + 1) / 2 (the math path: s · d of the s^2). Priced from TrainSpec.document_len; the grouping of the pieces by
length pads a piece to at most twice its length, which is not charged. Under context parallelism documents are a
mask: "all_to_all" then computes the whole square.
"""

from __future__ import annotations

import math

from plait.spec.attention import window_kernel
from plait.spec.model import ModelSpec


def computed_square(seq_len: int, window: int | None, fused: bool = True, document_len: int | None = None) -> float:
    """Fraction of the seq_len x seq_len square of scores the layer's kernel computes (`fused`: SDPA's fused
    kernels, which skip the causal blocks above the diagonal where no mask is given; the math path computes the
    whole square); `document_len`: rows pack documents of that many tokens on average (None: one per row)."""
    kernel = window_kernel(seq_len, window)
    if kernel == "causal":
        if document_len is not None and document_len < seq_len:
            return (document_len + 1) / (2 * seq_len) if fused else document_len / seq_len
        return 0.5 if fused else 1.0
    if kernel == "dense":
        return 1.0
    chunks = math.ceil(seq_len / window)
    return chunks * window * 2 * window / seq_len ** 2


def layer_windows(model: ModelSpec) -> list[int | None]:
    """Each layer's sliding window (None: attends over the whole sequence)."""
    if not model.sliding_window:
        return [None] * model.num_layers
    full = set(model.full_attention_layers)
    return [None if layer in full else model.sliding_window for layer in range(model.num_layers)]


def window_share(model: ModelSpec, seq_len: int, fused: bool = True, document_len: int | None = None) -> float:
    """The attention work of the model's mean layer over that of a layer without a window over one document per row
    (1 without windows and documents): what the cost model multiplies the attention core's FLOPs, and the math
    path's probabilities, by."""
    plain = computed_square(seq_len, None, fused)
    windows = layer_windows(model)
    return sum(computed_square(seq_len, w, fused, document_len) for w in windows) / (len(windows) * plain)


def context_window_share(model: ModelSpec, seq_len: int, kind: str, document_len: int | None = None) -> float:
    """window_share under context parallelism (plait/execute/context.py): "all_gather" computes the whole rectangle
    of its queries against the gathered keys through a mask in any case (1); "all_to_all" runs the causal path over
    the whole sequence, but a mask over the whole square on the layers a window cuts, and on every layer where rows
    pack documents."""
    if kind == "all_gather":
        return 1.0
    documents = document_len is not None and document_len < seq_len
    windows = layer_windows(model)
    return sum(1.0 if documents or (w is not None and seq_len > w) else 0.5 for w in windows) / (0.5 * len(windows))
