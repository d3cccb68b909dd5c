"""Fused row-wise table optimizers (plait.execute.embedding_tables) in one process: row-wise Adagrad against its formula with
repeated ids, and the planner's price of its accumulators."""

from __future__ import annotations

import torch
from torch import nn

from plait.cost import operators as price
from plait.execute.embedding_tables import ADAGRAD_EPS, FusedTables
from plait.operators.capture import TensorRef


def test_rowwise_adagrad_sums_a_rows_gradients_then_steps_by_its_accumulator():
    torch.manual_seed(0)
    table = nn.Embedding(10, 4).double()
    start = table.weight.detach().clone()
    tables = FusedTables(lr=0.1)
    tables.apply(table, {"weight": "rowwise_adagrad"})
    ids = torch.tensor([[1, 3, 1], [7, 3, 3]])
    upstream = torch.randn(2, 3, 4, dtype=torch.float64)
    for _ in range(2):
        (table(ids) * upstream).sum().backward()
    assert table.weight.grad is None  # the update happened in the lookup's backward
    expected, accumulator = start.clone(), torch.zeros(10, dtype=torch.float64)
    for _ in range(2):
        grad = torch.zeros(10, 4, dtype=torch.float64).index_add_(0, ids.flatten(), upstream.reshape(-1, 4))
        touched = ids.flatten().unique()
        accumulator[touched] += grad[touched].square().mean(dim=1)
        expected[touched] -= 0.1 * grad[touched] / (accumulator[touched].sqrt() + ADAGRAD_EPS)[:, None]
    assert torch.allclose(table.weight.detach(), expected, rtol=0, atol=1e-12)
    assert torch.equal(table.weight.detach()[0], start[0])  # an untouched row does not move


def test_rowwise_adagrad_costs_one_float_a_row_beside_the_weights():
    ref = TensorRef(0, (1000, 32), (32, 1), torch.float32)
    assert price.fused_table_copies("sgd", ref) == 1
    assert price.parameter_bytes(ref, "S0", 2, 1, price.fused_table_copies("rowwise_adagrad", ref)) == \
        500 * 32 * 4 + 500 * 4
