"""Training across islands, measured: DiLoCo against synchronous data parallelism over the same slow link.

Two islands of two CPU processes each (examples/clusters/islands-local.yaml: the figures inside an island are this
machine's quick profile, `plait profile --quick --nproc 4`, cached), the link between them emulated at --bandwidth
and --latency (plait holds every exchange for the time the link gives it: plait/runtime/throttle.py's rule, in
plait/train/islands.py). For each model (the demo's tiny-gpt, and tiny-llama), plait plans the islands (the
inner plan, and DiLoCo's H: the smallest that hides its exchange, or --inner-steps), then `plait train` runs

* sync: the same inner plan, gradients all-reduced across the islands every step (torchft, fault-tolerant HSDP);
* diloco: the plan as chosen (torchft's DiLoCo, outer Nesterov SGD, lr 0.7, momentum 0.9: --outer-lr,
  --outer-momentum),

for the same steps over the same global batches (equal tokens). Printed and saved under --out: the loss curves
side by side (islands.png; the loss of a step is the mean of the islands' losses over their rows, which together
are the global batch), the final loss gap (mean of the last --tail steps), bytes over the link per step measured
(counted from the tensors each rank all-reduced across islands, as a ring sends them) against predicted, and
tokens/s measured (after --warmup steps) against predicted (the plan's prediction on the quick profile).

    python benchmarks/islands.py [--models tiny-gpt tiny-llama] [--steps 150] [--bandwidth 10e6] [--latency 5e-3]

With --faults it measures instead what a failure costs (the figures plait/cost/failures.py prices with), on the
first model, saved as faults.json:

* recovery: the islands' run (DiLoCo as planned, checkpoints every --every steps) with island 1's ranks SIGKILLed
  from outside once it logged step --kill-at; island 0 must train on without a restart, island 1's launcher restarts
  it and it takes the weights from a peer: recovery = the time of its "rejoined" event - the kill;
* restart: the same model as one job (a plain data-parallel plan over the 4 ranks, no islands), rank 1 SIGKILLed
  (PLAIT_FAULT) right after the checkpoint of step --kill-at, --max-restarts 1: restart = when the first step after
  the restart was logged - when the killed step was, less one step's time;
* save: the seconds each checkpoint write stalled the islands' training (their "saved" events).

    python benchmarks/islands.py --faults [--steps 100] [--kill-at 20] [--every 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CLUSTER = ROOT / "examples" / "clusters" / "islands-local.yaml"
RANKS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-gpt", "tiny-llama"])
    parser.add_argument("--steps", type=int, default=150, help="inner steps of each run (equal tokens)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--bandwidth", type=float, default=10e6, help="the islands' link, bytes/s (default 10 MB/s)")
    parser.add_argument("--latency", type=float, default=5e-3, help="the islands' link, seconds per message")
    parser.add_argument("--inner-steps", type=int, default=0, help="DiLoCo's H (0: the planner's choice)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate (islands.outer_lr)")
    parser.add_argument("--outer-momentum", type=float, default=0.9,
                        help="DiLoCo's outer Nesterov momentum (islands.outer_momentum)")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s")
    parser.add_argument("--tail", type=int, default=10, help="final loss: the mean of the last this many steps")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "islands")
    parser.add_argument("--no-profile", action="store_true", help="plan on the uncalibrated local-cpu preset")
    parser.add_argument("--faults", action="store_true", help="measure recovery, restart and save times instead")
    parser.add_argument("--runs", type=Path, default=None,
                        help="where the runs train (default: a temporary folder; their metrics are copied to --out)")
    parser.add_argument("--kill-at", type=int, default=20, help="--faults: the step after which ranks are killed")
    parser.add_argument("--every", type=int, default=10, help="--faults: checkpoint every this many steps")
    return parser.parse_args(argv)


def cluster_of(args: argparse.Namespace):
    """islands-local.yaml with this machine's quick profile inside the islands and the link of the arguments."""
    from plait.spec import LinkSpec
    from plait.spec.load import load_cluster

    base = load_cluster(CLUSTER)
    if not args.no_profile:
        from plait.profile.cache import cached_profile, machine_key, profile_path
        from plait.profile.quick import quick_profile

        key = machine_key(RANKS)
        path = cached_profile(key)
        if path is None:
            path = profile_path(key)
            failure = quick_profile(RANKS, path)
            if failure:
                raise SystemExit(f"the quick profile failed: {failure}")
        measured = load_cluster(path)
        base = dataclasses.replace(measured, name="islands-local (profiled)", num_devices=RANKS,
                                   devices_per_node=RANKS, islands=base.islands, failures=base.failures)
    link = LinkSpec(latency_s=args.latency, bandwidth=args.bandwidth)
    return dataclasses.replace(base, islands=dataclasses.replace(base.islands, link=link, emulate=True))


