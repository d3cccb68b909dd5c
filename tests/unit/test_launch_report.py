"""Which rank the launcher blames when several fail together (the race CI once hit: every rank
exited 1 within one monitor interval, and torch's timestamps are whole seconds)."""

from __future__ import annotations

from types import SimpleNamespace

from plait.runtime.launch import _report_failure

PEER = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:18614"


def failure(**ranks):
    def info(code, sig):
        return SimpleNamespace(exitcode=code, signal_name=lambda: sig)
    return SimpleNamespace(failures={int(r[1:]): info(*v) for r, v in ranks.items()})


def report(capsys, fail, notes):
    _report_failure(fail, notes)
    return capsys.readouterr().err


def test_first_noted_failure_is_the_cause_and_peers_follow(capsys):
    err = report(capsys, failure(r0=(1, "Signals.0"), r1=(1, "Signals.0"), r2=(1, "Signals.0")),
                 {0: {"time_ns": 30, "error": PEER}, 1: {"time_ns": 10, "error": "RuntimeError: gives up"},
                  2: {"time_ns": 20, "error": PEER}})
    assert "plait: rank 1 failed (exit code 1): RuntimeError: gives up" in err
    assert "ranks 0, 2 lost a peer and stopped" in err
    assert "rank 0 failed" not in err and "rank 2 failed" not in err


def test_a_rank_without_a_note_comes_first(capsys):
    err = report(capsys, failure(r0=(1, "x"), r3=(-9, "SIGKILL")), {0: {"time_ns": 5, "error": PEER}})
    assert err.index("rank 3 failed (signal SIGKILL)") < err.index("rank 0 lost a peer")


def test_independent_errors_are_all_named_and_stopped_ranks_left_out(capsys):
    err = report(capsys, failure(r0=(2, "x"), r1=(2, "x"), r2=(-15, "SIGTERM")),
                 {0: {"time_ns": 1, "error": "PlaitError: bad data"}, 1: {"time_ns": 2, "error": "PlaitError: bad data"}})
    assert "rank 0 failed (exit code 2)" in err and "rank 1 failed (exit code 2)" in err
    assert "rank 2" not in err


def test_a_rank_stopped_on_its_way_out_after_its_own_error_is_the_cause(capsys):
    """The launcher stops every rank once one exits; a rank that raised first may still be ending (printing its
    traceback) when the peers that lost it have exited: its note, older than theirs, names it."""
    err = report(capsys, failure(r0=(1, "Signals.0"), r1=(-15, "SIGTERM"), r2=(1, "Signals.0")),
                 {1: {"time_ns": 10, "error": "RuntimeError: gives up"}, 0: {"time_ns": 20, "error": PEER},
                  2: {"time_ns": 30, "error": PEER}})
    assert err.splitlines()[0] == "plait: rank 1 failed (stopped by the launcher as it ended): RuntimeError: gives up"
    assert "ranks 0, 2 lost a peer and stopped" in err
    assert "rank 0 failed" not in err and "rank 2 failed" not in err


def test_stopped_ranks_that_lost_a_peer_are_left_out(capsys):
    """Ranks that lost a peer wait for the launcher to stop them (plait.runtime.launch._wait_to_be_stopped)."""
    err = report(capsys, failure(r0=(-15, "SIGTERM"), r1=(-9, "SIGKILL"), r2=(-15, "SIGTERM")),
                 {0: {"time_ns": 20, "error": PEER}, 2: {"time_ns": 30, "error": PEER}})
    assert err.splitlines() == ["plait: rank 1 failed (signal SIGKILL)", "plait: the other ranks were stopped"]


def test_a_rank_notes_its_first_failure_only(tmp_path, monkeypatch):
    """ending_together notes the error before the group ends; the CLI or the excepthook meet it again later."""
    import json

    import plait.runtime.launch as launch

    monkeypatch.setenv(launch.FAILURE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(launch, "_NOTED", False)
    launch.note_failure(RuntimeError("the first"))
    launch.note_failure(RuntimeError("the same, on its way out"))
    note = json.loads((tmp_path / "rank3.json").read_text())
    assert note["error"] == "RuntimeError: the first"
