"""Fixtures shared by several unit-test modules."""

from __future__ import annotations

import os
from typing import Iterator

import pytest


@pytest.fixture(scope="module")
def bad_input_root() -> Iterator[None]:
    """A module of the bad-input world (tests/bad_input_world.py, on the path its modules set) runs inside ROOT:
    mutated configs that happen to be valid name relative log dirs. Then the report is written and the checkpoint
    directory must be byte for byte as it was."""
    from bad_input_world import CKPT, CKPT_DIGEST, ROOT, tree_digest, write_report

    previous = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(previous)
    write_report()
    assert tree_digest(CKPT) == CKPT_DIGEST


class Launched(Exception):
    """The command got past its checks to the point of starting ranks."""


@pytest.fixture
def no_launch(monkeypatch) -> type[Launched]:
    """The local launcher raises Launched instead of starting ranks; the fixture's value is that exception."""
    import plait.runtime.launch

    def stub(*args, **kwargs):
        raise Launched()

    monkeypatch.setattr(plait.runtime.launch, "run_local", stub)
    return Launched
