"""A documented, reproducible slow rank for experiments on one machine: the mixed-cluster emulation
(DeviceGroup.slowdown) and the straggler of `plait train --adapt` (PLAIT_THROTTLE).

A throttled rank runs every block `factor` times as long as it takes: after each block's forward it sleeps
(factor - 1) times the forward's duration, and after each block's backward (measured from the gradient's arrival
at the block's output to its arrival at the block's input) (factor - 1) times that. Sleeping takes no core, so the
other ranks' speed is what it was: the rank behaves as a device `factor` times slower, its communication not.

    PLAIT_THROTTLE="rank=3:factor=2" plait train run.toml --nproc 4
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from plait.errors import ConfigError

ENV = "PLAIT_THROTTLE"


@dataclass(frozen=True)
class Throttle:
    ranks: tuple[int, ...]
    factor: float


def parse_throttle(text: str) -> Throttle:
    """"rank=3:factor=2" or "rank=2,3:factor=1.5"."""
    fields = dict(part.partition("=")[::2] for part in text.strip().split(":"))
    try:
        ranks = tuple(int(r) for r in fields["rank"].split(","))
        factor = float(fields["factor"])
    except (KeyError, ValueError):
        raise ConfigError(f"{ENV}={text!r} must look like 'rank=3:factor=2' (ranks comma-separated, factor >= 1)") \
            from None
    if factor < 1 or set(fields) != {"rank", "factor"}:
        raise ConfigError(f"{ENV}={text!r}: factor must be >= 1 and the only keys rank and factor")
    return Throttle(ranks, factor)


def planned_throttle(rank: int, plan, pp_rank: int) -> float:
    """This rank's slow-down factor: PLAIT_THROTTLE's, else its device group's emulated slowdown (1: none)."""
    text = os.environ.get(ENV)
    if text:
        throttle = parse_throttle(text)
        return throttle.factor if rank in throttle.ranks else 1.0
    if plan.stage_groups:
        return plan.cluster.group(plan.stage_groups[pp_rank]).slowdown
    return 1.0


def apply_throttle(blocks: list[nn.Module], factor: float) -> None:
    """Make each block take `factor` times its forward and backward time on this rank (see the module docstring)."""
    if factor <= 1.0:
        return
    extra = factor - 1.0
    # Time the hooks already stand for: forward (and recomputed forward) compute and every sleep. A block's
    # backward interval spans its successor's sleep and, under recomputation, its own re-run forward; counting
    # those again would compound the slow-down block after block (measured: 4 blocks at factor 2 ran 3.4x).
    accounted = [0.0]

    def before(module, args):
        module._plait_t0 = time.perf_counter()
        for x in args:
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda grad, m=module: _backward_done(m, grad))
                break

    def after(module, args, output):
        spent = time.perf_counter() - module._plait_t0
        time.sleep(extra * spent)
        accounted[0] += time.perf_counter() - module._plait_t0
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, m=module: _backward_start(m, grad))

    def _backward_start(module, grad):
        module._plait_b0 = (time.perf_counter(), accounted[0])
        return grad

    def _backward_done(module, grad):
        began = getattr(module, "_plait_b0", None)
        if began is not None:
            t0, counted = began
            spent = time.perf_counter() - t0 - (accounted[0] - counted)
            slept = time.perf_counter()
            time.sleep(extra * max(spent, 0.0))
            accounted[0] += time.perf_counter() - slept
            module._plait_b0 = None
        return grad

    for block in blocks:
        block._plait_throttle = factor  # for inspection: this block runs `factor` times slower
        block.register_forward_pre_hook(before)
        block.register_forward_hook(after)
