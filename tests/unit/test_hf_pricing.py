"""What the measured ModelSpec of a Hugging Face class prices beyond its FLOPs: the key and value weights every
tensor rank holds whole where tp exceeds the kv heads, and blocks whose work a FLOP count misses (a scan written
as elementwise steps), flagged by `plait plan`."""

from __future__ import annotations

import torch
from torch import nn

from plait.cost.memory import layer_params
from plait.models.measure import measure_block, unpriced_blocks, unpriced_note
from plait.spec import ModelSpec

MQA = ModelSpec(name="mqa", source="hf:/nowhere", arch="llama", num_layers=2, hidden_size=2048, num_heads=8,
                num_kv_heads=1, head_dim=256, ffn_hidden_size=8192, vocab_size=1000)


def test_replicated_key_value_weights_are_held_whole():
    kv_weights = 2048 * 2 * 256  # k and v: one head of 256 each
    split_evenly = MQA.replace(source="plait")  # plait's own decoders refuse kv < tp: nothing replicated
    for tp in (2, 4, 8):
        extra = layer_params(MQA, tp) - layer_params(split_evenly, tp)
        assert extra == kv_weights * (1 - 1 / tp)
    assert layer_params(MQA, 1) == layer_params(split_evenly, 1)
    grouped = MQA.replace(num_kv_heads=4)
    assert layer_params(grouped, 4) == layer_params(grouped.replace(source="plait"), 4)  # tp divides the kv heads


class _Mlp(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Scan(nn.Module):
    """A diagonal state-space recurrence in elementwise steps (as transformers' torch fallbacks write them)."""

    def __init__(self, h: int, state: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(h, h)
        self.decay = nn.Parameter(torch.zeros(h, state))

    def forward(self, x):
        u = self.proj(x)
        state = torch.zeros(x.shape[0], x.shape[-1], self.decay.shape[1], device=x.device)
        outs = []
        for t in range(x.shape[1]):
            state = state * torch.exp(self.decay) + u[:, t, :, None]
            outs.append(state.sum(-1))
        return x + torch.stack(outs, 1)


def test_a_scan_in_elementwise_steps_is_flagged():
    h = 32
    with torch.device("meta"):
        mlp, scan = measure_block(_Mlp(h), h), measure_block(_Scan(h), h)
    assert 0 < mlp.unpriced_elements_per_token < 0.1 * mlp.flops_per_token
    assert scan.unpriced_elements_per_token > 0.5 * scan.flops_per_token  # ~3 per state entry against 2h^2 FLOPs
    spec = MQA.replace(name="hybrid", hidden_size=h, num_heads=4, num_kv_heads=4, head_dim=8, blocks=(mlp, scan))
    assert [index for index, _ in unpriced_blocks(spec, 1024)] == [1]
    note = unpriced_note(spec, 1024)
    assert "1 of hybrid's 2 blocks (1)" in note and "lower bound" in note
    assert unpriced_note(spec.replace(blocks=(mlp, mlp)), 1024) is None
