"""Ordinary modules run per operator (no ranks started): the user's file imported as Python imports it, forwards
that make tensors on the default device and read module-level ones, dict batches, a 0-d parameter under
fully_shard, normalisations over split channels, the plan recording where the module comes from, a dry run of the
first step before any rank starts, and every config key under a per-operator run acting or refused in one line."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from plait.operators.planner import auto_plan
from plait.spec.clusters import CLUSTER_PRESETS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "operators"
CPU = CLUSTER_PRESETS["local-cpu"]


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_the_users_file_is_imported_as_python_imports_it_and_only_the_model_is_built_on_meta(tmp_path, monkeypatch):
    """A fixed projection made at the top of the file stays a real CPU tensor although the first import happens
    while plait builds the model on meta (before: a meta tensor, and a CPU tensor times it returned uninitialised
    memory: silent wrong training)."""
    from plait.models.factory import build_factory_module, load_factory

    (tmp_path / "fixed_top.py").write_text(
        "import torch\nPROJECTION = torch.randn(3, 3)\n"
        "def build():\n    return torch.nn.Linear(3, 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with torch.device("meta"):
        load_factory("fixed_top:build")
    model = build_factory_module("fixed_top:build", "meta")
    assert sys.modules["fixed_top"].PROJECTION.device.type == "cpu"
    assert torch.isfinite(sys.modules["fixed_top"].PROJECTION).all()
    assert model.weight.device.type == "meta"


def test_forwards_that_make_tensors_on_the_default_device_and_read_module_constants_are_planned():
    """The graph network multiplies by module-level tensors (a fixed projection and adjacency); the two-tower model
    makes its labels with torch.arange(n) and takes a dict batch. Both are captured on meta and planned (before: a
    40-line traceback from mixing meta and CPU tensors). The plan records the folder the module came from."""
    graph = auto_plan("run_graph:build", "run_graph:batch", CPU, global_batch=8, tp=2)
    tower = auto_plan("run_two_tower:build_small", "run_two_tower:batch", CPU, global_batch=8, dp=2, tp=2)
    assert graph.operators.import_paths == (str(EXAMPLES.resolve()),)
    assert tower.operators.params["logit_scale"] == "R"
    from plait.plan import Plan

    assert Plan.from_json(tower.to_json()).operators.import_paths == tower.operators.import_paths


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_scalar_parameter_and_a_dict_batch_run_under_fully_shard_in_the_dry_run(device, monkeypatch):
    """dp2 x tp2 of the two-tower model, its 0-d logit scale kept out of fully_shard (which refuses scalars: every
    rank crashed there before) and its gradient averaged over dp: the executor's own construction and one
    micro-batch's forward and backward under a fake process group of 4 ranks, on real CPU tensors, or on meta as a
    module beyond REAL_BYTES is (there fully_shard is applied after the step: it cannot run on meta)."""
    import plait.execute.module_dryrun as dryrun

    if device == "meta":
        monkeypatch.setattr(dryrun, "REAL_BYTES", 0)
    plan = auto_plan("run_two_tower:build_small", "run_two_tower:batch", CPU, global_batch=8, dp=2, tp=2)
    [report] = dryrun.dry_run_module(plan)
    assert report.device == device and report.local_bytes < report.full_bytes
    assert report.collectives.get("all_gather", 0) >= (1 if device == "cpu" else 0)  # fully_shard's gathers


def test_a_normalisation_reads_its_statistics_dimensions_whole():
    """GroupNorm on a channel-split input: DTensor runs the forward (gathering inside the op) but, without a rule
    for its backward kernel, the backward failed (`Expected dY.numel() == N * C * HxW`); the executor makes the
    input whole above autograd (NormsReadWhole) and the planner never reads a normalisation's statistics dimensions
    split (plait.operators.norms)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plait.execute.operators import NormsReadWhole
    from plait.operators import norms

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        norm = torch.nn.GroupNorm(4, 16)
        for name in ("weight", "bias"):
            setattr(norm, name, torch.nn.Parameter(distribute_tensor(getattr(norm, name).detach(), mesh,
                                                                     [Replicate()])))
        x = distribute_tensor(torch.randn(2, 16, 4, 4), mesh, [Shard(1)]).requires_grad_()
        with NormsReadWhole():
            out = norm(x)
        out.to_local().sum().backward()  # the gather is above autograd: its backward hands the split back
        assert out.placements == (Replicate(),) and x.grad.placements == (Shard(1),)
    finally:
        dist.destroy_process_group()
    assert norms.reads_split_statistics(norms.aten_statistics_dims("native_group_norm", (x,)), "S1")
    assert not norms.reads_split_statistics(norms.aten_statistics_dims("native_group_norm", (x,)), "S0")
    assert not norms.reads_split_statistics(norms.aten_statistics_dims("native_batch_norm", (x,)), "S1")
    unet = auto_plan("run_unet:build", "run_unet:batch", CPU, global_batch=8, tp=2)
    from plait.execute.module_dryrun import dry_run_module

    assert dry_run_module(unet)[0].device == "cpu"


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    from plait.cli import main as cli_main

    code = cli_main(argv)
    return code, capsys.readouterr().err.strip()


