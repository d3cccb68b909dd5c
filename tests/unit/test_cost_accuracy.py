"""The cost model against published runs (reference/published.md): the tolerances issue 2 sets."""

import pytest

from plait.cost.published import (LAYER_22B_ROWS, MEGATRON_ROWS, ZERO_PSI, ZERO_ROWS, megatron_plan,
                                  predicted_layer_ms, predicted_tflops)
from plait.cost.memory import model_state_bytes
from plait.spec import TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS

A100 = CLUSTER_PRESETS["a100-80g"]


@pytest.mark.parametrize("row", MEGATRON_ROWS, ids=lambda r: f"{r.params_b}B")
def test_megatron_tflops_within_10_percent(row):
    predicted = predicted_tflops(row, A100)
    assert abs(predicted / row.tflops - 1) <= 0.10, f"{row.params_b}B: {predicted:.1f} vs {row.tflops} TFLOP/s"


def test_megatron_rows_fit_in_memory():
    # The paper ran them on 80 GB GPUs: the model should agree that they fit.
    for row in MEGATRON_ROWS:
        plan = megatron_plan(row, A100)
        from plait.cost import predict

        assert predict(plan).peak_memory_bytes <= A100.memory_bytes, row


@pytest.mark.parametrize("name,sp,mode,fwd,bwd,combined", LAYER_22B_ROWS, ids=[r[0] for r in LAYER_22B_ROWS])
def test_22b_layer_times_within_15_percent(name, sp, mode, fwd, bwd, combined):
    pf, pb = predicted_layer_ms(A100, sp, mode)
    for predicted, published in ((pf, fwd), (pb, bwd), (pf + pb, combined)):
        assert abs(predicted / published - 1) <= 0.15, f"{name}: {predicted:.2f} vs {published} ms"


def test_zero_figures_exact():
    train = TrainSpec(global_batch=1, seq_len=1)
    for nd, row in ZERO_ROWS.items():
        for stage, published in zip((1, 2, 3), row):
            gb = sum(model_state_bytes(ZERO_PSI, nd, stage, train).values()) / 1e9
            decimals = len(str(published).split(".")[1])
            assert abs(gb - published) <= 0.5 * 10**-decimals + 1e-12, (nd, stage, gb, published)
