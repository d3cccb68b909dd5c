"""Bad input and interruptions, measured: every way a user's mistake or Ctrl-C was handled, per kind.

Two parts:

* generated mistakes (hypothesis; tests/unit/test_bad_input.py and tests/unit/test_bad_paths.py, run here
  with --examples cases per property): malformed configs, plans, model, cluster and data files; empty,
  blank and non-UTF-8 files; output locations under a file, where no one can write, or of the wrong kind,
  for every flag that writes; checkpoint sets a resume cannot use; contradicting keys; fault specs that
  never fire; plans for other machines. Each through the real command in process (the launcher stubbed).
* interruptions (real runs, --interrupts of them): Ctrl-C (SIGINT to the launcher's process group, as a
  terminal sends it) to `plait train` on 2 ranks at a random step, before its ranks start, and half-way
  through a checkpoint save; to `plait profile` at a random moment; and a `--resume` after some of them.

Each case is judged: exit code 2 for a mistake (130 for Ctrl-C, 0 for the resume), one message naming the
value, no traceback, and checkpoint digests unchanged (generated cases: SHA-256 of every file of every
checkpoint directory the command could touch; interruptions: every complete checkpoint left still matches
the SHA-256 digests its manifest recorded at the save). Prints a table; exit code 0 when every case passed.

    python benchmarks/bad_input.py [--examples 100] [--interrupts 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
SUITES = [REPO / "tests" / "unit" / "test_bad_input.py", REPO / "tests" / "unit" / "test_bad_paths.py"]
MODEL = {"name": "interrupt-gpt", "arch": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
         "vocab_size": 128, "max_seq_len": 32}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100, help="hypothesis examples per property (default 100)")
    parser.add_argument("--interrupts", type=int, default=16, help="real interrupted runs (default 16; 0: none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the interruptions' moments")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown (for benchmarks/README.md)")
    args = parser.parse_args()
    started = time.perf_counter()
    results, suite_ok = generated_cases(args.examples)
    generated_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="plait-interrupts-") as folder:
        interrupts = Interruptions(Path(folder), random.Random(args.seed))
        for index in range(args.interrupts):
            interrupts.run_one(index)
    for kind, entry in interrupts.results.items():
        results[kind] = entry
    console = Console(width=max(Console().width, 160))
    rendered = table(results, args, generated_s, time.perf_counter() - started - generated_s)
    console.print(rendered)
    if args.markdown:
        Path(args.markdown).write_text(markdown(rendered))
    bad = verdict(results)
    ok = suite_ok and not bad
    console.print("[green]every case passed[/]" if ok else f"[red]FAILED[/]: {'; '.join(bad) or 'see pytest above'}")
    return 0 if ok else 1


# ---- part 1: the generated suites ----------------------------------------------------------------------
def generated_cases(examples: int) -> tuple[dict[str, dict], bool]:
    report = Path(tempfile.mkstemp(suffix=".json")[1])
    env = {**os.environ, "PLAIT_BAD_INPUT_EXAMPLES": str(examples), "PLAIT_BAD_INPUT_REPORT": str(report),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "pytest", *map(str, SUITES), "-q", "-p", "no:cacheprovider"],
                            env=env, cwd=REPO)
    counts = json.loads(report.read_text() or "{}")
    report.unlink()
    for entry in counts.values():
        entry["expected"] = "2"
    return counts, result.returncode == 0


# ---- part 2: real runs, interrupted ------------------------------------------------------------------
class Interruptions:
    """Each case starts a real command in a session of its own and sends SIGINT to it, as a terminal does."""

    KINDS = ("Ctrl-C: plait train at a random step", "Ctrl-C: plait train before its ranks start",
             "Ctrl-C: plait train half-way through a checkpoint save", "Ctrl-C: plait profile at a random moment")

    def __init__(self, folder: Path, rng: random.Random) -> None:
        self.folder, self.rng = folder, rng
        self.results: dict[str, dict] = {}
        (folder / "model.json").write_text(json.dumps(MODEL))

    def run_one(self, index: int) -> None:
        kind = self.KINDS[index % len(self.KINDS)]
        if kind.endswith("profile at a random moment"):
            self._profile(kind, index)
            return
        run = self.folder / f"run{index}"
        every = self.rng.choice([1, 2, 3])
        config = self._config(run, every)
        if kind.endswith("random step"):
            step = self.rng.randint(1, 25)
            code, err = self._interrupted(["train", str(config)], lambda: _metrics_lines(run) >= step, 120)
        elif kind.endswith("before its ranks start"):
            delay = self.rng.uniform(0.2, 2.5)
            code, err = self._interrupted(["train", str(config)], _after(delay), 60)
        else:
            step = every * self.rng.randint(1, 4)
            code, err = self._run(["train", str(config)], fault=f"interrupt:rank={self.rng.randint(0, 1)}:step={step}")
        self._judge(kind, code, err, expected=130, checkpoints=run / "ckpt", named="plait train: interrupted")
        saved = _saved_step(run / "ckpt")
        if kind.endswith("random step") and saved:  # what Ctrl-C left is usable: the run goes on from it
            code, err = self._run(["train", str(config), "--resume", "--steps", str(saved + 3)])
            self._judge("--resume after Ctrl-C", code, err, expected=0, checkpoints=run / "ckpt", named=None,
                        metrics=run / "log" / "metrics.jsonl")

    def _config(self, run: Path, every: int) -> Path:
        config = run.with_suffix(".toml")
        config.write_text(f"""