def plans_for(model_name: str, cluster, args: argparse.Namespace) -> dict:
    from plait.plan import IslandPlan
    from plait.search.islands import IslandPins, plan_islands
    from plait.spec.load import load_model, load_train

    train = load_train(global_batch=args.global_batch, seq_len=args.seq_len, precision="fp32")
    pins = IslandPins(method="diloco", inner_steps=args.inner_steps or None)
    choice = plan_islands(load_model(model_name), cluster, train, top=1, island_pins=pins)
    diloco = choice.plans[0]
    sync_cost = choice.sync
    sync = dataclasses.replace(diloco, islands=IslandPlan(count=2, method="sync"),
                               predicted=dataclasses.replace(
                                   diloco.predicted, step_time_s=sync_cost.step_time_s,
                                   tokens_per_s=sync_cost.tokens_per_s,
                                   link_bytes_per_step=sync_cost.link_bytes_per_step,
                                   link_busy_fraction=sync_cost.link_busy_fraction))
    return {"sync": sync, "diloco": diloco}


def train_argv(plan, model_name: str, run: Path, args: argparse.Namespace, extra: list[str] = ()) -> list[str]:
    import shutil

    shutil.rmtree(run, ignore_errors=True)  # a run of its own: no metrics or checkpoints of an earlier one
    run.mkdir(parents=True)
    plan_path = run / "plan.json"
    plan_path.write_text(plan.to_json())
    sets = [f'model.preset="{model_name}"', f'plan.file="{plan_path}"', f"train.steps={args.steps}",
            f"train.global_batch={args.global_batch}", f"train.seq_len={args.seq_len}", "optimizer.lr=3e-3",
            "optimizer.warmup=10", f'log.dir="{run}"', "log.progress=false", f"islands.outer_lr={args.outer_lr}",
            f"islands.outer_momentum={args.outer_momentum}", *extra]
    config = run / "run.toml"
    config.write_text("[data]\nsource = \"shipped\"\n")
    argv = [sys.executable, "-m", "plait", "train", str(config)]
    for item in sets:
        argv += ["--set", item]
    return argv


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1"}


def train(plan, model_name: str, method: str, args: argparse.Namespace, folder: Path) -> dict:
    """`plait train` of `plan`; the islands' metrics and link reports."""
    run = folder / f"{model_name}-{method}"
    argv = train_argv(plan, model_name, run, args)
    began = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{model_name} {method} failed:\n{done.stderr[-3000:]}")
    islands = []
    for i in range(plan.islands.count):
        kept = args.out / "runs" / run.name / f"island{i}"
        kept.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "link.json"):  # the evidence, without the run's checkpoints
            (kept / name).write_text((run / f"island{i}" / name).read_text())
        lines = (run / f"island{i}" / "metrics.jsonl").read_text().splitlines()
        islands.append({"metrics": [json.loads(line) for line in lines],
                        "link": json.loads((run / f"island{i}" / "link.json").read_text())})
    return {"islands": islands, "wall_s": time.perf_counter() - began}


