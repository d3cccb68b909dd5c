"""Does the calibration a run asks for make its prediction hold? What a user does, case by case:

1. `plait train CONFIG --no-profile`: planned on the `local-cpu` preset (uncalibrated), as every run was before
   the quick profile;
2. `plait train CONFIG`: a first run as it is now, planned on a quick profile of this machine, measured by the run
   itself (once per rank count: the benchmark keeps its own cache, ROOT/cache, so it is measured here);
3. the calibration the preset run's end note asks for (its measured step is more than 1.5x from its prediction):
   `plait profile --nproc N --out cluster.yaml`, then `plait tune --from-run LOG_DIR --cluster cluster.yaml --out
   cluster.tuned.yaml` with `--from-run` once more for the other run of the config (2.; the note asks for every run
   of the config: on a shared machine each run is one sample of its load; --fit-runs preset reads the preset run
   alone) (the profile runs once per process count and is shared by the cases of that count, as one user on one
   machine would), then `plait train CONFIG --set plan.cluster=cluster.tuned.yaml` (the planner may
   then pick another plan);
4. a plan the fit never read, on the tuned file: the same config with another micro-batch size pinned (more or
   fewer layer passes per step: the host time per pass the fit read off the first plan, priced where it was not
   measured), the "held out" row beside the "after" one;
5. print, per case and run: the plan, the predicted and measured step (what the run reports, Segment.measured: the
   median over the timed steps of the slowest rank, 2 warm-up steps left out, less the time the ranks sat ready to
   run without a core), the wall clock's step beside it, and measured / predicted; then how often two runs of the
   same plan agree within 1.3x, by the wall clock and as the runs report them.

The four cases (issue 25): a 4-layer Hugging Face Llama (the fine-tune example's base, built by
examples/hf_finetune_setup.py) pinned to dp2 and to tp2 on 2 processes, the fine-tune example itself
(`examples/hf-finetune.toml`: pp2 x tp2 on 4), and a 4-layer Hugging Face Mixtral (4 experts, top-2) on 2
processes as the planner chooses. Nothing is downloaded. Target: measured / predicted within 1.3x after the
calibration.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/calibration.py [--root runs/calibration] [--steps 20]
        [--cases llama-dp2 llama-tp2 finetune mixtral] [--rounds 1] [--fit-runs both|preset] [--json FILE]
    .venv/bin/python benchmarks/calibration.py --pairs FILE [FILE ...]     # the agreement line of saved runs

With --rounds R each case's runs are repeated R times (the profiles and the fit from the first round) and the
table gives medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
TARGET = 1.3
FINETUNE_CONFIG = REPO / "examples" / "hf-finetune.toml"
MIXTRAL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
               bos_token_id=0, eos_token_id=1)
"""A Mixtral the size of the fine-tune example's Llama (its tokenizer too), experts of half the Llama's FFN width."""

CASE_CONFIG = """\
[model]
file = "{model}"
weights = "seed"

[data]
source = "shipped"
tokenizer = "{tokenizer}"

[optimizer]
lr = 1e-3
warmup = 5

[train]
steps = 40
global_batch = 8
seq_len = 128