[model]
file = "{self.folder / 'model.json'}"
[train]
steps = 2000
global_batch = 4
seq_len = 16
[plan]
file = "auto"
devices = 2
pins = {{ dp = 2 }}
[checkpoint]
dir = "{run / 'ckpt'}"
every = {every}
keep = 3
[log]
dir = "{run / 'log'}"
progress = false
""")
        return config

    def _profile(self, kind: str, index: int) -> None:
        out = self.folder / f"cluster{index}.yaml"
        code, err = self._interrupted(["profile", "--quick", "--nproc", "2", "--out", str(out)],
                                      _after(self.rng.uniform(0.5, 10.0)), 120)
        self._judge(kind, code, err, expected=130, checkpoints=None, named="plait profile: interrupted", absent=out)

    def _env(self, fault: str | None = None) -> dict[str, str]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_OMP_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        env.pop("PLAIT_FAULT", None)
        if fault:
            env["PLAIT_FAULT"] = fault
        return env

    def _run(self, argv: list[str], fault: str | None = None) -> tuple[int, str]:
        done = subprocess.run([sys.executable, "-m", "plait", *argv], env=self._env(fault), capture_output=True,
                              text=True, timeout=300, start_new_session=True)
        return done.returncode, done.stderr

    def _interrupted(self, argv: list[str], ready, limit_s: float) -> tuple[int, str]:
        with tempfile.TemporaryFile("w+") as err:
            process = subprocess.Popen([sys.executable, "-m", "plait", *argv], env=self._env(), stdout=subprocess.DEVNULL,
                                       stderr=err, text=True, start_new_session=True)
            deadline = time.monotonic() + limit_s
            while not ready() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
            try:
                code = process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                code = process.wait()
            err.seek(0)
            return code, err.read()

    def _judge(self, kind: str, code: int, err: str, *, expected: int, checkpoints: Path | None, named: str | None,
               metrics: Path | None = None, absent: Path | None = None) -> None:
        from plait.train.checkpoint import complete_dirs, verify

        entry = self.results.setdefault(kind, {"cases": 0, "exit_codes": Counter(), "tracebacks": 0, "changed": 0,
                                               "unnamed": 0, "expected": str(expected)})
        entry["cases"] += 1
        entry["exit_codes"][str(code)] += 1
        entry["tracebacks"] += "Traceback" in err
        broken = [p for _, p in complete_dirs(checkpoints)] if checkpoints is not None else []
        entry["changed"] += any(verify(p) is not None for p in broken) or bool(absent and absent.exists())
        if expected == 0:
            steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics else []
            entry["unnamed"] += steps != sorted(set(steps))  # a resumed run logs each step once, in order
        else:
            lines = [line for line in err.splitlines() if line.strip() and ": warning:" not in line
                     and not line.startswith(("plait train: dp", "profile [", "plait: PLAIT_FAULT"))]
            entry["unnamed"] += not (len(lines) == 1 and (named is None or named in lines[0]))


def _metrics_lines(run: Path) -> int:
    path = run / "log" / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


def _saved_step(root: Path) -> int:
    from plait.train.checkpoint import latest_complete

    return latest_complete(root).step


def _after(seconds: float):
    until = time.monotonic() + seconds
    return lambda: time.monotonic() >= until


# ---- the table ---------------------------------------------------------------------------------------
def table(results: dict[str, dict], args: argparse.Namespace, generated_s: float, interrupted_s: float) -> Table:
    total = sum(entry["cases"] for entry in results.values())
    out = Table(title=f"bad input and interruptions: {total:,} cases of {len(results)} kinds "
                      f"(--examples {args.examples}: {generated_s:.0f} s; --interrupts {args.interrupts}: "
                      f"{interrupted_s:.0f} s)", title_justify="left")
    for column in ("kind", "cases", "exit codes", "tracebacks", "not one line naming it", "changed digests"):
        out.add_column(column, justify="left" if column == "kind" else "right")
    for kind, entry in sorted(results.items()):
        codes = ", ".join(f"{code}×{n}" for code, n in sorted(entry["exit_codes"].items()))
        out.add_row(kind, str(entry["cases"]), codes, str(entry["tracebacks"]), str(entry["unnamed"]),
                    str(entry["changed"]))
    codes = Counter()
    for entry in results.values():
        codes.update(entry["exit_codes"])
    out.add_row("[bold]total", f"[bold]{total:,}", ", ".join(f"{c}×{n:,}" for c, n in sorted(codes.items())),
                str(sum(e["tracebacks"] for e in results.values())), str(sum(e["unnamed"] for e in results.values())),
                str(sum(e["changed"] for e in results.values())))
    return out


def markdown(rendered: Table) -> str:
    """The same table as Markdown: title, then one row per kind."""
    columns = [[str(cell).replace("[bold]", "") for cell in column.cells] for column in rendered.columns]
    lines = [f"{rendered.title}", "", "| " + " | ".join(c.header for c in rendered.columns) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in zip(*columns)]
    return "\n".join(lines) + "\n"


def verdict(results: dict[str, dict]) -> list[str]:
    bad = []
    for kind, entry in results.items():
        wrong = {code for code in entry["exit_codes"] if code != entry["expected"]}
        if wrong or entry["tracebacks"] or entry["changed"] or entry["unnamed"]:
            bad.append(kind)
    return bad


if __name__ == "__main__":
    sys.exit(main())