def summarize(plan, result: dict, args: argparse.Namespace) -> dict:
    islands = result["islands"]
    steps = min(len(i["metrics"]) for i in islands)
    losses = [statistics.fmean(i["metrics"][k]["loss"] for i in islands) for k in range(steps)]
    # tokens/s of the whole run after the warm-up: every island's rows of a step, over the slower island's time
    elapsed = max(i["metrics"][steps - 1]["elapsed_s"] - i["metrics"][args.warmup - 1]["elapsed_s"] for i in islands)
    tokens = (steps - args.warmup) * args.global_batch * args.seq_len
    sent = statistics.fmean(i["link"]["bytes_sent"] / i["link"]["steps"] for i in islands)
    return {"plan": plan.describe(), "losses": losses, "final_loss": statistics.fmean(losses[-args.tail:]),
            "tokens_per_s": tokens / elapsed, "predicted_tokens_per_s": plan.predicted.tokens_per_s,
            "link_bytes_per_step": sent, "predicted_link_bytes_per_step": plan.predicted.link_bytes_per_step,
            "held_s": max(i["link"]["held_s"] for i in islands), "wall_s": result["wall_s"]}


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), squeeze=False)
    for ax, (model, methods) in zip(axes[0], rows.items()):
        for method, summary in methods.items():
            label = f"{method}: {summary['plan'].split(' islands2 ')[-1]}"  # the exchange (IslandPlan.exchange)
            ax.plot(range(1, len(summary["losses"]) + 1), summary["losses"], label=label)
        ax.set_title(f"{model}: 2 islands x 2 ranks, equal tokens")
        ax.set_xlabel("inner step")
        ax.set_ylabel("loss (mean of the islands')")
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows: dict, args: argparse.Namespace):
    from rich.table import Table

    out = Table(title=f"2 islands x 2 CPU ranks, link {args.bandwidth / 1e6:g} MB/s and {args.latency * 1e3:g} ms "
                      f"(emulated), {args.steps} steps of {args.global_batch}x{args.seq_len} tokens")
    for column in ("model", "method", "plan", "final loss", "gap vs sync", "tokens/s", "predicted", "ratio",
                   "link B/step", "predicted B/step", "ratio B"):
        out.add_column(column, justify="left" if column in ("model", "method", "plan") else "right")
    for model, methods in rows.items():
        for method, s in methods.items():
            gap = s["final_loss"] - methods["sync"]["final_loss"]
            out.add_row(model, method, s["plan"].split(" islands2 ")[-1], f"{s['final_loss']:.4f}", f"{gap:+.4f}",
                        f"{s['tokens_per_s']:,.0f}", f"{s['predicted_tokens_per_s']:,.0f}",
                        f"{s['tokens_per_s'] / s['predicted_tokens_per_s']:.2f}",
                        f"{s['link_bytes_per_step'] / 1e6:.3f} MB",
                        f"{s['predicted_link_bytes_per_step'] / 1e6:.3f} MB",
                        f"{s['link_bytes_per_step'] / s['predicted_link_bytes_per_step']:.3f}")
    return out


def runs_folder(args: argparse.Namespace) -> Path:
    import tempfile

    if args.runs is None:
        args.runs = Path(tempfile.mkdtemp(prefix="plait-islands-bench-"))
    return args.runs


