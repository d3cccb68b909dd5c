"""What a user can get wrong, refused before any work with one line naming the value (exit 2), and figures
that stay within physics: output locations, conflicting config keys, plans for other machines, fault specs,
resumed metrics, fits of noisy timings, hung-rank reports. Each through the real entry point, in process."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from plait.cli import main as cli_main
from plait.errors import ConfigError, PlaitError
from plait.plan import Plan
from plait.spec import TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.models import MODEL_PRESETS

UNWRITABLE = "/proc/plait-cannot-write-here"  # procfs takes no new files, not even from root


def run(argv: list[str], capsys) -> tuple[int, str]:
    code = cli_main(argv)
    err = capsys.readouterr().err
    return code, err


def one_error(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "warning:" not in line]
    assert len(lines) == 1 and lines[0].startswith(f"plait {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


# ---- output locations: one check, every command, before any work ----------------------------------
@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "in-the-way"
    path.write_text("not a folder")
    return path


@pytest.mark.parametrize("kind", ["under a file", "unwritable", "folder for a file"])
def test_plan_outputs_are_checked_before_the_search(kind, a_file, tmp_path, capsys):
    target = {"under a file": a_file / "plans.json", "unwritable": Path(UNWRITABLE) / "plans.json",
              "folder for a file": tmp_path}[kind]
    code, err = run(["plan", "--model", "gpt3-175b", "--cluster", "a100-80g", "--devices", "1024", "--global-batch",
                     "1536", "--seq-len", "2048", "--json", str(target)], capsys)
    assert code == 2
    assert str(target) in one_error(err, "plan")


def test_every_command_refuses_an_output_under_a_file(a_file, tmp_path, capsys, no_launch):
    config = tmp_path / "run.toml"
    config.write_text("[train]\nsteps = 2\n")
    plan = tmp_path / "plan.json"
    plan.write_text(Plan.of(dp=2, micro_batch=4, model=MODEL_PRESETS["tiny-gpt"],
                            train=TrainSpec(global_batch=8, seq_len=64), cluster=CLUSTER_PRESETS["local-cpu"]).to_json())
    bad = str(a_file / "x")
    cases = {
        "plan": ["plan", "--model", "tiny-gpt", "--cluster", "local-cpu", "--global-batch", "8", "--seq-len", "64",
                 "--report", bad],
        "check": ["check", "--plan", str(plan), "--json", bad],
        "train": ["train", str(config), "--log-dir", bad],
        "profile": ["profile", "--nproc", "2", "--out", bad],
        "tune": ["tune", "--model", "tiny-gpt", "--out", bad],
        "demo": ["demo", "--log-dir", bad],
    }
    for command, argv in cases.items():
        code, err = run(argv, capsys)
        assert code == 2, (command, err)
        line = one_error(err, command)
        assert bad in line and "is a file" in line, line
    code, err = run(["train", str(config), "--set", f'checkpoint.dir="{a_file}"'], capsys)
    assert code == 2 and "checkpoint.dir" in one_error(err, "train")
    code, err = run(["profile", "--nproc", "2", "--out", str(tmp_path / "c.yaml"), "--samples", UNWRITABLE + "/s.json"],
                    capsys)
    assert code == 2 and "--samples" in one_error(err, "profile")


def test_output_checks_create_nothing(tmp_path):
    from plait.outputs import output_dir, output_file

    assert output_file(tmp_path / "new" / "deeper" / "out.json", "--json") == tmp_path / "new" / "deeper" / "out.json"
    assert output_dir(tmp_path / "logs", "log.dir") == tmp_path / "logs"
    assert list(tmp_path.iterdir()) == []  # not even the probe file is left
    with pytest.raises(ConfigError, match="is empty"):
        output_file("  ", "--out")


# ---- config keys that contradict each other, and plans meant for other machines --------------------
def test_model_named_twice_is_refused(tmp_path, capsys):
    config = tmp_path / "both.toml"
    config.write_text('[model]\npreset = "tiny-gpt"\nfile = "model.json"\n')
    code, err = run(["train", str(config)], capsys)
    assert code == 2
    line = one_error(err, "train")
    assert "preset='tiny-gpt'" in line and "file='model.json'" in line


def test_start_over_needs_resume(tmp_path, capsys):
    config = tmp_path / "r.toml"
    config.write_text("[checkpoint]\ndir = 'ck'\nstart_over = true\n")
    code, err = run(["train", str(config)], capsys)
    assert code == 2 and "start_over=true applies when resuming" in one_error(err, "train")


def test_a_gpu_plan_is_not_started_as_local_cpu_processes(tmp_path, capsys, no_launch):
    plan = Plan.of(dp=64, micro_batch=1, model=MODEL_PRESETS["tiny-gpt"], train=TrainSpec(global_batch=64, seq_len=64),
                   cluster=CLUSTER_PRESETS["a100-80g"].with_devices(64))
    (tmp_path / "plan.json").write_text(plan.to_json())
    config = tmp_path / "run.toml"
    config.write_text(f"[train]\nglobal_batch = 64\nseq_len = 64\n[plan]\nfile = '{tmp_path / 'plan.json'}'\n"
                      f"[log]\ndir = '{tmp_path / 'log'}'\n")
    code, err = run(["train", str(config)], capsys)
    import torch

    if torch.cuda.device_count() >= 64:  # a machine that can run it: the launcher is reached
        pytest.fail("this test needs a machine with fewer than 64 GPUs")
    assert code == 2
    assert "the plan is for 64 GPUs" in one_error(err, "train")


@pytest.mark.parametrize("spec, fires", [("kill:rank=5:step=1", False), ("kill:rank=1:step=99", False),
                                         ("kill:rank=1:step=1", True), ("nonsense", False)])
def test_fault_specs_are_checked_before_ranks_start(spec, fires, tmp_path, capsys, no_launch, monkeypatch):
    """A fault that would never fire is refused; one that would fires without a checkpoint dir too."""
    monkeypatch.setenv("PLAIT_FAULT", spec)
    config = tmp_path / "run.toml"
    config.write_text(f"[train]\nsteps = 3\n[log]\ndir = '{tmp_path / 'log'}'\n")
    if fires:
        with pytest.raises(no_launch):
            cli_main(["train", str(config), "--nproc", "2"])
        return
    code, err = run(["train", str(config), "--nproc", "2"], capsys)
    assert code == 2 and "PLAIT_FAULT" in one_error(err, "train")


def test_interleave_without_a_pipeline_is_refused(capsys):
    from plait import legality

    assert [v.rule for v in legality.interleave_problems(1, 2)] == ["interleave-needs-pp"]
    assert legality.interleave_problems(2, 2) == [] and legality.interleave_problems(1, 1) == []
    base = ["plan", "--model", "tiny-gpt", "--cluster", "local-cpu", "--devices", "2", "--global-batch", "8",
            "--seq-len", "64", "--interleave", "2"]
    code, err = run(base + ["--pp", "1"], capsys)
    assert code == 2 and "interleave-needs-pp" in one_error(err, "plan")
    code = cli_main(base)  # without a pp pin: only pipelined plans, every one interleaved
    out = capsys.readouterr().out
    assert code == 0 and "interleaved v2" in out and "1×1×1" not in out and "2×1×1" not in out


def test_plan_on_a_cpu_cluster_prices_what_runs(capsys):
    code = cli_main(["plan", "--model", "tiny-gpt", "--cluster", "local-cpu", "--devices", "2", "--global-batch", "8",
                     "--seq-len", "64"])
    out = capsys.readouterr().out
    assert code == 0 and "8×64 fp32" in out and "bf16" not in out


def test_hand_written_plan_may_name_presets():
    plan = Plan.from_dict({"degrees": {"dp": 2}, "micro_batch": 4, "model": "tiny-gpt", "cluster": "local-cpu",
                           "train": {"global_batch": 8, "seq_len": 64}})
    assert plan.cluster.name == "local-cpu" and plan.cluster.num_devices == 2 and plan.model.name == "tiny-gpt"
    with pytest.raises(ConfigError, match="no-such-cluster"):
        Plan.from_dict({"degrees": {"dp": 2}, "micro_batch": 4, "model": "tiny-gpt", "cluster": "no-such-cluster",
                        "train": {"global_batch": 8, "seq_len": 64}})


@pytest.mark.parametrize("dry_run", [False, True])
def test_check_refuses_malformed_json_without_importing_torch(tmp_path, dry_run):
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    code = ("import sys\nfrom plait.cli import main\n"
            f"code = main(['check', '--plan', {str(bad)!r}] + {['--dry-run'] if dry_run else []!r})\n"
            "print(code, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "False"], out.stderr
    assert "not valid JSON" in out.stderr and "Traceback" not in out.stderr


def test_empty_data_file_is_named(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    config = tmp_path / "run.toml"
    config.write_text(f"[data]\nsource = 'text'\npath = '{tmp_path / 'empty.txt'}'\n[log]\ndir = '{tmp_path / 'l'}'\n")
    code, err = run(["train", str(config)], capsys)
    assert code == 2 and "empty.txt" in one_error(err, "train") and "is empty" in err


# ---- what a resumed run shows --------------------------------------------------------------------
def test_resumed_metrics_keep_each_step_once(tmp_path):
    from plait.train.metrics import MetricsLog, StepMetrics

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": step, "loss": 5.0 - step}) for step in range(1, 21)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 21, "lo')  # a line cut short by the kill
    log = MetricsLog(path, enabled=True, resumed_at=16)  # the last checkpoint was step 16
    log.write(StepMetrics(step=17, loss=0.5, lr=1e-3, grad_norm=None, step_time_s=0.1, tokens_per_s=1.0, mfu=0.1,
                          tokens=17, elapsed_s=1.0))
    log.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(1, 18))


def test_loss_plot_never_runs_back_in_time(tmp_path):
    from plait.report.curves import _series

    records = [{"step": s, "loss": 1.0} for s in range(1, 21)] + [{"step": s, "loss": 0.5} for s in range(16, 23)]
    steps, losses = _series(records, ("loss",))
    assert steps == sorted(steps) and len(steps) == len(set(steps)) == 22
    assert losses[steps.index(18)] == 0.5  # the resumed run's value of a step logged twice


# ---- fits within physics -------------------------------------------------------------------------
def _tune_plans(nproc: int = 2) -> tuple[list, object]:
    import argparse

    from plait.profile.tuning import candidate_plans, resolve_cluster

    cluster = resolve_cluster(None, nproc)
    args = argparse.Namespace(model="tiny-gpt", global_batch=8, seq_len=128, top=4)
    return candidate_plans(args, cluster, nproc), cluster


@pytest.mark.parametrize("seed", range(4))
def test_tune_cannot_write_an_efficiency_above_one_or_a_negative_bandwidth(seed, tmp_path, capsys):
    """Noisy timings (steps 0.05x to 5x what the cost model predicts, some absurdly fast) through `plait tune`'s
    fitting and writing: the file it writes, if any, holds figures a machine can have."""
    from plait.profile.tuning import _predicted, report_and_write
    from plait.profile.clusterfile import read_cluster_file
    from plait.profile.tune import Measured

    plans, cluster = _tune_plans()
    rng = np.random.default_rng(seed)
    results = []
    for plan in plans:
        predicted = _predicted(plan, cluster).step_time_s
        scale = 0.05 if rng.random() < 0.3 else math.exp(rng.uniform(math.log(0.2), math.log(5)))
        results.append(Measured(label=plan.describe(),
                                step_times_s=tuple(predicted * scale * rng.uniform(0.5, 1.5, size=3))))
    out = tmp_path / "tuned.yaml"
    try:
        report_and_write(plans, results, cluster, out, tmp_path / "tuned.png")
    except PlaitError as refusal:
        assert "no better" in str(refusal) and not out.exists()
        return
    tuned = read_cluster_file(out)
    raw = yaml.safe_load(out.read_text())
    assert 0 < tuned.efficiency.matmul <= 1 and raw["efficiency"]["matmul"] <= 1
    for link in (tuned.intra_node, tuned.inter_node):
        assert link.bandwidth > 0 and link.latency_s >= 0
    from plait.profile.terms import HOST_TERMS

    assert all(getattr(tuned.host, f"{term}_s") >= 0 for term in HOST_TERMS)
    for plan in plans:  # and no plan priced on it runs faster than its FLOPs at peak, with nothing else to pay
        assert _predicted(plan, tuned).mfu <= _predicted(plan, _at_peak_and_free(cluster)).mfu * (1 + 1e-9)
    capsys.readouterr()


def _at_peak_and_free(cluster):
    """`cluster` with GEMMs at peak and no host time or link cost: the fastest any plan can be priced. (Its MFU may
    top 100% a little: MFU counts causal attention whole, the fused kernels the cost model prices skip half.)"""
    import dataclasses

    from plait.spec.cluster import HostOverheads

    free = dataclasses.replace(cluster.intra_node, latency_s=0.0, bandwidth=1e30)
    return cluster.replace(efficiency=dataclasses.replace(cluster.efficiency, matmul=1.0, overhead=0.0),
                           host=HostOverheads(), intra_node=free, inter_node=free)


def test_a_datasheet_peak_caps_the_fit_and_says_so():
    from plait.profile.terms import Observation, fit_terms, predicted_step

    plans, cpu = _tune_plans()
    gpu = cpu.replace(device_type="cuda", backend="nccl")
    fast = [Observation(plan=p.replace(cluster=gpu), measured_s=predicted_step(p, gpu) / 3) for p in plans]
    fit = fit_terms(fast, gpu)
    assert fit.cluster.efficiency.matmul <= 1.0 and fit.cluster.peak_flops == gpu.peak_flops
    assert any("held at efficiency.matmul = 1" in note for note in fit.notes)
    # on a CPU too: its peak is the GEMM rate plait profile measured, which a step cannot beat either
    fit = fit_terms([Observation(plan=p, measured_s=o.measured_s) for p, o in zip(plans, fast)], cpu)
    assert fit.cluster.efficiency.matmul <= 1.0 and fit.cluster.peak_flops == cpu.peak_flops
    assert any("held at efficiency.matmul = 1" in note and "peak_flops" in note for note in fit.notes)


def test_tune_refuses_a_fit_that_explains_nothing(tmp_path, capsys, monkeypatch):
    import plait.profile.terms as calibrate
    from plait.profile.tuning import report_and_write
    from plait.profile.tune import Measured

    plans, cluster = _tune_plans()
    real = calibrate.fit_terms

    def no_better(observations, cluster_, *args, **kwargs):  # what a fit of pure noise comes to
        fit = real(observations, cluster_, *args, **kwargs)
        return calibrate.TermFit(cluster=fit.cluster, before=fit.before, after=fit.after, fitted=fit.fitted,
                                 errors_before=fit.errors_before, errors_after=fit.errors_before, rounds=fit.rounds)

    monkeypatch.setattr(calibrate, "fit_terms", no_better)
    results = [Measured(label=p.describe(), step_times_s=(0.1, 0.1)) for p in plans]
    out = tmp_path / "tuned.yaml"
    with pytest.raises(PlaitError, match="no better.*--steps.*--top"):
        report_and_write(plans, results, cluster, out, tmp_path / "p.png")
    assert not out.exists()
    capsys.readouterr()


def test_profile_peak_is_never_below_a_measured_rate():
    from plait.profile.calibrate import _link_notes, _peak_and_matmul
    from plait.profile.fit import ComputeSample, LinkFit

    gemms = [ComputeSample(name="proj", hidden_size=h, flops=1e9, seconds=s)
             for h, s in ((128, 0.05), (256, 0.04), (512, 0.006), (1024, 0.03))]  # one timing far too fast
    peak, matmul = _peak_and_matmul(gemms, None, fastest=max(g.flops_per_s for g in gemms))
    assert peak >= max(g.flops_per_s for g in gemms) * 0.9999 and 0 < matmul.matmul <= 1
    peak, matmul = _peak_and_matmul(gemms, 1e10)  # a datasheet peak the timings beat
    assert peak == 1e10 and matmul.matmul <= 1
    poor = LinkFit(latency_s=1e-5, bandwidth=1e9, r2=-0.054, max_rel_residual=2.0, median_rel_residual=0.6,
                   num_samples=20)
    notes = _link_notes({"intra_node": poor}, SimpleNamespace(comm={"intra_node": ()}))
    assert len(notes) == 1 and "explains nothing" in notes[0] and "R² -0.05" in notes[0] and "rerun" in notes[0]


# ---- the launcher's summary ------------------------------------------------------------------------
def test_a_hung_rank_is_named_not_the_one_that_waited(capsys):
    from plait.runtime.launch import _report_failure

    def info(code, sig):
        return SimpleNamespace(exitcode=code, signal_name=lambda: sig)

    failure = SimpleNamespace(failures={0: info(1, "Signals.0"), 1: info(-15, "SIGTERM")})
    notes = {0: {"time_ns": 5, "error": "RuntimeError: Timed out waiting 10000ms for send operation to complete",
                 "progress": {"label": "step 2", "count": 2}},
             1: {"progress": {"label": "step 1", "count": 1}}}
    _report_failure(failure, notes)
    err = capsys.readouterr().err
    assert "plait: rank 1 hung (last began step 1)" in err
    assert "rank 0 timed out waiting" in err and "rank 0 failed" not in err


def test_a_lost_peer_is_one_essential_line():
    from plait.runtime.launch import essential_line

    error = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                         "by peer [127.0.0.1]:7090. This is typically caused by a remote worker crashing.")
    line = essential_line(error)
    assert line.startswith("RuntimeError: Connection closed by peer") and "\n" not in line and "pair.cc" not in line


def test_profile_tables_are_whole_when_not_on_a_terminal(capsys):
    """Piped (CI, a file, `| less`), rich would assume 80 columns and cut 'intra_no…', 'all_redu…'."""
    from test_profile_fit import synthetic_measurements

    from plait.profile.calibrate import calibrate
    from plait.profile.report import print_report

    m = synthetic_measurements()
    print_report(m, calibrate(m))
    out = capsys.readouterr().out
    assert "…" not in out
    for word in ("intra_node", "all_reduce", "all_gather", "reduce_scatter", "bus GB/s at largest",
                 "level fit max rel err"):
        assert word in out, word
    compute = out.split("compute per rank")[1].split("link fits")[0]
    shares = [int(share) for share in re.findall(r"\((\d+)%\)", compute)]
    assert shares and max(shares) <= 100  # no operation runs above the peak