[plan]
file = "auto"
devices = 2
pins = {pins}
"""


@dataclass(frozen=True)
class Case:
    name: str
    nproc: int
    config: Path
    extra: tuple[str, ...] = ()
    """--set overrides the run needs (the fine-tune example's own paths, moved under --root)."""


@dataclass
class Run:
    plan: str
    predicted_s: float
    measured_s: float
    """What the run reports (Segment.measured): the step less the time its ranks sat ready to run without a core."""
    wall_clock_s: float
    """The same median step as the wall clock read it, the load included (Segment.measured(wall_clock=True))."""
    fastest_s: float
    """The fastest timed step (of the slowest rank): the one least disturbed by other work on the cores."""
    advice: list[str] | None
    parts: dict[str, tuple[float, float]]
    """(predicted, measured) seconds of the step's compute, waiting and optimizer parts (plait.train.measure)."""
    load: float
    """The machine's 1-minute load average at the end of the run (its cores: os.cpu_count()): the other work
    sharing the cores, which no cost model sees."""
    queued_share: float | None = None
    """The share of the median step the ranks sat ready to run without a core (Segment.queued_share)."""
    cpu_s: float | None = None
    """The median over timed steps of the largest CPU seconds any rank's process spent in the step
    (RankRecord.cpu_s): the work itself, without the waits other work on the cores adds (None: not recorded)."""

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s


def build_models(root: Path) -> tuple[Path, Path]:
    """The fine-tune example's base Llama (config, weights, tokenizer) and a Mixtral config beside it."""
    sys.path.insert(0, str(REPO / "examples"))
    import hf_finetune_setup
    from transformers import MixtralConfig

    base = root / "base"
    if not (base / "tokenizer.json").is_file():
        hf_finetune_setup.build(root)
    mixtral = root / "mixtral"
    mixtral.mkdir(parents=True, exist_ok=True)
    MixtralConfig(**MIXTRAL).save_pretrained(str(mixtral))
    return base, mixtral


def cases(root: Path, base: Path, mixtral: Path) -> list[Case]:
    configs = root / "configs"
    configs.mkdir(parents=True, exist_ok=True)

    def write(name: str, model: Path, pins: str) -> Path:
        path = configs / f"{name}.toml"
        path.write_text(CASE_CONFIG.format(model=model.resolve(), tokenizer=base.resolve(), pins=pins))
        return path

    finetune = (f"model.file={base.resolve()}", f"checkpoint.dir={(root / 'finetune-ckpt').resolve()}",
                f"checkpoint.export_hf={(root / 'finetune-hf').resolve()}")
    return [Case("llama-dp2", 2, write("llama-dp2", base, "{ dp = 2 }")),
            Case("llama-tp2", 2, write("llama-tp2", base, "{ tp = 2 }")),
            Case("finetune", 4, FINETUNE_CONFIG, finetune),
            Case("mixtral", 2, write("mixtral", mixtral, "{}"))]


class Refused(Exception):
    """A command that refused its input (exit 2), e.g. `plait tune` when the run's timings identify nothing."""


def plait(args: list[str], cwd: Path) -> str:
    """Run `plait ARGS` in `cwd`; its output (stdout and stderr). Refused on exit 2, exits on any other failure."""
    command = [sys.executable, "-m", "plait", *args]
    # this checkout's plait wherever the command runs (a relative PYTHONPATH=. would name `cwd`, and the venv's
    # installed plait may be another checkout's)
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "400", "PYTHONPATH": path})
    output = done.stdout + done.stderr
    if done.returncode == 2:
        raise Refused(output.strip().splitlines()[-1] if output.strip() else "exit 2")
    if done.returncode != 0:
        sys.exit(f"calibration: `{shlex.join(command)}` failed (exit {done.returncode}):\n{output[-3000:]}")
    return output


def train(case: Case, log_dir: Path, steps: int, *, cluster: Path | None = None, profile: bool = False,
          pins: tuple[str, ...] = ()) -> Run:
    """`plait train` of `case`: on `cluster`, else on this machine's quick profile (`profile`) or the preset;
    `pins`: more `plan.pins.KEY=VALUE` overrides."""
    from plait.plan import Plan
    from plait.train.measure import read_measured

    overrides = [*case.extra, f"log.dir={log_dir.resolve()}", *pins]
    overrides += [f"plan.cluster={cluster.resolve()}"] if cluster else []
    args = ["train", str(case.config), "--steps", str(steps), "--fresh", "--nproc", str(case.nproc)]
    args += [] if profile or cluster else ["--no-profile"]
    output = plait([*args, *(a for o in overrides for a in ("--set", o))], REPO)
    segment = read_measured(log_dir)[-1]
    measured = segment.measured()
    ranks = [r for r in segment.measured_window() if r.steps]
    fastest = min(max(times) for times in zip(*(r.step_s for r in ranks)))
    cpu = statistics.median(max(t) for t in zip(*(r.cpu_s for r in ranks))) if all(r.cpu_s for r in ranks) else None
    return Run(plan=Plan.from_dict(segment.plan).describe(), predicted_s=segment.predicted.step,
               measured_s=measured.step, wall_clock_s=segment.measured(wall_clock=True).step, fastest_s=fastest,
               advice=advice_commands(output), load=os.getloadavg()[0], cpu_s=cpu,
               queued_share=segment.queued_share(), parts={part: (getattr(segment.predicted, part), getattr(measured, part)) for part in PARTS})


def advice_commands(output: str) -> list[str] | None:
    """The commands the run's end note names (profile, then tune --from-run), or None when it names none."""
    text = " ".join(output.split())
    start = text.find("is not calibrated for this machine")
    if start < 0:
        return None
    note = text[start:text.find("plait:", start) if "plait:" in text[start:] else len(text)]
    return [c for c in re.findall(r"`(plait [^`]+)`", note) if "--model M" not in c]


def calibrate(case: Case, commands: list[str], root: Path, other_runs: list[Path]) -> Path:
    """Run the note's commands in a folder per process count (one profile per count, reused by its cases); the
    tuned file is per case, and `plait tune --from-run` is given the case's other runs too (`--from-run DIR` once
    more each, as the note says). Returns the tuned cluster file."""
    folder = root / f"nproc-{case.nproc}"
    folder.mkdir(parents=True, exist_ok=True)
    tuned = f"{case.name}.tuned.yaml"
    for command in commands:
        args = shlex.split(command)[1:]
        if args[0] == "profile" and (folder / "cluster.yaml").is_file():
            continue
        if args[0] == "tune":
            args += [a for run in other_runs for a in ("--from-run", str(run.resolve()))]
        plait([a.replace("cluster.tuned.yaml", tuned) for a in args], folder)
    return folder / tuned


