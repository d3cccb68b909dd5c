"""plait.cost: pure-Python cost model (no torch). `predict(plan)` is the entry point."""

from plait.cost.model import predict, predict_layout

__all__ = ["predict", "predict_layout"]
