"""Table-wise placement of embedding tables (plait.operators.table_wise): the bin-packing, the search choosing it and
packing equal tables one a rank where the budget holds one table a rank, its price, and pins that cannot hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.errors import ConfigError
from plait.operators import table_wise
from plait.operators.planner import auto_plan
from plait.spec.clusters import CLUSTER_PRESETS

TESTS = Path(__file__).resolve().parents[1]
EXAMPLES = TESTS.parent / "examples" / "operators"
MIB = 2**20


@pytest.fixture(autouse=True)
def _tables_module(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _plan(tp: int, budget_mib: float | None, pins=None, optimizer: str | None = "rowwise_adagrad",
          build: str = "build"):
    return auto_plan(f"equal_tables:{build}", "equal_tables:batch", CLUSTER_PRESETS["h100-80g"], global_batch=8 * tp,
                     tp=tp, table_optimizer=optimizer, memory_limit=budget_mib and budget_mib * MIB,
                     pins=pins).operators


def _tables(ops) -> list[str]:
    return [p for name, p in ops.params.items() if name.startswith("tables.")]


def test_packing_puts_the_largest_first_on_the_least_loaded_rank_and_keeps_pinned_owners():
    owners, loads = table_wise.pack({"a": (8.0, 1.0), "b": (5.0, 1.0), "c": (4.0, 1.0), "d": (3.0, 1.0)}, 2)
    assert owners == {"a": 0, "b": 1, "c": 1, "d": 0} and loads == [11.0, 9.0]
    owners, loads = table_wise.pack({"a": (8.0, 1.0), "b": (5.0, 1.0)}, 2, pinned={"b": 0})
    assert owners == {"b": 0, "a": 1} and loads == [5.0, 8.0]


def test_the_search_places_equal_tables_one_a_rank_where_the_budget_holds_one_a_rank():
    # four 10 MiB tables, a budget that holds one whole a rank: broadcasting a lookup's distinct rows from the
    # owner beats a row split's all-reduce of every id's row and gathering a table whole
    ops = _plan(4, 12.0, build="build_large")
    assert sorted(_tables(ops)) == ["T0", "T1", "T2", "T3"]
    assert ops.comm_counts == {"broadcast": 4}  # each lookup's rows from its owner
    replicated = _plan(4, None, build="build_large")
    assert _tables(replicated) == ["R"] * 4  # with the memory to spare no lookup pays a collective
    # a rank holds one whole table (and its accumulators): the plan's peak is that rank's, a quarter of the four
    from equal_tables import DIM, LARGE_ROWS

    table = LARGE_ROWS * DIM * 4 + LARGE_ROWS * 4  # float32 weights, one float32 accumulator a row
    assert replicated.peak_memory_bytes - ops.peak_memory_bytes == pytest.approx(3 * table, rel=1e-6)


def test_the_fullest_rank_must_fit_the_budget():
    # two tables pinned on one rank: with a budget that rank cannot take a third, the others go elsewhere
    ops = _plan(4, 2.6, pins={"tables.0.weight": "T1", "tables.1.weight": "T1"})
    placements = _tables(ops)
    assert placements[:2] == ["T1", "T1"] and "T1" not in placements[2:]
    assert ops.peak_memory_bytes <= 2.6 * MIB


@pytest.mark.parametrize("pins, optimizer, message", [
    ({"tables.0.weight": "T"}, None, "fused table optimizer"),
    ({"top.0.weight": "T0"}, "sgd", "fused table optimizer"),
    ({"tables.0.weight": "T5"}, "sgd", "tp=4 has ranks 0-3"),
])
def test_a_table_wise_pin_that_cannot_hold_is_refused_in_one_line(pins, optimizer, message):
    with pytest.raises(ConfigError, match=message) as refused:
        _plan(4, None, pins, optimizer)
    assert "\n" not in str(refused.value)


def test_a_table_no_rank_can_hold_whole_is_not_placed_table_wise_and_the_plan_fits():
    # the 100,003-row table (12.2 MiB with its accumulators) over a 10 MiB budget: split; the smaller ones packed
    ops = auto_plan("dlrm_tables:build", "dlrm_tables:batch", CLUSTER_PRESETS["h100-80g"], global_batch=16, tp=2,
                    table_optimizer="rowwise_adagrad", memory_limit=10 * MIB).operators
    assert not table_wise.is_table_wise(ops.params["tables.0.weight"])
    assert ops.peak_memory_bytes <= 10 * MIB
    # the smaller tables table-wise, packed (their first solve's owner did not fit: solved again) cost more here
    pinned = auto_plan("dlrm_tables:build", "dlrm_tables:batch", CLUSTER_PRESETS["h100-80g"], global_batch=16, tp=2,
                       table_optimizer="rowwise_adagrad", memory_limit=10 * MIB,
                       pins={"tables.1.weight": "T", "tables.2.weight": "T"}).operators
    assert pinned.peak_memory_bytes <= 10 * MIB and ops.step_time_s <= pinned.step_time_s


def test_the_ids_sample_counts_the_distinct_rows_a_micro_batch_touches_and_their_skew():
    from plait.models.factory import build_factory_module
    from plait.operators.id_sample import sample_ids

    model = build_factory_module("dlrm_tables:build", "meta")
    sample = sample_ids(model, "dlrm_tables:batch", 8, {f"tables.{t}.weight" for t in range(5)})
    assert sample.ids == {f"tables.{t}.weight": 32 for t in range(5)}  # 8 samples x 4 ids, one lookup a table
    assert all(sample.touched[n] <= 32 for n in sample.ids)
    # the 97-row table under the factory's Zipf-like skew: far fewer distinct rows than ids, a hot row
    assert sample.touched["tables.4.weight"] < 28 and sample.hottest["tables.4.weight"] > 0.1
    assert sample.touched["tables.4.weight"] < sample.touched["tables.0.weight"]
    assert "4 sample batches of dlrm_tables:batch" in sample.describe()


def test_a_table_wise_lookup_is_priced_and_run_by_the_distinct_rows_it_reads():
    import torch

    from plait.execute.operators import make_batch, step_collectives

    from dlrm_tables import DIM

    pins = {**{f"tables.{t}.weight": "R" for t in range(4)}, "tables.4.weight": "T"}
    plan = auto_plan("dlrm_tables:build", "dlrm_tables:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8, tp=2,
                     table_optimizer="sgd", pins=pins)
    ops = plan.operators
    assert ops.comm_counts == {"broadcast": 1} and "dlrm_tables:batch" in ops.table_sample
    row = DIM * 4
    assert ops.comm_bytes < 32 * row  # fewer than one row an id: the sample's distinct rows
    issued, counts, _ = step_collectives(plan)
    ids = make_batch("dlrm_tables:batch", 8, 0, 0, torch.float32)[1][:, 4]
    assert counts == {"broadcast": 1} and issued == len(torch.unique(ids)) * row
    assert abs(ops.comm_bytes - issued) <= 0.25 * issued  # the sample's mean against this batch's


def test_an_embedding_bag_runs_as_a_lookup_and_a_pooling_and_plans_split():
    import torch
    from torch import nn

    from plait.models.embedding_bags import PooledEmbedding, pool_embedding_bags

    torch.manual_seed(0)
    holder = nn.Module()
    holder.sum, holder.mean = nn.EmbeddingBag(50, 8, mode="sum"), nn.EmbeddingBag(50, 8, mode="mean")
    holder.kept = nn.EmbeddingBag(50, 8, mode="max")  # no lookup-and-pooling form: left as it is
    ids, weights = torch.randint(0, 50, (6, 4)), torch.rand(6, 4)
    expected = [holder.sum(ids, per_sample_weights=weights), holder.mean(ids)]
    weight = holder.sum.weight
    pool_embedding_bags(holder)
    assert isinstance(holder.sum, PooledEmbedding) and holder.sum.weight is weight
    assert type(holder.kept) is nn.EmbeddingBag
    from plait.operators.planner import fused_tables

    with pytest.raises(ConfigError, match=r"nn.EmbeddingBag 'kept' cannot be trained fused"):
        fused_tables(holder, "sgd")  # it would train by AdamW while the plan said fused
    assert fused_tables(holder, None) == {}
    torch.testing.assert_close(holder.sum(ids, per_sample_weights=weights), expected[0])
    torch.testing.assert_close(holder.mean(ids), expected[1])
    # bags' tables (examples/operators/equal_tables.py) planned split by rows, by columns and table-wise; the plan dry-runs
    from plait.execute.module_dryrun import runnable

    pins = {"tables.0.weight": "S0", "tables.1.weight": "T", "tables.2.weight": "T", "tables.3.weight": "S1"}
    plan = auto_plan("equal_tables:build", "equal_tables:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8, tp=2,
                     table_optimizer="sgd", pins=pins)
    assert "embedding_bag" not in " ".join(plan.operators.replicated_ops)
    written, failed = runnable([plan])
    assert written and not failed, failed


def test_the_row_exchange_sends_distinct_rows_where_ids_repeat_enough_to_pay_for_the_count():
    from plait.cost import comm
    from plait.cost.operators import row_exchange_time

    h100 = CLUSTER_PRESETS["h100-80g"]
    # a hundred ids a row: a fiftieth of the bytes beats the count's all-reduce
    assert row_exchange_time(1 * MIB, 100 * MIB, 8, h100, comm.Group(8, 8))[1]
    # ids that barely repeat: the count's latency is not worth a few rows
    assert not row_exchange_time(30e3, 32e3, 128, h100, comm.Group(128, 8))[1]
    assert row_exchange_time(1.0, 2.0, 1, h100, comm.Group(1, 8)) == (0.0, False)  # no data parallelism


def test_fused_tables_dry_run_on_meta(monkeypatch):
    """A module too large to build on CPU is dry-run on meta: its fused tables' updates (row-wise Adagrad's distinct
    rows, a table-wise lookup's) have no meta kernel and hold no values there; the dry run passes them by, where it
    refused every such plan before."""
    from plait.execute import module_dryrun

    monkeypatch.setattr(module_dryrun, "REAL_BYTES", 0)  # every module on meta
    pins = {"tables.0.weight": "S0", "tables.1.weight": "S1", "tables.2.weight": "T"}
    plan = auto_plan("dlrm_tables:build", "dlrm_tables:batch", CLUSTER_PRESETS["local-cpu"], global_batch=8, dp=2,
                     tp=2, table_optimizer="rowwise_adagrad", pins=pins)
    written, failed = module_dryrun.runnable([plan])
    assert written and not failed, failed