PARTS = ("compute", "waiting", "optimizer")


def parts_table(results: list[dict]) -> Table:
    """Where the residual is: measured / predicted of each part of the step, medians over rounds."""
    out = Table(title="measured / predicted by part of the step (compute: layers and TP collectives; waiting: bubble, "
                      "pipeline transfers, exposed DP communication, the loss; optimizer: clipping, step, fixed host "
                      "time)",
                title_justify="left")
    for name in ("case", "planned on", *(f"{p} pred / meas s" for p in PARTS), *(f"{p} ratio" for p in PARTS)):
        out.add_column(name, justify="left" if name in ("case", "planned on") else "right")
    for result in results:
        for when in RUNS:
            runs = result[when]
            if not runs:
                continue
            pairs = {p: (statistics.median(r["parts"][p][0] for r in runs),
                         statistics.median(r["parts"][p][1] for r in runs)) for p in PARTS}
            out.add_row(result["case"], when, *(f"{a:.4f} / {b:.4f}" for a, b in pairs.values()),
                        *(f"{b / a:.2f}" if a > 0 else "-" for a, b in pairs.values()))
    return out


RUNS = ("preset", "quick profile", "after", "held out")
"""The rows of a case: planned on the local-cpu preset, on the run's own quick profile, after the calibration, and
another plan after it (another micro-batch size: `held_out_pins`) that the fit never read."""


def held_out_pins(plan: str) -> tuple[str, ...]:
    """Pins of a plan the calibration never read: `plan`'s micro-batch size halved (the same sequences in twice the
    micro-batches), or doubled where it is 1."""
    size = int(re.search(r"\bmb(\d+)x\d+", plan).group(1))
    return (f"plan.pins.micro_batch={size // 2 if size > 1 else 2}",)


def run_case(case: Case, root: Path, steps: int, rounds: int, fit_runs: str) -> dict:
    runs: dict[str, list[Run]] = {name: [] for name in RUNS}
    tuned, refusal = None, None
    for index in range(rounds):
        folder = root / "runs" / f"{case.name}-{index}"
        runs["preset"].append(train(case, folder / "preset", steps))
        runs["quick profile"].append(train(case, folder / "quick", steps, profile=True))
        advice = runs["preset"][0].advice
        if tuned is None and advice and refusal is None:
            try:
                tuned = calibrate(case, advice, root, [folder / "quick"] if fit_runs == "both" else [])
            except Refused as e:  # what the user would read: no tuned file, and what would help
                refusal = str(e)
                print(f"  {case.name}: {refusal}", flush=True)
        if tuned is not None:
            runs["after"].append(train(case, folder / "after", steps, cluster=tuned))
            runs["held out"].append(train(case, folder / "held-out", steps, cluster=tuned,
                                          pins=held_out_pins(runs["after"][-1].plan)))
        print(f"  {case.name} round {index + 1}: " + ", ".join(f"{name} {values[-1].ratio:.2f}x"
                                                           for name, values in runs.items() if values), flush=True)
    return {"case": case.name, "nproc": case.nproc, "tuned": str(tuned) if tuned else None, "refusal": refusal,
            **{name: [asdict(r) for r in values] for name, values in runs.items()}}


def median_run(runs: list[dict]) -> dict | None:
    if not runs:
        return None
    ratio = statistics.median(r["measured_s"] / r["predicted_s"] for r in runs)
    return {"plan": runs[0]["plan"], "predicted_s": statistics.median(r["predicted_s"] for r in runs),
            "measured_s": statistics.median(r["measured_s"] for r in runs), "ratio": ratio,
            "wall_clock_ratio": statistics.median(r["wall_clock_s"] / r["predicted_s"] for r in runs),
            "fastest_ratio": statistics.median(r["fastest_s"] / r["predicted_s"] for r in runs),
            "cpu_ratio": (statistics.median(r["cpu_s"] / r["predicted_s"] for r in runs)
                          if all(r.get("cpu_s") for r in runs) else None),
            "queued_share": (statistics.median(r["queued_share"] for r in runs)
                             if all(r.get("queued_share") is not None for r in runs) else None),
            "load": statistics.median(r["load"] for r in runs)}


