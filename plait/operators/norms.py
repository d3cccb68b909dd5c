"""Normalisations over split dimensions: which dimensions of its input a normalisation's statistics span, so that
a plan never computes them over one rank's share. One rule for the planner (a strategy that reads such a dimension
split is left out: the norm reads its input whole, and the gather is priced) and the executor (a split input is
made whole above autograd before the call, plait.execute.operators.NormsReadWhole: left to DTensor, GroupNorm's
backward on a channel-split input fails, `Expected dY.numel() == N * C * HxW`).

* GroupNorm: a group's channels and every spatial position (dims 1..n-1); the batch may stay split.
* LayerNorm (RMSNorm alike): the normalised trailing dims.
* BatchNorm: the batch and spatial dims (0, 2..n-1); its channels may stay split (per-channel statistics; over
  data-parallel ranks the statistics are summed, plait.execute.batchnorm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP, LAYER, BATCH = "group_norm", "layer_norm", "batch_norm"

_ATEN = {
    "native_group_norm": GROUP, "native_layer_norm": LAYER, "_fused_rms_norm": LAYER,
    "native_batch_norm": BATCH, "_native_batch_norm_legit": BATCH, "_native_batch_norm_legit_functional": BATCH,
    "_native_batch_norm_legit_no_training": BATCH,
}
"""ATen operators (as capture records them) -> the normalisation they compute."""

FUNCTIONS = {F.group_norm: GROUP, F.layer_norm: LAYER, F.batch_norm: BATCH, F.rms_norm: LAYER}
"""Torch-level calls (as the executor's forward meets them) -> the normalisation; input first, then (layer norm)
the normalised shape."""


def statistics_dims(kind: str, ndim: int, normalized: int = 1) -> tuple[int, ...]:
    """Dimensions of an `ndim`-dimensional input the normalisation's statistics span (`normalized`: how many
    trailing dimensions a layer norm normalises)."""
    if kind == GROUP:
        return tuple(range(1, ndim))
    if kind == LAYER:
        return tuple(range(ndim - normalized, ndim))
    if kind == BATCH:
        return (0, *range(2, ndim))
    raise ValueError(f"unknown normalisation {kind!r}")


def aten_statistics_dims(op_name: str, args: tuple) -> tuple[int, ...] | None:
    """For a captured ATen call (operator name without overload, its arguments with tensors as refs having
    .shape): the dims of its first argument the statistics span; None for an operator that is no normalisation."""
    kind = _ATEN.get(op_name)
    if kind is None or not args:
        return None
    ndim = len(args[0].shape)
    normalized = len(args[1]) if kind == LAYER and len(args) > 1 and isinstance(args[1], (list, tuple)) else 1
    return statistics_dims(kind, ndim, normalized)


def function_statistics_dims(func, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """The same for a torch-level call (F.group_norm, F.layer_norm, F.batch_norm, F.rms_norm); None otherwise."""
    kind = FUNCTIONS.get(func)
    if kind is None or not args or not isinstance(args[0], torch.Tensor):
        return None
    shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape", ())
    normalized = len(shape) if kind == LAYER and isinstance(shape, (list, tuple, torch.Size)) else 1
    return statistics_dims(kind, args[0].dim(), normalized)


def reads_split_statistics(dims: tuple[int, ...] | None, placement: str) -> bool:
    """Whether an input held in `placement` ("R", "S<d>", "P") is split along a dimension the statistics span."""
    return dims is not None and placement.startswith("S") and int(placement[1:]) in dims
