"""What a pipeline rank holds at once, read from the schedule's own action order: one rule for the executor's
receive-buffer pool (plait/execute/buffers.py sizes its pool with it) and the cost model (plait/cost/memory.py
prices the buffers with it).

A rank's order with its communication, per action ``(kind, virtual stage, micro-batch)``: the compute kinds of
plait.cost.schedule ("F", "B", "I", "W") and "RF" / "RB", where the rank posts the receive of a stage's input or of
its output's gradient (a buffer is taken then). The input's buffer is the leaf the stage's autograd graph starts at,
so it is held until the micro-batch's backward is done (its weight-gradient half "W" where the backward is split:
the first block's weight gradient reads it); the gradient's buffer until the backward that consumes it ("B" or
"I"). Stages of one rank that are neighbours (the turn of a V) hand tensors over without a receive.

Where torch.distributed.pipelining posts the receives:

* GPipe and 1F1B (torch's single-stage schedules): right before the compute that consumes them;
* the multi-stage runtime (interleaved, ZB-V, DualPipeV): where its lowering (torch's ``_add_send_recv``) puts
  them: the ranks are stepped in lockstep, rank by rank, each running its next compute action once its input has
  been produced, and the receive is posted on the receiving rank as soon as the sender has sent -- possibly well
  before the compute that needs it. Its steps include the idle steps and overlapped forward + backward pairs of
  torch's own compute order (plait.cost.schedule.rank_slots writes them as torch does), which move a receive by
  a step. `with_receives` lowers them as torch's ``_add_send_recv`` does: the order the executor runs and sizes
  its pool over (plait/execute/pipeline.py); tests check the two give the same buffers on every rank.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from plait.cost.schedule import Action, Slot, rank_actions, rank_slots, stage_rank, steady_micro_batches

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
"""Schedules torch runs with its single-stage loop (receives posted right before their compute)."""
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
"""The torch.distributed.pipelining class that runs each of plait's schedules (plait/execute/pipeline.py builds
them from this table)."""
_TORCH_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W",
                "RECV_F": "RF", "RECV_B": "RB"}


@dataclass(frozen=True)
class LiveBuffers:
    """A rank's receive buffers at their peak, counted in one stage's input tensors (micro-batch hidden states)."""

    inputs: int
    """Input receive buffers held at once (taken at "RF", returned after the micro-batch's backward)."""
    grads: int
    """Gradient receive buffers held at once (taken at "RB", returned after the backward that consumes them)."""


def _needs_receive(kind: str, stage: int, num_stages: int, rank_of: Callable[[int], int]) -> bool:
    """Whether compute action (kind, stage) takes its input from another rank."""
    if kind == "F":
        return stage > 0 and rank_of(stage - 1) != rank_of(stage)
    if kind in ("B", "I"):
        return stage < num_stages - 1 and rank_of(stage + 1) != rank_of(stage)
    return False


def _receive_of(kind: str) -> str:
    return "RF" if kind == "F" else "RB"


def receives_before_compute(compute: Sequence[Sequence[Action]], num_stages: int,
                            rank_of: Callable[[int], int]) -> tuple[tuple[Action, ...], ...]:
    """Each receive posted right before the compute that consumes it (torch's GPipe and 1F1B loops)."""
    out = []
    for actions in compute:
        order: list[Action] = []
        for kind, stage, mb in actions:
            if _needs_receive(kind, stage, num_stages, rank_of):
                order.append((_receive_of(kind), stage, mb))
            order.append((kind, stage, mb))
        out.append(tuple(order))
    return tuple(out)


def receives_in_lockstep(compute: Sequence[Sequence[Slot]], num_stages: int,
                         rank_of: Callable[[int], int]) -> tuple[tuple[Action, ...], ...]:
    """Receives where torch's multi-stage runtime posts them (module docstring): round after round, every rank in
    order takes its next step if its inputs are there (received, or produced by a stage of its own; an idle step
    always is), and a compute whose output goes to another rank posts that rank's receive at once. (A rank whose
    next step waited is not looked at again until a receive reaches it: nothing else can make that step ready.)"""
    owner = [rank_of(stage) for stage in range(num_stages)]
    num_ranks = len(compute)
    next_step = [0] * num_ranks
    orders: list[list[Action]] = [[] for _ in compute]
    # A stage's input (gradient) is there once its producer ran: on the same rank, or on another, whose send posted
    # the receive then. Each stage has one rank, so one flag per (stage, micro-batch) serves every rank.
    width = 1 + max((mb for slots in compute for slot in slots for _, _, mb in slot), default=0)
    has_input, has_grad = bytearray(num_stages * width), bytearray(num_stages * width)

    def ready(kind: str, stage: int, mb: int) -> bool:
        if kind == "F":
            return stage == 0 or bool(has_input[stage * width + mb])
        if kind == "W":
            return True
        return stage == num_stages - 1 or bool(has_grad[stage * width + mb])

    # Each round visits the ranks in order; one that waited is left out until a receive wakes it (nothing else can
    # make its step ready), and joins this round if the waking rank comes before it, the next one otherwise.
    waiting = [False] * num_ranks
    this_round, next_round = [r for r in range(num_ranks) if compute[r]], []
    while this_round:
        while this_round:
            rank = heapq.heappop(this_round)
            slot = compute[rank][next_step[rank]]
            if not all(ready(*action) for action in slot):
                waiting[rank] = True
                continue
            next_step[rank] += 1
            if next_step[rank] < len(compute[rank]):
                next_round.append(rank)
            for action in slot:
                kind, stage, mb = action
                orders[rank].append(action)
                if kind == "W":  # F, B and I produce what a neighbour stage consumes
                    continue
                peer_stage = stage + 1 if kind == "F" else stage - 1
                if 0 <= peer_stage < num_stages:
                    (has_input if kind == "F" else has_grad)[peer_stage * width + mb] = 1
                    peer = owner[peer_stage]
                    if peer != rank:
                        orders[peer].append((_receive_of(kind), peer_stage, mb))
                        if waiting[peer]:
                            waiting[peer] = False
                            if peer > rank:
                                heapq.heappush(this_round, peer)
                            else:
                                next_round.append(peer)
        this_round, next_round = sorted(next_round), []
    if any(n < len(slots) for n, slots in zip(next_step, compute)):
        raise ValueError("the schedule's actions cannot be ordered: an input is never produced")
    return tuple(tuple(order) for order in orders)


def torch_order(actions) -> list[Action]:
    """A torch schedule's actions (one rank's ``pipeline_order_with_comms``) as `peak_buffers` reads them: its
    computes and receives, an overlapped forward + backward as its two halves."""
    out: list[Action] = []
    for action in actions:
        if action is None:
            continue
        if action.sub_actions:
            out += torch_order(action.sub_actions)
        elif action.computation_type.name in _TORCH_KINDS:
            out.append((_TORCH_KINDS[action.computation_type.name], action.stage_index, action.microbatch_index))
    return out


@lru_cache(maxsize=1024)
def with_receives(schedule: str, pp: int, num_micro_batches: int, interleave: int = 1) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, its actions with the receives where torch.distributed.pipelining posts them."""
    num_stages = pp * interleave

    def rank_of(stage: int) -> int:
        return stage_rank(schedule, pp, stage)

    if schedule in SINGLE_STAGE_SCHEDULES:
        return receives_before_compute(rank_actions(schedule, pp, num_micro_batches, interleave), num_stages, rank_of)
    steps = [torch_steps(slots, num_micro_batches) for slots in rank_slots(schedule, pp, num_micro_batches, interleave)]
    return receives_in_lockstep(steps, num_stages, rank_of)


MAX_ACTIVE_STAGES = 3
"""Stages torch's lowering keeps unsharded ahead (``_add_unshard_reshard``'s default)."""


def torch_steps(slots: Sequence[Slot], num_micro_batches: int) -> list[Slot]:
    """A rank's steps as torch's multi-stage lowering takes them (``_add_unshard_reshard`` then ``_add_reduce_grad``,
    before ``_add_send_recv``): its compute steps, and a step of no compute for each stage it unshards before use
    (the next MAX_ACTIVE_STAGES stages it runs), reshards once out of that window or at the end, and each stage's
    gradient reduction after its last backward. They move no tensor, but each takes the rank's turn of a round of
    the lockstep, which decides where a receive lands."""
    ahead: list[set[int]] = [set()] * len(slots)  # the first MAX_ACTIVE_STAGES stages to run from each step on
    order: list[int] = []
    for i in range(len(slots) - 1, -1, -1):
        for _, stage, _ in reversed(slots[i]):
            if stage in order:
                order.remove(stage)
            order.insert(0, stage)
        ahead[i] = set(order[:MAX_ACTIVE_STAGES])
    steps: list[Slot] = []
    active: set[int] = set()
    backwards: dict[int, int] = {}
    for slot, upcoming in zip(slots, ahead):
        steps += [()] * (len(active - upcoming) + len(upcoming - active)) + [slot]
        active = upcoming
        for kind, stage, _ in slot:
            if kind in ("B", "W"):
                backwards[stage] = backwards.get(stage, 0) + 1
                if backwards[stage] == num_micro_batches:
                    steps.append(())
    return steps + [()] * len(active)


def peak_buffers(order: Sequence[Action]) -> LiveBuffers:
    """The most input and gradient receive buffers one rank's `order` (with its "RF" / "RB") holds at once."""
    inputs: set[tuple[int, int]] = set()
    grads: set[tuple[int, int]] = set()
    split = {(stage, mb) for kind, stage, mb in order if kind == "W"}  # backward split: the input lives until W
    peak_inputs = peak_grads = 0
    for kind, stage, mb in order:
        if kind == "RF":
            inputs.add((stage, mb))
            if len(inputs) > peak_inputs:
                peak_inputs = len(inputs)
        elif kind == "RB":
            grads.add((stage, mb))
            if len(grads) > peak_grads:
                peak_grads = len(grads)
        elif kind == "B" or kind == "I":
            key = (stage, mb)
            grads.discard(key)
            if key not in split:
                inputs.discard(key)
        elif kind == "W":
            inputs.discard((stage, mb))
    return LiveBuffers(inputs=peak_inputs, grads=peak_grads)


@lru_cache(maxsize=1024)
def live_buffers(schedule: str, pp: int, num_micro_batches: int, interleave: int = 1) -> tuple[LiveBuffers, ...]:
    """Per pipeline rank, its receive buffers at their peak: what the executor's pool holds and the cost model
    prices."""
    if pp == 1:
        return (LiveBuffers(0, 0),)
    steady = steady_micro_batches(schedule, pp, num_micro_batches)
    if steady < num_micro_batches:  # more micro-batches repeat the steady state
        return live_buffers(schedule, pp, steady, interleave)
    return tuple(peak_buffers(order) for order in with_receives(schedule, pp, num_micro_batches, interleave))
