"""TrainSpec: the batch and numerics of one training step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from plait.spec._dict import from_dict, to_dict

Precision = Literal["bf16", "fp16", "fp32"]


TRAINABLE_PRECISIONS = ("fp32", "bf16")
"""What the executor trains in: fp16 is priced by the planner, but trains only with a loss scaler, which plait has
not got."""


def untrainable_precision(precision: str) -> str | None:
    """Why a run cannot train in `precision` (one line, with what would work), or None."""
    if precision in TRAINABLE_PRECISIONS:
        return None
    return (f"precision={precision!r} trains without a loss scaler in plait (small gradients would underflow to "
            f"zero); use \"bf16\" (the same memory, no scaler needed) or \"fp32\"")


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    global_batch: int
    """Sequences per optimizer step, over all data-parallel replicas and micro-batches."""
    seq_len: int
    """Tokens per sequence."""
    precision: Precision = "bf16"
    """Compute and parameter dtype. 16-bit keeps fp32 master weights and Adam states (ZeRO's K = 12)."""
    document_len: int | None = None
    """Mean tokens of the documents a row packs and keeps apart ([data] packing = "documents"): attention is priced
    over each document's own causal square (plait.cost.attention). None: one document per row. A pricing
    assumption: `plait train` measures it from its data, `plait plan --document-len` takes it."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.document_len is not None and (isinstance(self.document_len, bool) or not isinstance(
                self.document_len, int) or self.document_len <= 0):
            raise ValueError(f"document_len={self.document_len!r} must be a positive integer (mean tokens of a packed "
                             f"document) or unset")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"precision={self.precision!r} is not one of 'bf16', 'fp16', 'fp32'")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def param_bytes(self) -> int:
        """Bytes of one working copy of a parameter (and of a gradient)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer-state bytes per parameter (ZeRO's K): fp32 master + Adam m and v for 16-bit; m and v for fp32."""
        return 8 if self.precision == "fp32" else 12

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainSpec":
        return from_dict(cls, data, "train")
