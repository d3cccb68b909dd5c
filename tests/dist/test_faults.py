"""A rank that raises stops the others (blocked in a collective) and is named, without waiting for
the collective timeout; the ranks that lost it end without the interpreter's teardown (where gloo's
cut-off threads aborted them), in a collective, at the exit barrier or in a checkpoint save."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plait.runtime.launch import FAILURE_DIR_ENV, lost_a_peer, run_local

pytestmark = pytest.mark.dist


def test_dead_rank_stops_the_others_and_is_named(tmp_path, capfd):
    script = tmp_path / "dies.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from plait.runtime.launch import init_distributed
        rank, world = init_distributed(timeout_s=600)  # longer than the launch deadline below
        dist.barrier()
        if rank == 1:
            raise RuntimeError("rank one gives up")
        dist.all_reduce(torch.ones(1))  # the others wait here for rank 1, which never comes
    """))
    # 124 would mean the deadline had to stop them: the failure must be noticed well before
    code = run_local(3, [str(script)], module=None, timeout_s=120)
    err = capfd.readouterr().err
    assert code == 1
    assert "plait: rank 1 failed (exit code 1): RuntimeError: rank one gives up" in err
    assert "rank 0 failed" not in err and "rank 2 failed" not in err


def test_killed_rank_is_named_before_the_peers_that_lost_it(tmp_path, capfd):
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time, torch, torch.distributed as dist
        from plait.runtime.launch import init_distributed
        rank, world = init_distributed(timeout_s=600)
        dist.barrier()
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))
    """))
    code = run_local(3, [str(script)], module=None, timeout_s=120)
    err = capfd.readouterr().err
    assert code == 1
    assert "plait: rank 0 failed (signal SIGKILL)" in err
    assert "rank 1 failed" not in err and "rank 2 failed" not in err


def test_deadline_stops_hung_ranks(tmp_path, capfd):
    script = tmp_path / "hangs.py"
    script.write_text("import time\ntime.sleep(600)\n")
    assert run_local(2, [str(script)], module=None, timeout_s=3) == 124
    assert "did not finish within 3 s" in capfd.readouterr().err


def test_a_rank_failing_while_its_peers_wait_at_the_exit_barrier_is_named(tmp_path, capfd):
    """ending_together's closing barrier: the peers that finished wait there for the rank that raised."""
    script = tmp_path / "fails_last.py"
    script.write_text(textwrap.dedent("""
        import torch.distributed as dist
        from plait.runtime.launch import ending_together, init_distributed
        rank, world = init_distributed(timeout_s=600)
        with ending_together():
            dist.barrier()
            if rank == 1:
                raise RuntimeError("rank one fails at the end")
    """))
    code = run_local(3, [str(script)], module=None, timeout_s=120)
    err = capfd.readouterr().err
    assert code == 1
    assert "plait: rank 1 failed (exit code 1): RuntimeError: rank one fails at the end" in err
    assert "rank 0 failed" not in err and "rank 2 failed" not in err
    assert "terminate called" not in err


def test_a_rank_killed_during_a_checkpoint_save_is_named(tmp_path, capfd):
    """Rank 1 dies half-way through torch.distributed.checkpoint's save, while writing its shard: the others,
    waiting in the save's collectives, say one line each and are stopped; no traceback, no abort."""
    script = tmp_path / "dies_saving.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, torch, torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from plait.runtime.launch import ending_together, init_distributed

        class DiesWhileWriting(dcp.FileSystemWriter):
            def write_data(self, plan, planner):
                if dist.get_rank() == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                return super().write_data(plan, planner)

        rank, world = init_distributed(timeout_s=600)
        with ending_together():
            state = {f"own{rank}": torch.randn(64, 64), "shared": torch.ones(8)}
            dcp.save(state, storage_writer=DiesWhileWriting(sys.argv[1]))
    """))
    code = run_local(3, [str(script), str(tmp_path / "ckpt")], module=None, timeout_s=120)
    err = capfd.readouterr().err
    assert code == 1
    assert "plait: rank 1 failed (signal SIGKILL)" in err
    assert "rank 0 failed" not in err and "rank 2 failed" not in err
    assert "Traceback" not in err and "terminate called" not in err
    assert len(err.splitlines()) <= 4, err  # each survivor's line (if it came before its stop), the summary
    assert not (tmp_path / "ckpt" / ".metadata").exists()  # the save never completed


def test_a_rank_that_lost_a_peer_skips_the_interpreter_teardown(tmp_path):
    """Two ranks started by hand (no launcher to stop the survivor): rank 1 dies; rank 0 notes the lost peer, says
    one line, waits its bound for a stop that never comes and ends with exit code 1, without the interpreter's
    teardown (where gloo's threads, cut off by the dead peer, called std::terminate: SIGABRT). The atexit handler
    stands for that teardown."""
    script = tmp_path / "survivor.py"
    script.write_text(textwrap.dedent("""
        import atexit, os, signal, sys, torch, torch.distributed as dist
        import plait.runtime.launch as launch
        launch.STOP_WAIT_S = 0.5  # no launcher here to stop the survivor
        atexit.register(lambda: print("teardown ran", file=sys.stderr, flush=True))
        rank, world = launch.init_distributed(timeout_s=600)
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))
    """))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    notes = tmp_path / "notes"
    notes.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), FAILURE_DIR_ENV: str(notes)}
    ranks = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    errs = [rank.communicate(timeout=120)[1] for rank in ranks]
    assert ranks[1].returncode == -9
    assert ranks[0].returncode == 1, errs[0]
    assert errs[0].startswith("plait: rank 0: RuntimeError: ") and len(errs[0].splitlines()) == 1, errs[0]
    assert "teardown ran" not in errs[0]
    note = json.loads(Path(notes / "rank0.json").read_text())
    assert lost_a_peer(note["error"]), note
