"""Two torchrun agents on one host, as two machines would run them (`--nnodes 2 --nproc-per-node 2`, c10d
rendezvous on 127.0.0.1): 2 + 2 ranks, a tiny GPT, a few steps, every wait bounded.

* A rank killed (PLAIT_FAULT) under `--max-restarts 1`: both agents start their workers again, the rounds
  are kept apart (plait.runtime.launch._round_store), they resume from the last checkpoint and finish with exit 0
  and the losses of a run that was never interrupted.
* `--nnodes 1:2` and one agent killed for good (the agent and its workers, as a lost machine): the
  survivor's restarted workers re-plan for the 2 ranks left (plan "auto") and finish from the checkpoint,
  or, with a plan file made for 4 ranks, refuse with a message that says what to do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from run_configs import local_plan, write_run_config  # noqa: E402

pytestmark = pytest.mark.dist

MODEL = {"name": "elastic-tiny-gpt", "arch": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
         "vocab_size": 128, "max_seq_len": 32}
STEPS = 10
JOB_TIMEOUT_S = 300
RDZV_CONF = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=5"
"""A lost machine is noticed after 5 missed 1 s heartbeats, and a round of fewer machines starts 5 s after the
minimum is there (torch's defaults: 3 x 5 s and 30 s). Fewer missed beats (2 were tried) declared a live agent
lost when the 2 cores were busy with other work. The last call is also how late the second agent may join the
first round (start_agents): its store client retries about once a second, and a busy machine delays it more."""


@pytest.fixture()
def workdir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="plait-elastic-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def write_config(root: Path, name: str, plan: str = "file") -> Path:
    fixed = local_plan(MODEL, 8, 16, dp=2, tp=1, pp=2, micro_batch=2, num_micro_batches=2)
    return write_run_config(root, name, MODEL, {"train": {"steps": STEPS, "global_batch": 8, "seq_len": 16, "seed": 5},
                                                "optimizer": {"warmup": 2},
                                                "checkpoint": {"dir": str(root / name / "ckpt"), "every": 2, "keep": 2}},
                            plan=fixed if plan == "file" else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agents(config: Path, nnodes: str, *, fault: str | None = None) -> list[subprocess.Popen]:
    """Two torchrun agents of one job, each in a session of its own (as on two machines)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_DIST_TIMEOUT_S": "60"}
    env.pop("PLAIT_FAULT", None)
    if fault:
        env["PLAIT_FAULT"] = fault
    port = free_port()

    def command(hosts_store: bool) -> list[str]:
        conf = f"{RDZV_CONF},is_host={int(hosts_store)}"
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", config.stem,
                "--rdzv-conf", conf, "--max-restarts", "1", "-m", "plait", "train", str(config)]

    logs = [open(config.with_suffix(f".agent{n}.log"), "w") for n in range(2)]
    try:
        # Both start at once, so that both are in the first round: with `--nnodes 1:2` an agent that came more than
        # last_call_timeout late would join a second round, which torch 2.13's shared store does not give it
        # (the first round's host does not write MASTER_ADDR again; the late agent times out after 60 s reading it).
        # Agent 0 hosts the rendezvous store (is_host; agent 1's client waits for it): the tests kill agent 1, as a
        # lost machine that did not host the job's store; a job whose store host dies cannot go on.
        agents = [subprocess.Popen(command(n == 0), env=env, stdout=logs[n], stderr=subprocess.STDOUT,
                                   start_new_session=True) for n in range(2)]
        return agents
    finally:
        for log in logs:
            log.close()


def finish(agents: list[subprocess.Popen], timeout: float = JOB_TIMEOUT_S) -> list[int | None]:
    """Each agent's exit code; an agent still running after `timeout` is killed with its workers (None)."""
    deadline = time.monotonic() + timeout
    codes = []
    for agent in agents:
        try:
            codes.append(agent.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            kill_tree(agent.pid)
            agent.wait()
            codes.append(None)
    return codes


def descendants(pid: int) -> list[int]:
    found = [pid]
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found += descendants(int(child))
    except OSError:
        pass
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL an agent and its workers (they run in sessions of their own): a machine gone at once."""
    for victim in descendants(pid):
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(path: Path, agents: list[subprocess.Popen], config: Path, timeout: float = JOB_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
            for agent in agents:
                kill_tree(agent.pid)
            pytest.fail(f"{path} never appeared; the agents said:\n{output(config)[-6000:]}")
        time.sleep(0.2)


def output(config: Path) -> str:
    return "\n".join(config.with_suffix(f".agent{n}.log").read_text() for n in range(2))


def losses(config: Path) -> dict[int, float]:
    rows = map(json.loads, (config.parent / config.stem / "log" / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row["loss"] for row in rows}


def test_two_agents_restart_in_place_after_a_rank_dies(workdir: Path) -> None:
    clean = write_config(workdir, "clean")
    codes = finish(start_agents(clean, "2"))
    assert codes == [0, 0], output(clean)[-4000:]

    crashed = write_config(workdir, "crashed")
    codes = finish(start_agents(crashed, "2", fault="kill:rank=3:step=7"))
    text = output(crashed)
    assert codes == [0, 0], text[-4000:]
    assert "injecting 'kill' on rank 3 after step 7" in text
    assert text.count("injecting") == 1  # the restarted round knows it is not the first, on both machines
    assert "resumed from" in text and "step_000006" in text
    assert losses(crashed) == losses(clean)
    assert sorted(losses(crashed)) == list(range(1, STEPS + 1))


def test_survivor_replans_for_the_smaller_world(workdir: Path) -> None:
    config = write_config(workdir, "shrink", plan="auto")
    agents = start_agents(config, "1:2")
    wait_for(workdir / "shrink" / "ckpt" / "step_000004", agents, config)
    kill_tree(agents[1].pid)
    codes = finish(agents)
    text = output(config)
    assert codes[0] == 0, text[-4000:]
    assert "this round has 2 ranks" in text and "resumed from" in text
    assert sorted(losses(config)) == list(range(1, STEPS + 1))
    assert json.loads((workdir / "shrink" / "log" / "plan.json").read_text())["degrees"]  # the plan it ran


def test_fixed_plan_for_the_old_world_is_refused(workdir: Path) -> None:
    config = write_config(workdir, "fixed")
    agents = start_agents(config, "1:2")
    wait_for(workdir / "fixed" / "ckpt" / "step_000004", agents, config)
    kill_tree(agents[1].pid)
    codes = finish(agents)
    text = output(config)
    assert codes[0] not in (0, None), text[-4000:]
    assert "is for 4 ranks (dp2 x tp1 x pp2), but this round of the job has 2" in text
    assert 'plan.file = "auto"' in text
