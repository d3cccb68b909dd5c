"""The plan file is a contract: files written by earlier plait releases load and write back unchanged, and one
choice has one spelling (a Plan holds its Layout, whose canonical form is made in one place)."""

import json
from pathlib import Path

import pytest

from plait.axes import Degrees
from plait.plan import LAYOUT_FIELDS, Layout, Plan
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.models import MODEL_PRESETS
from plait.spec.train import TrainSpec

SAVED = sorted((Path(__file__).parents[1] / "data" / "plans").glob("*.json"))


def kept(old, new, where="plan"):
    """Every key of `old` is in `new` with the same value, at any depth (fields added since may be new)."""
    if isinstance(old, dict):
        assert isinstance(new, dict), where
        for key, value in old.items():
            assert key in new, f"{where}.{key} was dropped"
            kept(value, new[key], f"{where}.{key}")
    else:
        assert new == old, f"{where}: {old!r} became {new!r}"


@pytest.mark.parametrize("path", SAVED, ids=[p.stem for p in SAVED])
def test_plan_files_of_earlier_releases_load_and_write_back_what_they_said(path):
    plans = json.loads(path.read_text())["plans"]
    assert plans
    for data in plans:
        plan = Plan.from_dict(data)
        kept(data, plan.to_dict())
        assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(path) == Plan.from_dict(plans[0])  # a `plait plan --json` file: its best plan


def _plan(**choices):
    return Plan.of(model=MODEL_PRESETS["tiny-gpt"], train=TrainSpec(global_batch=8, seq_len=64),
                   cluster=CLUSTER_PRESETS["local-cpu"], **choices)


@pytest.mark.parametrize("one, other", [
    (dict(dp=8, sequence_parallel=True), dict(dp=8)),                          # sp means nothing without tp
    (dict(dp=8, schedule="gpipe"), dict(dp=8, schedule="dualpipev")),          # nor a schedule without pp
    (dict(dp=8, tp=2, context_parallel="all_to_all"), dict(dp=8, tp=2)),      # nor the key/value exchange without cp
    (dict(dp=8, grad_sync="micro_batch"), dict(dp=8)),                         # nor when to sync without accumulation
    (dict(tp=8, micro_batch=8, data_parallel="ddp"), dict(tp=8, micro_batch=8)),  # nor a carrier without dp
])
def test_equal_choices_compare_equal(one, other):
    assert _plan(**one) == _plan(**other)
    assert _plan(**one).layout == _plan(**other).layout and hash(_plan(**one).layout) == hash(_plan(**other).layout)
    assert _plan(**one).to_dict() == _plan(**other).to_dict()


def test_a_plan_holds_its_layout_and_reads_it():
    plan = _plan(dp=2, tp=2, pp=2, sequence_parallel=True, zero=1, num_micro_batches=2, micro_batch=2,
                 schedule="gpipe", recompute="selective")
    assert isinstance(plan.layout, Layout) and set(LAYOUT_FIELDS) <= set(plan.to_dict())
    assert (plan.dp, plan.tp, plan.pp, plan.cp, plan.ep) == (2, 2, 2, 1, 1) == tuple(
        getattr(plan.layout, a) for a in ("dp", "tp", "pp", "cp", "ep"))
    assert plan.zero == 1 and plan.sequence_parallel and plan.schedule == "gpipe"
    assert plan.stages_of(1) == plan.stages_of_rank(1) == [1] and plan.rank_of_stage(1) == 1
    assert plan.recompute == ("selective", "selective")
    changed = plan.replace(zero=2, tp=1, micro_batch=1, num_micro_batches=4)
    assert changed.layout == Layout(degrees=Degrees(dp=2, pp=2), zero=2, micro_batch=1, num_micro_batches=4,
                                    schedule="gpipe")
    assert not changed.sequence_parallel and changed.model is plan.model
    with pytest.raises(AttributeError):
        plan.no_such_choice  # noqa: B018


def test_a_bad_choice_is_named():
    with pytest.raises(ValueError, match="zero=5"):
        _plan(dp=8, zero=5)
    with pytest.raises(ValueError, match="global_batch=8"):
        _plan(dp=2, micro_batch=2)
