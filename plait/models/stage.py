"""One pipeline stage of any adapter's model: the embedding on the first stage, this stage's blocks, the head on
the last (with one stage: the whole model).

A Stage adopts the root module's children under their own names and keeps only its blocks, in a
ModuleDict keyed by the global block index, so every parameter keeps the single-process name
("model.layers.7.self_attn.q_proj.weight"): state dicts of stages merge back into the model's, and
checkpoints (plait's and Hugging Face's) load into any layout. The model's code is not changed: the
stage calls the adapter's `embed`, each block, and the adapter's `head`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from plait.models.adapter import ModelAdapter, StageContext, get_module, set_module


class Stage(nn.Module):
    def __init__(self, adapter: ModelAdapter, skeleton: nn.Module, blocks: dict[int, nn.Module], *, first: bool,
                 last: bool, seq_len: int) -> None:
        super().__init__()
        for name, child in skeleton._modules.items():  # None children too (a model without learned positions)
            self.add_module(name, child)
        for name, param in skeleton.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, value in vars(skeleton).items():  # plain attributes the model's own embed/head may read
            if not name.startswith("_") and name != "training" and not hasattr(self, name):
                setattr(self, name, value)
        set_module(self, adapter.blocks_path, nn.ModuleDict({str(i): block for i, block in blocks.items()}))
        self.adapter = adapter
        self.first, self.last = first, last
        self.block_ids = tuple(blocks)
        self.ctx = StageContext(positions=torch.arange(seq_len))

    def stage_blocks(self) -> nn.ModuleDict:
        return get_module(self, self.adapter.blocks_path)

    def retie(self) -> None:
        """Tie an output layer to the embedding it shares again, where both are on this stage. Distributing a
        module (tensor parallelism) and `to_empty` on meta tensors both replace parameters by new ones, which
        silently unties them: the embedding's gradient then misses the output layer's part."""
        params = dict(self.named_parameters(remove_duplicate=False))
        for alias, canonical in self.adapter.tied.items():
            if alias in params and canonical in params and params[alias] is not params[canonical]:
                owner, _, leaf = alias.rpartition(".")
                setattr(get_module(self, owner) if owner else self, leaf, params[canonical])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens [b, s] in on the first stage (hidden states [b, s, h] on the others); logits [b, s, V]
        out of the last (hidden states out of the others)."""
        if self.ctx.positions.device != x.device:
            self.ctx.positions = self.ctx.positions.to(x.device)
        hidden = self.adapter.embed(self, x, self.ctx) if self.first else x
        kwargs = self.adapter.block_kwargs(self, hidden, self.ctx)
        for index, block in self.stage_blocks().items():
            hidden = self.adapter.run_block(block, hidden, self.adapter.kwargs_of(kwargs, int(index)))
        return self.adapter.head(self, hidden) if self.last else hidden


def build_stage(adapter: ModelAdapter, root: nn.Module, block_ids: list[int] | range, *, first: bool, last: bool,
                seq_len: int) -> Stage:
    """A Stage of `root` (usually on meta) holding `block_ids`, and the ends if `first` / `last`.

    The whole model is adopted as it is; a part is copied without the blocks it does not hold (a
    175B-parameter meta model is not copied whole once per stage)."""
    container = get_module(root, adapter.blocks_path)
    all_blocks = list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)
    block_ids = list(block_ids)
    if first and last and block_ids == list(range(len(all_blocks))):
        return Stage(adapter, root, dict(enumerate(all_blocks)), first=True, last=True, seq_len=seq_len)
    set_module(root, adapter.blocks_path, nn.ModuleDict())
    try:
        skeleton = copy.deepcopy(root)
    finally:
        set_module(root, adapter.blocks_path, container)
    for path in ([] if first else list(adapter.pre)) + ([] if last else list(adapter.post)):
        if get_module(skeleton, path) is not None:
            set_module(skeleton, path, None)
    blocks = {i: copy.deepcopy(all_blocks[i]) for i in block_ids}
    return Stage(adapter, skeleton, blocks, first=first, last=last, seq_len=seq_len)