REFUSED_VALUES = {
    "model.preset": '"tiny-gpt"', "model.file": '"model.json"', "model.tp_plan": '{"fc" = "colwise"}',
    "model.weights": '"pretrained"', "data.source": '"text"', "data.path": '"x.txt"', "data.dtype": '"uint16"',
    "data.text_key": '"body"', "data.split": '"validation"', "data.chat": "true", "data.tokenizer": '"byte"',
    "data.cache_dir": '"cache"', "train.seq_len": "64", "plan.adapt": "true", "checkpoint.export_hf": '"hf"',
    "eval.fraction": "0.05", "eval.path": '"val.txt"', "eval.split": '"validation"',
    "model.lora": '{rank = 4, targets = ["fc"]}', "data.packing": '"padded"', "train.document_len": "128",
    "checkpoint.export_adapter": '"adapter"', "islands.outer_lr": "0.5", "islands.outer_momentum": "0.5",
    "islands.nesterov": "false", "islands.inner_steps": "4", "islands.lighthouse": '"localhost:1"',
    "islands.max_restarts": "1", "islands.timeout_s": "10.0", "islands.island": "0",
}
"""A value other than the default for every key MODULE_RUN_KEYS refuses."""


def test_every_config_key_under_a_per_operator_run_acts_or_is_refused_in_one_line(tmp_path, capsys):
    """Every key of every [section] is in MODULE_RUN_KEYS (a new key must say what it does for a module run), and
    each refused one, set, stops `plait train` before any rank starts: exit 2, one line naming the key."""
    from plait.train.config import Config
    from plait.train.module_run import ACTS, MODULE_RUN_KEYS

    keys = {f"{s.name}.{k.name}" for s in dataclasses.fields(Config) for k in dataclasses.fields(s.default_factory)}
    assert keys == set(MODULE_RUN_KEYS)
    refused = {k for k, why in MODULE_RUN_KEYS.items() if why != ACTS}
    assert refused == set(REFUSED_VALUES)
    config = tmp_path / "run.toml"
    config.write_text('[model]\nmodule = "run_graph:build"\n[data]\nbatch = "run_graph:batch"\n')
    for key, value in REFUSED_VALUES.items():
        code, err = _cli(["train", str(config), "--set", f'log.dir="{tmp_path / "log"}"', "--set", f"{key}={value}"],
                         capsys)
        assert code == 2 and len(err.splitlines()) == 1, (key, err)
        assert key.split(".")[1] in err, (key, err)


