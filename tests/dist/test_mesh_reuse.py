"""Plans of one shape share one DeviceMesh in a process: `plait tune` builds hundreds of plans, and
each new mesh would leave its gloo process groups (threads, sockets) behind and slow later steps."""

from __future__ import annotations

import textwrap

import pytest

from plait.runtime.launch import run_local

pytestmark = pytest.mark.dist


def test_meshes_are_shared_by_shape_and_threads_stay_bounded(tmp_path):
    script = tmp_path / "meshes.py"
    script.write_text(textwrap.dedent("""
        import os
        from plait.axes import Degrees
        from plait.execute.mesh import build_mesh
        from plait.runtime.launch import init_distributed, shutdown_distributed
        init_distributed(timeout_s=120)
        dp2, tp2 = Degrees(dp=2), Degrees(tp=2)
        first = build_mesh(dp2, "cpu")
        tp_mesh = build_mesh(tp2, "cpu")
        assert tp_mesh is not first and tp_mesh["tp"].size() == 2 and first["dp"].size() == 2
        threads = len(os.listdir("/proc/self/task"))
        for _ in range(20):
            assert build_mesh(dp2, "cpu") is first and build_mesh(tp2, "cpu") is tp_mesh
        assert len(os.listdir("/proc/self/task")) == threads
        shutdown_distributed()
    """))
    assert run_local(2, [str(script)], module=None, timeout_s=120) == 0