# ---- --faults ------------------------------------------------------------------------------------------------
def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def island_ranks(island: int) -> list[int]:
    """Process ids of the ranks of `island` (their command line names it; torchrun's RANK is in their env)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"islands.island={island}".encode() in cmdline and any(v.startswith(b"RANK=") for v in environ):
            pids.append(int(entry.name))
    return pids


def wait_for(predicate, timeout_s: float = 900.0, every: float = 0.05) -> float:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting")
        time.sleep(every)
    return time.time()


def measure_recovery(plan, model: str, args: argparse.Namespace, folder: Path) -> dict:
    import signal

    run = folder / f"{model}-faults-islands"
    argv = train_argv(plan, model, run, args, [f'checkpoint.dir="{run / "ckpt"}"', f"checkpoint.every={args.every}"])
    process = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lost = run / "island1" / "metrics.jsonl"
    wait_for(lambda: any(r.get("step", 0) >= args.kill_at and "loss" in r for r in records(lost)))
    pids = island_ranks(1)
    killed_at = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _, err = process.communicate(timeout=3600)
    if process.returncode != 0:
        raise SystemExit(f"the islands' run with a killed island failed:\n{err[-3000:]}")
    survivor, back = records(run / "island0" / "metrics.jsonl"), records(lost)
    rejoined = [r for r in back if r.get("event") == "rejoined"]
    steps0 = [r["step"] for r in survivor if "loss" in r]
    saves = [r["seconds"] for r in survivor + back if r.get("event") == "saved"]
    return {"killed_ranks": pids, "recovery_s": rejoined[0]["time"] - killed_at if rejoined else None,
            "rejoined_at_step": rejoined[0]["step"] if rejoined else None,
            "survivor_steps_once": steps0 == list(range(1, args.steps + 1)),
            "survivor_restarted": any(r.get("event") == "rejoined" for r in survivor),
            "save_s": statistics.median(saves) if saves else None, "saves": saves}


def measure_restart(plan, model: str, args: argparse.Namespace, folder: Path) -> dict:
    from plait.plan import Plan

    one_job = Plan.of(dp=RANKS, zero=plan.zero, model=plan.model, cluster=plan.cluster.island_view().with_devices(RANKS)
                      .replace(islands=None), train=plan.train, micro_batch=args.global_batch // RANKS)
    run = folder / f"{model}-faults-one-job"
    argv = train_argv(one_job, model, run, args, [f'checkpoint.dir="{run / "ckpt"}"', f"checkpoint.every={args.every}"])
    argv += ["--max-restarts", "1"]
    env = {**ENV, "PLAIT_FAULT": f"kill:rank=1:step={args.kill_at}"}
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    killed = wait_for(lambda: any(r.get("step", 0) >= args.kill_at for r in records(metrics)))
    back = wait_for(lambda: any(r.get("step", 0) == args.kill_at + 1 for r in records(metrics)))
    _, err = process.communicate(timeout=3600)
    if process.returncode != 0:
        raise SystemExit(f"the one-job run with a killed rank failed:\n{err[-3000:]}")
    step_s = statistics.median(r["step_time_s"] for r in records(metrics))
    return {"restart_s": back - killed - step_s, "step_s": step_s, "plan": one_job.describe()}


def faults(args: argparse.Namespace, cluster) -> int:
    from rich.console import Console

    model = args.models[0]
    plan = plans_for(model, cluster, args)["diloco"]
    folder = runs_folder(args)
    recovery = measure_recovery(plan, model, args, folder)
    restart = measure_restart(plan, model, args, folder)
    result = {"model": model, "islands_plan": plan.describe(), **recovery, **restart,
              "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "faults.json").write_text(json.dumps(result, indent=1))
    console = Console(width=160, record=True)
    console.print(f"{model}, 2 islands x 2 ranks ({plan.describe()}): island 1's ranks {recovery['killed_ranks']} "
                  f"SIGKILLed after step {args.kill_at}; island 0 trained on without a restart: "
                  f"{not recovery['survivor_restarted']}, every step once: {recovery['survivor_steps_once']}")
    if recovery["recovery_s"] is None:
        console.print("island 1 did not rejoin before island 0 finished: raise --steps")
        return 1
    console.print(f"recovery (killed -> rejoined with a peer's weights, at step {recovery['rejoined_at_step']}): "
                  f"{recovery['recovery_s']:.1f} s")
    console.print(f"restart of one job ({restart['plan']}, rank 1 killed after the checkpoint of step "
                  f"{args.kill_at}): {restart['restart_s']:.1f} s beyond a step of {restart['step_s']:.2f} s")
    console.print(f"checkpoint save: median {recovery['save_s']:.2f} s over {len(recovery['saves'])} saves")
    (args.out / "faults.txt").write_text(console.export_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cluster = cluster_of(args)
    if args.faults:
        return faults(args, cluster)
    rows: dict[str, dict] = {}
    for model in args.models:
        rows[model] = {}
        for method, plan in plans_for(model, cluster, args).items():
            print(f"training {model}: {method} ({plan.describe()})", file=sys.stderr, flush=True)
            rows[model][method] = summarize(plan, train(plan, model, method, args, runs_folder(args)), args)
    console = Console(width=200, record=True)
    console.print(table(rows, args))
    plot(rows, args.out / "islands.png")
    (args.out / "islands.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "cluster": cluster.to_dict(), "results": rows}, indent=1))
    (args.out / "islands.txt").write_text(console.export_text())
    print(f"wrote {args.out / 'islands.png'}, islands.json, islands.txt", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
