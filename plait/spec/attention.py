"""Which attention kernel a layer runs: one rule that the cost model (plait.cost.attention prices it) and the
executor (plait.models.windows runs it) both ask, so what is priced is what runs."""

from __future__ import annotations

import math

WINDOW_KERNELS = ("causal", "dense", "banded")


def window_kernel(seq_len: int, window: int | None) -> str:
    """Which kernel a layer with sliding window `window` (None: none) runs over `seq_len` tokens (WINDOW_KERNELS)."""
    if window is None or seq_len <= window:
        return "causal"
    return "banded" if math.ceil(seq_len / window) * 2 * window * window < seq_len * seq_len else "dense"