def table(results: list[dict]) -> Table:
    out = Table(title=f"measured / predicted step: planned on the local-cpu preset, on the run's own quick profile, "
                      f"after the calibration the preset run asks for (target: within {TARGET}x after), and on a "
                      f"plan that calibration never read (held out: another micro-batch size)",
                title_justify="left")
    for name in ("case", "ranks", "planned on", "plan", "predicted s", "measured s", "measured / predicted", "within",
                 "wall clock / predicted", "fastest step / predicted", "step CPU / predicted", "waited for a core",
                 "load"):
        out.add_column(name, justify="left" if name in ("case", "planned on", "plan") else "right")
    for result in results:
        for when in RUNS:
            row = median_run(result[when])
            if row is None:
                continue
            ratio = row["ratio"]
            within = max(ratio, 1 / ratio) <= TARGET
            out.add_row(result["case"], str(result["nproc"]), when, row["plan"], f"{row['predicted_s']:.4f}",
                        f"{row['measured_s']:.4f}", f"{ratio:.2f}", "yes" if within else "no",
                        f"{row['wall_clock_ratio']:.2f}", f"{row['fastest_ratio']:.2f}",
                        "-" if row["cpu_ratio"] is None else f"{row['cpu_ratio']:.2f}",
                        "-" if row["queued_share"] is None else f"{row['queued_share']:.0%}",
                        f"{row['load']:.1f}")
    return out


def same_plan_pairs(results: list[dict]) -> dict[str, tuple[int, int]]:
    """Over every pair of runs of one plan (any case, any row): how many agree within TARGET, by the wall clock and
    as the runs report their step (less the wait for a core); (agreeing, pairs) each. Reads the JSON of one or more
    invocations alike."""
    by_plan: dict[str, list[dict]] = {}
    for result in results:
        for when in RUNS:
            for run in result.get(when, []):
                by_plan.setdefault(f"{result['case']}: {run['plan']}", []).append(run)
    out = {}
    for key in ("wall_clock_s", "measured_s"):
        pairs = [(a[key], b[key]) for runs in by_plan.values() for i, a in enumerate(runs) for b in runs[i + 1:]
                 if a.get(key) and b.get(key)]
        out[key] = (sum(max(a, b) / min(a, b) <= TARGET for a, b in pairs), len(pairs))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("runs/calibration"))
    parser.add_argument("--steps", type=int, default=20, help="steps per run (2 warm-up steps are left out)")
    parser.add_argument("--fit-runs", choices=("both", "preset"), default="both",
                        help="the runs `plait tune --from-run` reads: the preset run whose note asks for the "
                             "calibration and the quick-profile run of the same config (both), or the preset run alone")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cases", nargs="+", default=["llama-dp2", "llama-tp2", "finetune", "mixtral"])
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--pairs", type=Path, nargs="+", metavar="JSON",
                        help="measure nothing: how often runs of one plan agree, over these --json files")
    args = parser.parse_args()
    if args.pairs:
        print_pairs([r for path in args.pairs for r in json.loads(path.read_text())])
        return 0
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    for stale in [root / "cache", *root.glob("nproc-*")]:  # profiles of an earlier invocation: measure again
        shutil.rmtree(stale, ignore_errors=True)
    os.environ["PLAIT_CACHE_DIR"] = str(root / "cache")  # the quick profiles are measured here, not reused
    os.environ.pop("PLAIT_NO_PROFILE", None)
    base, mixtral = build_models(root)
    chosen = {c.name: c for c in cases(root, base, mixtral)}
    unknown = sorted(set(args.cases) - set(chosen))
    if unknown:
        print(f"calibration: unknown case(s) {', '.join(unknown)}; choose from {', '.join(chosen)}", file=sys.stderr)
        return 2
    results = []
    for name in args.cases:
        results.append(run_case(chosen[name], root, args.steps, args.rounds, args.fit_runs))
        if args.json:  # after each case: a long benchmark cut short keeps what it measured
            args.json.write_text(json.dumps(results, indent=1))
    Console(width=200).print(table(results))
    Console(width=200).print(parts_table(results))
    print_pairs(results)
    print(f"measured: what the run reports (Segment.measured: the step less the time its ranks sat ready to run "
          f"without a core); wall clock: the same median step with that wait; load: the 1-minute load average at the "
          f"end of each run (medians), on {os.cpu_count()} cores; step CPU: "
          f"the median step's CPU seconds of the busiest rank's process (what other work on the cores does not "
          f"stretch), against the same prediction; waited for a core: the share of the median step "
          f"the ranks sat ready to run without a core (Segment.queued_share: the load's part of the wall clock's step)")
    for result in results:
        if result["refusal"]:
            print(f"{result['case']}: no calibrated run: `plait tune --from-run` refused the preset run's timings "
                  f"({result['refusal']})")
    return 0


def print_pairs(results: list[dict]) -> None:
    pairs = same_plan_pairs(results)
    (wall, count), (less, _) = pairs["wall_clock_s"], pairs["measured_s"]
    if count:
        print(f"runs of one plan within {TARGET}x of each other: {wall} of {count} pairs by the wall clock, {less} of "
              f"{count} as the runs report their step (less the wait for a core)")


if __name__ == "__main__":
    sys.exit(main())
