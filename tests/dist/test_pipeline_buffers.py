"""The executor holds the pipeline's receive buffers in flight only (plait/execute/buffers.py): on 2 gloo ranks, for
every schedule, its pool never holds more than plait.cost.live_set counts over the schedule's own order, that count does
not grow with the micro-batches, nothing is left in torch's receive records between steps, and the losses are those of
torch's own allocation, bit for bit. (Equality with one process: tests/dist/test_equivalence.py's pipeline cases.)"""

from __future__ import annotations

import json
import textwrap

import pytest

from plait.runtime.launch import run_local

pytestmark = pytest.mark.dist

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zbv": 2, "dualpipev": 2}

WORKER = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from plait.execute import parallelize
    from plait.execute.batches import batch_for_step
    from plait.runtime.launch import init_distributed, shutdown_distributed
    from plait.plan import Plan
    from plait.spec import ModelSpec, TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    rank, world = init_distributed(timeout_s=120)
    model_spec = ModelSpec(name="tiny", arch="gpt", num_layers=4, hidden_size=32, num_heads=2, vocab_size=64,
                           max_seq_len=16)
    out = {}
    for schedule, v in json.loads(sys.argv[2]).items():
        for m in (4, 8):
            plan = Plan.of(model=model_spec, train=TrainSpec(global_batch=m, seq_len=16, precision="fp32"),
                           cluster=CLUSTER_PRESETS["local-cpu"], pp=world, schedule=schedule, interleave=v,
                           micro_batch=1, num_micro_batches=m)
            for buffers in ("pool", "torch") if m == 8 else ("pool",):
                model = parallelize(plan, seed=0, device="cpu", pipeline_buffers=buffers)
                losses = [model.train_step(*batch_for_step(plan, 0, step)) for step in range(2)]
                stages = getattr(model.schedule, "_stages", None) or [model.schedule._stage]
                left = sum(info.buffer is not None for stage in stages
                           for infos in list(stage.args_recv_info.values()) + list(stage.grad_recv_info.values())
                           for info in infos if not info.is_root_arg)
                row = {"losses": losses, "left_in_records": left,
                       "most_pending_sends": max(getattr(stage, "most_pending", 0) for stage in stages)}
                pools = model.schedule.buffer_pools
                if pools is not None:
                    row |= {kind: [p.capacity, p.high_water, p.overflow, len(p.tensors())]
                            for kind, p in (("inputs", pools.inputs), ("grads", pools.grads))}
                out[f"{schedule}/{m}/{buffers}"] = row
    rows = [None] * world
    dist.all_gather_object(rows, out)
    if rank == 0:
        open(sys.argv[1], "w").write(json.dumps(rows))
    shutdown_distributed()
""")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("buffers")
    script, out = tmp / "buffers.py", tmp / "out.json"
    script.write_text(WORKER)
    assert run_local(2, [str(script), str(out), json.dumps(SCHEDULES)], module=None, timeout_s=600) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_pool_holds_what_the_live_set_counts(ranks, schedule):
    for rows in ranks:
        for m in (4, 8):
            row = rows[f"{schedule}/{m}/pool"]
            for kind in ("inputs", "grads"):
                capacity, high_water, overflow, held = row[kind]
                assert overflow == 0 and high_water == capacity and held == capacity, (schedule, m, kind, row)
            assert row["left_in_records"] == 0  # every buffer went back to the pool after its backward
        if schedule != "gpipe":  # GPipe keeps every micro-batch in flight by design
            assert rows[f"{schedule}/4/pool"]["inputs"][0] == rows[f"{schedule}/8/pool"]["inputs"][0]
            # the sends a stage holds (the multi-stage runtime's; torch's single-stage loops wait their own)
            held = [rows[f"{schedule}/{m}/pool"]["most_pending_sends"] for m in (4, 8)]
            assert held[1] <= max(held[0], 2), held  # torch's runtime held 2m at its step's end
            if schedule not in ("gpipe", "1f1b"):
                assert held[1] >= 1  # the stages post their own sends under the multi-stage runtime
    receiving = ranks[1][f"{schedule}/8/pool"]
    assert receiving["inputs"][0] >= 1  # the second rank receives: the check above counted real buffers


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_pool_computes_what_torchs_allocation_does(ranks, schedule):
    for rows in ranks:
        assert rows[f"{schedule}/8/pool"]["losses"] == rows[f"{schedule}/8/torch"]["losses"]
    # torch's own allocation keeps a receive buffer per micro-batch in its records: what the pool replaces
    assert ranks[1][f"{schedule}/8/torch"]["left_in_records"] >= 8
