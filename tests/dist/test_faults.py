"""A rank that raises stops the others (blocked in a collective) and is named, without waiting for
the collective timeout."""

from __future__ import annotations

import textwrap

import pytest

from plait.launch import run_local

pytestmark = pytest.mark.dist


def test_dead_rank_stops_the_others_and_is_named(tmp_path, capfd):
    script = tmp_path / "dies.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from plait.launch import init_distributed
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
        from plait.launch import init_distributed
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