@pytest.mark.parametrize("source, message", [
    ("def build():\n    return Bad()\nclass Bad(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
     "        self.fc = torch.nn.Linear(4, 2)\n    def forward(self, x):\n        return self.fc(x)\n"
     "def batch(n, generator):\n    return (torch.randn(n, 4, generator=generator),)\n",
     "its forward returned a tensor of shape [4, 2], not a scalar loss"),
    ("def build():\n    return torch.nn.Linear(4, 1)\ndef batch(n):\n    return (torch.randn(n, 4),)\n",
     "must take (batch_size, generator)"),
])
def test_bad_modules_and_batch_factories_are_refused_in_one_line_before_any_rank(tmp_path, monkeypatch, capsys,
                                                                                   source, message):
    name = f"bad_{abs(hash(message)) % 10_000}"
    (tmp_path / f"{name}.py").write_text("import torch\n" + source)
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\nmodule = "{name}:build"\npath = "{tmp_path}"\n[data]\nbatch = "{name}:batch"\n'
                      f'[train]\nglobal_batch = 4\n[plan]\ndevices = 1\n[log]\ndir = "{tmp_path / "log"}"\n')
    code, err = _cli(["train", str(config)], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_check_dry_run_builds_a_per_operator_plan_from_another_working_directory(tmp_path, monkeypatch, capsys):
    """`plait check --dry-run` of a pipeline plan of the graph network (module-level tensors, pp2 x tp2 on 4
    ranks) from a folder that does not hold the module, without it on PYTHONPATH: the plan's import_paths find it,
    and each pipeline rank's first step is built and run here."""
    plan = auto_plan("run_graph:build", "run_graph:batch", CPU, global_batch=8, tp=2, pp=2)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p).resolve() != EXAMPLES.resolve()])
    for module in ("run_graph",):
        monkeypatch.delitem(sys.modules, module)
    out = tmp_path / "dry.json"
    from plait.cli import main as cli_main

    assert cli_main(["check", "--plan", str(path), "--dry-run", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["builds"] and [r["pp_rank"] for r in result["ranks"]] == [0, 1]
    assert all(r["tensors"] == "cpu" for r in result["ranks"])
    assert [r["params"] for r in result["ranks"]] == [10, 10]  # embed + 2 layers | 2 layers + head, of the 20


@pytest.mark.parametrize("example", ["train-dlrm.toml", "train-vit-pp.toml"])
def test_the_per_operator_example_configs_plan_and_dry_run_their_first_step(example):
    """What `plait train` checks before starting ranks, for the shipped per-operator configs: the config's keys,
    its plan from its pins, and the plan's first step on every pipeline rank (the runs themselves:
    tests/dist/test_train_modules.py)."""
    from plait.execute.module_dryrun import dry_run_module
    from plait.train.config import load_config
    from plait.train.module_run import plan_module_run

    config = load_config(EXAMPLES / example)
    plan = plan_module_run(config, None)
    assert plan.operators is not None and plan.num_devices == config.plan.devices
    assert len(dry_run_module(plan)) == plan.pp


def test_the_run_says_when_a_loss_is_not_a_mean_over_its_samples():
    """The two-tower model's in-batch softmax on dp2: each call's negatives are its own 4 samples of the step's 8,
    which `plait train` and `plait check` say when they start; the graph network's node loss is a mean over samples:
    nothing to say."""
    from plait.execute.module_dryrun import samples_note

    tower = auto_plan("run_two_tower:build_small", "run_two_tower:batch", CPU, global_batch=8, dp=2)
    graph = auto_plan("run_graph:build", "run_graph:batch", CPU, global_batch=8, dp=2)
    note = samples_note(tower)
    assert "not a mean over its samples" in note and "its own 4 samples, not the step's 8" in note
    assert samples_note(graph) is None


@pytest.mark.parametrize("rows, ranks", [(2003, 2), (2003, 3), (200_003, 4)])
def test_a_fused_table_split_by_uneven_rows_updates_the_rows_its_shard_holds(rows, ranks):
    """DTensor's Shard(0) splits a row count no degree divides as torch.chunk does (ceil-sized shards, the last
    shorter): the fused lookup's row update finds this rank's first row where DTensor put it (it assumed rows //
    ranks: off by one row per rank before, DIFFERENT under `plait check`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plait.execute.embedding_tables import _first_row

    firsts = []
    for rank in range(ranks):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
        try:
            weight = distribute_tensor(torch.empty(rows, 2, device="meta"), init_device_mesh("cpu", (ranks,)),
                                       [Shard(0)])
            firsts.append((_first_row(weight), weight.to_local().shape[0]))
        finally:
            dist.destroy_process_group()
    assert firsts[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(firsts, firsts[1:]))
    assert firsts[-1][0] + firsts[-1][1] == rows


def test_pins_beside_a_plan_file_are_refused_not_ignored(tmp_path, capsys):
    """plan.pins, plan.cluster and plan.devices plan for plan.file = "auto"; beside a plan file they would go unused:
    `plait train` refuses them in one line (and runs the file alone: here refused only for the pins)."""
    plan = auto_plan("run_graph:build", "run_graph:batch", CPU, global_batch=8, tp=2)
    (tmp_path / "plan.json").write_text(plan.to_json())
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\nmodule = "run_graph:build"\npath = "{EXAMPLES}"\n[data]\nbatch = "run_graph:batch"\n'
                      f'[train]\nglobal_batch = 8\n[plan]\nfile = "{tmp_path / "plan.json"}"\n'
                      f'[log]\ndir = "{tmp_path / "log"}"\n')
    for setting, message in (("plan.pins={tp = 2}", "plan.pins = {'tp': 2} plans for plan.file"),
                             ("plan.devices=4", "plan.devices = 4 but plan.file")):
        code, err = _cli(["train", str(config), "--set", setting], capsys)
        assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_a_module_with_dict_batches_is_searched_without_pipeline_shapes():
    """The two-tower model's batches are a dict: the joint search ranks its dp x tp shapes (pipeline stages take the
    batch as a tuple, so none is offered, and a pinned pp says why in one line)."""
    from plait.errors import ConfigError
    from plait.operators.search import DegreePins, search

    result = search("run_two_tower:build_small", "run_two_tower:batch", CPU, devices=4, global_batch=8)
    assert {(p.dp, p.tp, p.pp) for p in result.plans} == {(1, 4, 1), (2, 2, 1), (4, 1, 1)}
    with pytest.raises(ConfigError, match="pipeline stages take the batch as a tuple"):
        search("run_two_tower:build_small", "run_two_tower:batch", CPU, devices=4, global_batch=8,
               degrees=DegreePins(pp=2))


def test_the_dry_run_of_a_pipeline_issues_each_stage_s_planned_collectives(monkeypatch):
    """Blocks read straight into column-split linears (tests/split_readers.py, Megatron's pattern pinned) on
    pp2 x tp2: each stage's first rank built and stepped under its own fake process group (DTensor's caches of the
    previous group dropped: they named its collectives, "could not resolve the process group"), issuing the
    all-reduces its stage plan prices."""
    from plait.execute.module_dryrun import dry_run_module

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from split_readers import MEGATRON

    plan = auto_plan("split_readers:build", "split_readers:batch", CPU, global_batch=8, tp=2, pp=2, pins=MEGATRON)
    reports = dry_run_module(plan)
    assert [r.collectives for r in reports] == [stage.comm_counts for stage in plan.operators.stages]


def test_a_batch_of_one_tensor_pipelines_as_a_one_tuple(tmp_path, monkeypatch):
    """A batch factory returning one tensor (forward(batch)) is cut into pipeline stages like a tuple of one: planned
    at pp2 and each stage's first step dry-run."""
    from plait.execute.module_dryrun import dry_run_module

    (tmp_path / "one_tensor.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))\n"
        "    def forward(self, x):\n        for b in self.blocks:\n            x = torch.tanh(b(x))\n"
        "        return x.square().mean()\n"
        "def build():\n    return Net()\n"
        "def batch(n, generator):\n    return torch.randn(n, 8, generator=generator)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = auto_plan("one_tensor:build", "one_tensor:batch", CPU, global_batch=8, pp=2)
    assert plan.pp == 2 and [r.pp_rank for r in dry_run_module(plan)] == [0, 1]


def test_a_per_operator_plan_of_accelerators_is_refused_before_any_rank(tmp_path, capsys):
    """The per-operator executor builds CPU meshes over gloo: a plan for GPUs is planned and priced, and refused in
    one line by `plait check` (and `plait train`) rather than started."""
    from plait.spec.clusters import CLUSTER_PRESETS as PRESETS

    plan = auto_plan("run_graph:build", "run_graph:batch", PRESETS["a100-40g"], global_batch=8, tp=2)
    (tmp_path / "plan.json").write_text(plan.to_json())
    code, err = _cli(["check", "--plan", str(tmp_path / "plan.json")], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "run on CPU ranks (gloo) only" in err, err


def test_a_ranking_emits_only_plans_whose_first_step_runs():
    """A plan that would crash (here a 0-d parameter placed split, by hand) is left out of what a search emits, with
    its reason; the next plan is taken (plait train) or written (plait plan --json); none runnable: refused."""
    from plait.errors import ConfigError
    from plait.execute.module_dryrun import runnable

    good = auto_plan("run_two_tower:build_small", "run_two_tower:batch", CPU, global_batch=8, tp=2)
    bad = good.replace(operators=dataclasses.replace(good.operators,
                                                     params={**good.operators.params, "logit_scale": "S0"}))
    kept, refused = runnable([bad, good], 1)
    assert kept == [good] and len(refused) == 1 and "cannot run the plan" in refused[0]
    with pytest.raises(ConfigError, match="cannot run the plan"):
        runnable([bad])


def test_zero_recompute_and_accumulation_pins_plan_and_dry_run_and_bad_ones_are_refused(tmp_path, capsys):
    """[plan] pins the ZeRO stage, recompute and the micro-batches of a step without a pipeline: the plan holds
    them and its first step builds and runs (DDP with ZeroRedundancyOptimizer's stage, the graph network's layers
    checkpointed, two micro-batches); a ZeRO stage that is none, or recompute under a pipeline, is refused in one
    line."""
    from plait.execute.module_dryrun import dry_run_module
    from plait.train.config import load_config
    from plait.train.module_run import plan_module_run

    config = tmp_path / "run.toml"
    head = '[model]\nmodule = "run_graph:build"\n[data]\nbatch = "run_graph:batch"\n[train]\nglobal_batch = 8\n'
    config.write_text(head + '[plan]\ndevices = 2\npins = {dp = 2, zero = 1, recompute = "full", '
                             'num_micro_batches = 2}\n')
    plan = plan_module_run(load_config(config), None)
    assert (plan.dp, plan.zero, plan.recompute, plan.num_micro_batches) == (2, 1, ("full",), 2)
    assert plan.dp_mode.carrier == "ddp" and plan.operators.blocks == "layers"
    assert len(dry_run_module(plan)) == 1
    for pins, message in (("{zero = 5}", "plan.pins zero = 5 must be a ZeRO stage"),
                          ('{pp = 2, recompute = "full"}', "per-operator recomputation runs without a pipeline")):
        config.write_text(head + f'[plan]\ndevices = 2\npins = {pins}\n[log]\ndir = "{tmp_path / "log"}"\n')
        code, err = _cli(["train", str(config)], capsys)
        assert code == 2 and len(err.splitlines()) == 1 and message in err, err
