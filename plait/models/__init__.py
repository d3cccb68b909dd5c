"""Models the executor runs, through adapters (plait.models.adapter): plait's reference decoders, Hugging Face
causal LMs and a user's own module. `build_model(spec)` builds the whole single-process model of any source."""

from __future__ import annotations

import torch
from torch import nn

from plait.models.adapter import ModelAdapter, StageContext, TensorPlan, adapter_for
from plait.models.stage import Stage, build_stage
from plait.spec import ModelSpec


def build_model(spec: ModelSpec, *, device: str | torch.device = "meta", seed: int | None = None) -> nn.Module:
    """The whole model of `spec` on `device` ("meta": shapes only). With `seed`, weights are initialized
    deterministically (the values every parallel layout starts from)."""
    adapter = adapter_for(spec)
    model = adapter.build_adapted(device)
    if seed is not None:
        adapter.initialize(model, seed)
    return model


def initial_state_dict(spec: ModelSpec, seed: int, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Full initial tensors for `names` (default: every parameter), without building the model's weights."""
    adapter = adapter_for(spec)
    meta = adapter.build_adapted("meta")
    shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
    wanted = shapes.keys() if names is None else names
    return {name: adapter.initial_tensor(name, shapes[name], seed) for name in wanted}


__all__ = ["ModelAdapter", "Stage", "StageContext", "TensorPlan", "adapter_for", "build_model", "build_stage",
           "initial_state_dict"]
