"""`plait plan` end to end, through a subprocess as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny-gpt", "--cluster", "local-cpu", "--devices", "4", "--global-batch", "8", "--seq-len", "128"]
PLAN_KEYS = {"degrees", "data_parallel", "sequence_parallel", "zero", "recompute", "micro_batch", "num_micro_batches",
             "schedule", "interleave", "layers_per_stage", "stage_groups", "context_parallel", "grad_sync", "model", "train",
             "cluster", "predicted"}


def plait_plan(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "220"}
    return subprocess.run([sys.executable, "-m", "plait", "plan", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One launch covers the table, the JSON file and the report."""
    out = tmp_path_factory.mktemp("plan")
    result = plait_plan(*TINY, "--top", "3", "--json", str(out / "plans.json"), "--report", str(out / "report"))
    assert result.returncode == 0, result.stderr
    return result, out


def test_table_is_printed(tiny_run):
    result, _ = tiny_run
    for header in ("dp×tp×pp", "ZeRO", "recompute", "mb×n", "schedule", "layers/stage", "tokens/s", "MFU",
                   "bubble", "peak GiB"):
        assert header in result.stdout
    assert "tiny-gpt" in result.stdout
    assert "why #1 beats #2:" in result.stdout
    assert "searched" in result.stdout and "candidates" in result.stdout


def test_json_schema_and_round_trip(tiny_run):
    _, out = tiny_run
    document = json.loads((out / "plans.json").read_text())
    assert set(document) == {"plans", "search"}
    assert set(document["search"]) == {"candidates_evaluated", "seconds"}
    assert document["search"]["candidates_evaluated"] >= len(document["plans"]) > 0
    assert len(document["plans"]) <= 3
    times = [p["predicted"]["step_time_s"] for p in document["plans"]]
    assert times == sorted(times)  # best first
    for raw in document["plans"]:
        assert set(raw) == PLAN_KEYS
        d = raw["degrees"]
        assert d["dp"] * d["tp"] * d["pp"] * d["cp"] == 4 and set(d) == {"pp", "dp", "cp", "tp", "ep"}
        assert {"step_time_s", "step_time_parts", "peak_memory_bytes", "memory_parts"} <= set(raw["predicted"])
        assert raw["predicted"]["peak_memory_bytes"] <= raw["cluster"]["memory_bytes"]
    best = Plan.from_json(out / "plans.json")
    assert best.to_dict() == document["plans"][0]
    assert Plan.from_json(best.to_json()) == best


def test_report_writes_three_pngs(tiny_run):
    _, out = tiny_run
    pngs = sorted(p.name for p in (out / "report").glob("*.png"))
    assert pngs == ["candidates.png", "memory.png", "timeline.png"]
    for name in pngs:
        assert (out / "report" / name).read_bytes()[:4] == b"\x89PNG"


def test_pins_are_honoured(tmp_path):
    path = tmp_path / "pinned.json"
    result = plait_plan(*TINY, "--tp", "2", "--pp", "2", "--zero", "1", "--schedule", "gpipe", "--recompute", "full",
                        "--micro-batch", "1", "--no-sequence-parallel", "--top", "10", "--json", str(path))
    assert result.returncode == 0, result.stderr
    plans = json.loads(path.read_text())["plans"]
    assert plans
    for p in plans:
        assert (p["degrees"]["dp"], p["degrees"]["tp"], p["degrees"]["pp"], p["zero"], p["schedule"], p["micro_batch"]) == (1, 2, 2, 1, "gpipe", 1)
        assert p["recompute"] == ["full", "full"] and p["sequence_parallel"] is False


def test_hugging_face_config_and_cluster_file(tmp_path):
    path = tmp_path / "p.json"
    result = plait_plan("--model", "examples/hf/llama-2-7b/config.json", "--cluster",
                        "examples/clusters/a100-cluster.yaml", "--devices", "16", "--global-batch", "64",
                        "--seq-len", "4096", "--top", "2", "--json", str(path))
    assert result.returncode == 0, result.stderr
    best = Plan.from_json(path)
    assert best.model.name == "Llama-2-7b-hf" and best.num_devices == 16 and best.cluster.name == "my-a100s"


@pytest.mark.parametrize("args, named", [
    (["--model", "llama3-7b"], "llama3-7b"),
    (["--model", "no/such/model.yaml"], "no/such/model.yaml"),
    (["--cluster", "a100"], "'a100'"),
    (["--devices", "0"], "'0'"),
    (["--global-batch", "-8"], "'-8'"),
    (["--tp", "3"], "3"),
    (["--dp", "2", "--tp", "1", "--pp", "1", "--cp", "1"], "2"),
    (["--router-imbalance", "0.8"], "'0.8'"),
    (["--router-imbalance", "1.1"], "tiny-gpt has no experts"),
])
def test_bad_input_exits_2_naming_the_value(args, named):
    values = dict(zip(TINY[::2], TINY[1::2]))
    values.update(dict(zip(args[::2], args[1::2])))
    result = plait_plan(*[x for kv in values.items() for x in kv])
    assert result.returncode == 2, result.stdout + result.stderr
    assert named in result.stderr
    assert "Traceback" not in result.stderr


def test_model_that_fits_nowhere_says_by_how_much():
    result = plait_plan("--model", "llama3-405b", "--cluster", "local-cpu", "--devices", "8", "--global-batch", "8",
                        "--seq-len", "128")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "GiB" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


MIXED = ["--cluster", "examples/clusters/mixed-local.yaml", "--global-batch", "8", "--seq-len", "32"]


def test_a_mixed_cluster_that_nothing_fits_is_one_line():
    """A mixed cluster is planned whole: no other device count is searched for, and the miss is against the group's
    memory of the fullest rank."""
    result = plait_plan("--model", "gpt3-175b", *MIXED)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "gpt3-175b fits no plan on mixed cluster mixed-local (fast 2 x 2 GiB, slow 2 x 2 GiB)" in result.stderr
    assert "GiB too much" in result.stderr and "lower seq_len or global_batch" in result.stderr


def test_a_mixed_cluster_refuses_another_device_count():
    result = plait_plan("--model", "tiny-gpt", *MIXED, "--devices", "8")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == ("plait plan: error: num_devices=8: mixed cluster mixed-local is planned whole "
                                     "(fast 2, slow 2); give 4 or leave it out")


MIXTRAL_64 = ["--model", "mixtral-8x7b", "--cluster", "h100-80g", "--devices", "64", "--global-batch", "256",
              "--seq-len", "4096", "--top", "1"]


def test_the_routers_balance_decides_expert_parallelism(tmp_path):
    """Mixtral-8x7B on 64 H100s (Megatron-Core's reference mapping: TP1 EP8 PP4, dp16): with a balanced router
    plait picks expert parallelism over 8 ranks; at the assumed 1.25 the busiest rank's fifth more expert work makes
    tensor parallelism of the experts cheaper."""
    balanced = plait_plan(*MIXTRAL_64, "--router-imbalance", "1.0", "--json", str(tmp_path / "balanced.json"))
    assumed = plait_plan(*MIXTRAL_64, "--json", str(tmp_path / "assumed.json"))
    assert balanced.returncode == 0 and assumed.returncode == 0, balanced.stderr + assumed.stderr
    first = Plan.from_json(tmp_path / "balanced.json")
    assert (first.ep, first.tp) == (8, 1) and first.model.router_imbalance == 1.0
    other = Plan.from_json(tmp_path / "assumed.json")
    assert other.ep == 1 and other.model.router_imbalance == 1.25
    assert first.predicted.step_time_s < other.predicted.step_time_s
