"""The world the bad-input suites (tests/unit/test_bad_input.py, tests/unit/test_bad_paths.py) feed mistakes
into, and how each case is judged.

A temporary folder holds a tiny model, a plan for it, a text, a cluster file and a checkpoint directory a
config resumes from (`CKPT`, with its digest taken once). A case runs a real entry point -- mostly the CLI in
this process, with `plait.runtime.launch.run_local` replaced by a stub so valid input ends at `Launched` instead of
training -- and must end in exit code 2 with exactly one line on stderr (`plait <command>: error: ...`),
naming the value, with no traceback, and the checkpoint directories byte for byte as they were.

Every judged case is recorded per kind (cases, exit codes, tracebacks, changed digests) before it is
asserted, and written to $PLAIT_BAD_INPUT_REPORT (merged across suites) for benchmarks/bad_input.py.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

from hypothesis import HealthCheck, assume, settings

from plait.errors import PlaitError

EXAMPLES = int(os.environ.get("PLAIT_BAD_INPUT_EXAMPLES", "30"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.filter_too_much])
ROOT = Path(tempfile.mkdtemp(prefix="plait-bad-input-"))
atexit.register(shutil.rmtree, ROOT, ignore_errors=True)

MODEL = {"name": "bad-input-gpt", "arch": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
         "vocab_size": 128, "max_seq_len": 32}
CLUSTER = {"name": "two-cpus", "num_devices": 2, "devices_per_node": 2, "memory_bytes": "4GiB",
           "peak_flops": "50 GFLOPS", "device_type": "cpu", "backend": "gloo",
           "intra_node": {"latency_s": "20us", "bandwidth": "1 GB/s"},
           "inter_node": {"latency_s": "50us", "bandwidth": "0.5 GB/s"}}
UNWRITABLE = ("/proc/plait-bad-input", "/sys/plait-bad-input")
"""Locations no one can write, not even root: procfs and sysfs take no new files."""


# ---- the world ------------------------------------------------------------------------------------
def plan_dict() -> dict[str, Any]:
    from plait.plan import Plan
    from plait.spec import ModelSpec, TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    plan = Plan.of(dp=2, tp=1, pp=1, micro_batch=2, model=ModelSpec(**MODEL),
                   train=TrainSpec(global_batch=4, seq_len=16, precision="fp32"), cluster=CLUSTER_PRESETS["local-cpu"])
    return json.loads(plan.to_json())


def meta(step: int = 2) -> dict[str, Any]:
    return {"step": step, "tokens": 64 * step, "world_size": 2, "plan": plan_dict(),
            "loader": {"epoch": 0, "step_in_epoch": step, "seed": 0, "global_batch": 4, "seq_len": 16}}


def fake_checkpoint(root: Path, step: int = 2) -> Path:
    """A checkpoint directory that verifies (manifest, meta, shards, rng), as plait writes one."""
    import torch

    from plait.train.checkpoint import publish, rng_states, step_dir, tmp_dir, write_manifest

    tmp = tmp_dir(root, step)
    (tmp / "rng").mkdir(parents=True)
    for name, data in {".metadata": b"m" * 64, "__0_0.distcp": b"a" * 999, "__1_0.distcp": b"b" * 999,
                       "meta.json": json.dumps(meta(step)).encode()}.items():
        (tmp / name).write_bytes(data)
    torch.save(rng_states(), tmp / "rng" / "rank_00000.pt")  # plain data, as plait writes it
    write_manifest(tmp, step)
    publish(tmp, step_dir(root, step))
    return root


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    if not root.exists():
        return "absent"
    for path in sorted(root.rglob("*")):
        digest.update(path.relative_to(root).as_posix().encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


CKPT = fake_checkpoint(ROOT / "ckpt")
CKPT_DIGEST = tree_digest(CKPT)
(ROOT / "model.json").write_text(json.dumps(MODEL))
(ROOT / "cluster.json").write_text(json.dumps(CLUSTER))
(ROOT / "plan.json").write_text(json.dumps(plan_dict()))
(ROOT / "text.txt").write_text("To be, or not to be, that is the question. " * 40)
(ROOT / "a-file").write_text("a file, where a folder is expected\n")


def base_config() -> dict[str, Any]:
    return {
        "model": {"file": str(ROOT / "model.json")},
        "data": {"source": "text", "path": str(ROOT / "text.txt")},
        "train": {"steps": 4, "global_batch": 4, "seq_len": 16},
        "plan": {"file": str(ROOT / "plan.json")},
        "checkpoint": {"dir": str(CKPT), "every": 2, "keep": 2, "resume": True},
        "log": {"dir": str(ROOT / "log"), "progress": False},
    }


def to_toml(config: dict[str, Any]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + "}"
        return json.dumps(v)

    return "\n".join(f"[{section}]\n" + "\n".join(f"{k} = {value(v)}" for k, v in table.items())
                     for section, table in config.items()) + "\n"


# ---- running an entry point -----------------------------------------------------------------------
class Launched(Exception):
    """The input was valid: the launcher was reached (and stubbed out)."""


def _stub_run_local(*args: Any, **kwargs: Any) -> int:
    raise Launched()


def run_cli(argv: list[str]) -> tuple[int, str]:
    """`plait <argv>` in this process: (exit code, stderr); raises Launched for valid input."""
    import plait.runtime.launch
    from plait.cli import main

    saved, plait.runtime.launch.run_local = plait.runtime.launch.run_local, _stub_run_local
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    finally:
        plait.runtime.launch.run_local = saved
    return code, err.getvalue()


# ---- judging and recording ------------------------------------------------------------------------
WARNING = re.compile(r"^plait( \w+)?: warning: ")
"""Warnings may come before the error (a checkpoint named unusable, say); they are not the message."""

RESULTS: dict[str, dict[str, Any]] = defaultdict(lambda: {"cases": 0, "exit_codes": Counter(), "tracebacks": 0,
                                                           "changed": 0, "unnamed": 0})


def record(kind: str, code: int, err: str, changed: bool, named: bool) -> None:
    entry = RESULTS[kind]
    entry["cases"] += 1
    entry["exit_codes"][str(code)] += 1
    entry["tracebacks"] += "Traceback" in err
    entry["changed"] += changed
    entry["unnamed"] += not named


def expect_cli_error(kind: str, argv: list[str], *, names: str | None = None,
                     guarded: tuple[tuple[Path, str], ...] = (), may_succeed: bool = False) -> str:
    """Run `plait <argv>`: exit 2, one error line (naming `names` when given), no traceback, CKPT and every
    (folder, digest) in `guarded` unchanged. A valid input (the launcher reached; with `may_succeed`, a
    command that needs no launcher finishing with 0, as `plait plan` does) is not a case."""
    try:
        code, err = run_cli(argv)
    except Launched:
        assume(False)  # a valid input: not a bad-input case
    if may_succeed and code == 0 and "Traceback" not in err:
        assume(False)
    lines = [line for line in err.splitlines() if line.strip() and not WARNING.match(line)]
    changed = tree_digest(CKPT) != CKPT_DIGEST or any(tree_digest(p) != d for p, d in guarded)
    command = argv[0]
    one_line = len(lines) == 1 and lines[0].startswith(f"plait {command}: error: ")
    named = one_line and (names is None or names in lines[0])
    record(kind, code, err, changed, named)
    assert code == 2, f"exit {code} for {argv!r}: {err}"
    assert one_line, f"not one error line for {argv!r}: {err!r}"
    assert "Traceback" not in err, err
    assert named, f"the message does not name {names!r}: {lines[0]!r}"
    assert not changed, "a bad input changed a checkpoint directory"
    return lines[0]


def expect_config_error(kind: str, config_text: str, *, names: str | None = None, extra: list[str] = (),
                        guarded: tuple[tuple[Path, str], ...] = ()) -> str:
    path = ROOT / "case.toml"
    path.write_text(config_text)
    return expect_cli_error(kind, ["train", str(path), *extra], names=names, guarded=guarded)


def expect_loader_error(kind: str, load: Callable[[], Any]) -> None:
    try:
        load()
    except PlaitError as error:
        message = str(error)
        one_line = bool(message) and "\n" not in message
        changed = tree_digest(CKPT) != CKPT_DIGEST
        record(kind, 2, "", changed, one_line)
        assert one_line, f"not a one-line message: {message!r}"
        assert not changed
        return
    assume(False)  # valid input


def write_report() -> None:
    """Merge this process's counts into $PLAIT_BAD_INPUT_REPORT (each suite module calls it at its end)."""
    out = os.environ.get("PLAIT_BAD_INPUT_REPORT")
    if not out:
        return
    path = Path(out)
    merged = json.loads(path.read_text()) if path.is_file() and path.read_text().strip() else {}
    for kind, entry in RESULTS.items():
        merged[kind] = {**entry, "exit_codes": dict(entry["exit_codes"])}
    path.write_text(json.dumps(merged, indent=1))


def write_manifest_again(step_folder: Path) -> None:
    """Re-sign a published checkpoint after changing a file in it (what someone sharing a doctored one would do)."""
    from plait.train.checkpoint import MANIFEST, write_manifest

    (step_folder / MANIFEST).unlink()
    write_manifest(step_folder, int(step_folder.name.removeprefix("step_")))
