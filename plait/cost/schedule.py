"""Pipeline schedules as data, and an event simulator that times them.

A schedule is, per pipeline rank, the ordered list of its actions ``(kind, stage, micro_batch)``
with kind "F" or "B" (PyTorch's pipelining writes the same as "2F0"). Virtual stage k lives on
rank k % p. The simulator runs every rank's list in order: an action starts when its rank is
free and its input has arrived (the previous stage's forward, or the next stage's backward,
plus the point-to-point time). It is exact for any stage times; the closed forms
(bubble (p-1)/(m+p-1) for GPipe/1F1B, (p-1)/(v·m+p-1) interleaved) hold for uniform stages
and are what the tests check it against.

Long schedules are simulated for growing multiples of p micro-batches until the makespan
grows by the same step twice: after warm-up every schedule here repeats with a fixed period
per p micro-batches, so the rest is extrapolated linearly (tests check it against full
simulation; uneven interleaved stages can settle late, within ~2%).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

Action = tuple[str, int, int]
"""("F" | "B", virtual stage, micro-batch)."""


@lru_cache(maxsize=256)
def rank_actions(schedule: str, pp: int, num_micro_batches: int, interleave: int = 1) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, its actions in execution order."""
    if schedule == "gpipe":
        m = num_micro_batches
        return tuple(tuple([("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]) for r in range(pp))
    if schedule == "interleaved":
        return tuple(tuple(_interleaved(r, pp, num_micro_batches, interleave)) for r in range(pp))
    return tuple(tuple(_one_f_one_b(r, pp, num_micro_batches)) for r in range(pp))


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    actions: list[Action] = [("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", rank, warmup + i), ("B", rank, i)]
    actions += [("B", rank, i) for i in range(m - warmup, m)]
    return actions


def _interleaved(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B (needs m % pp == 0): chunks rotate every pp micro-batches."""
    total = m * v
    warmup = total if m == pp else min(2 * (pp - rank - 1) + (v - 1) * pp, total)

    def unit(j: int, backward: bool) -> Action:
        chunk = (j // pp) % v
        if backward:
            chunk = v - 1 - chunk
        mb = (j // (pp * v)) * pp + j % pp
        return ("B" if backward else "F", chunk * pp + rank, mb)

    actions = [unit(j, False) for j in range(warmup)]
    for j in range(total - warmup):
        actions += [unit(warmup + j, False), unit(j, True)]
    actions += [unit(j, True) for j in range(total - warmup, total)]
    return actions


@dataclass(frozen=True)
class Timeline:
    makespan: float
    busy: tuple[float, ...]
    """Compute time of each rank."""
    events: tuple[tuple[int, str, int, int, float, float], ...] = ()
    """(rank, kind, stage, micro_batch, start, end) when asked for."""

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - max(self.busy) / self.makespan if self.makespan > 0 else 0.0


def simulate(fwd: Sequence[float], bwd: Sequence[float], pp: int, num_micro_batches: int, schedule: str,
             p2p: float = 0.0, keep_events: bool = False) -> Timeline:
    """Run the schedule on stage times `fwd[k]`, `bwd[k]` (per micro-batch, len = pp·v)."""
    stages = len(fwd)
    v = stages // pp
    m = num_micro_batches
    queues = rank_actions(schedule, pp, m, v)
    done_f = [[-1.0] * m for _ in range(stages)]
    done_b = [[-1.0] * m for _ in range(stages)]
    free = [0.0] * pp
    pos = [0] * pp
    events = []
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for r in range(pp):
            queue, i = queues[r], pos[r]
            while i < len(queue):
                kind, k, mb = queue[i]
                ready = _input_time(kind, k, mb, done_f, done_b, p2p)
                if ready is None:
                    break
                duration = (fwd if kind == "F" else bwd)[k]
                end = max(free[r], ready) + duration
                (done_f if kind == "F" else done_b)[k][mb] = end
                if keep_events:
                    events.append((r, kind, k, mb, end - duration, end))
                free[r] = end
                i += 1
                remaining -= 1
                progressed = True
            pos[r] = i
        if not progressed:
            raise ValueError(f"schedule {schedule!r} deadlocks with pp={pp}, m={m}, stages={stages}")
    return Timeline(makespan=max(free), busy=_busy(fwd, bwd, pp, m), events=tuple(events))


def _input_time(kind: str, k: int, mb: int, done_f: list[list[float]], done_b: list[list[float]],
                p2p: float) -> float | None:
    """When the input of action (kind, virtual stage k, micro-batch mb) is on its rank: the previous stage's
    forward, the last stage's own forward, or the next stage's backward, plus the transfer between ranks;
    None while it has not been produced (done times are -1 until then)."""
    if kind == "F":
        if k == 0:
            return 0.0
        return done_f[k - 1][mb] + p2p if done_f[k - 1][mb] >= 0 else None
    if k == len(done_f) - 1:
        return done_f[k][mb] if done_f[k][mb] >= 0 else None
    return done_b[k + 1][mb] + p2p if done_b[k + 1][mb] >= 0 else None


def _busy(fwd: Sequence[float], bwd: Sequence[float], pp: int, m: int) -> tuple[float, ...]:
    """Compute time of each rank: m micro-batches through its virtual stages k = r, r + pp, ..."""
    return tuple(m * sum(f + b for f, b in zip(fwd[r::pp], bwd[r::pp])) for r in range(pp))


def simulate_shared(fwd: Sequence[float], bwd: Sequence[float], pp: int, num_micro_batches: int, schedule: str,
                    p2p: float = 0.0, oversubscription: float = 1.0, keep_events: bool = False) -> Timeline:
    """`simulate` where the pipeline's ranks share cores (ClusterSpec.oversubscription o > 1, CPU processes).

    Stage times are priced at the rate each rank gets while all of them compute. With k of the pp
    ranks computing, the node's cores are shared by k instead (every data- and tensor-parallel copy
    of the pipeline runs in step with it), so each runs min(o, pp / k) times faster: a waiting stage
    lends its cores to the busy ones, but a rank cannot use more than its own threads. A fluid
    simulation: between events every computing rank advances at that speed; an action starts when
    its rank is free and its input has arrived (plus the point-to-point time, which takes no cores)."""
    if oversubscription <= 1.0:
        return simulate(fwd, bwd, pp, num_micro_batches, schedule, p2p, keep_events)
    stages, m = len(fwd), num_micro_batches
    queues = rank_actions(schedule, pp, m, stages // pp)
    done = {"F": [[-1.0] * m for _ in range(stages)], "B": [[-1.0] * m for _ in range(stages)]}
    pos, left = [0] * pp, [0.0] * pp  # next action per rank; work left of the one it runs (all-busy seconds)
    running, started = [False] * pp, [0.0] * pp
    events = []
    now = 0.0

    def ready_at(r: int) -> float | None:
        """When rank r's next action may start (None: its input is not produced yet)."""
        kind, k, mb = queues[r][pos[r]]
        return _input_time(kind, k, mb, done["F"], done["B"], p2p)

    remaining = sum(len(q) for q in queues)
    while remaining:
        for r in range(pp):  # start every action whose input is here
            if not running[r] and pos[r] < len(queues[r]):
                t = ready_at(r)
                if t is not None and t <= now + 1e-15:
                    kind, k, _ = queues[r][pos[r]]
                    running[r], left[r], started[r] = True, (fwd if kind == "F" else bwd)[k], now
        busy = [r for r in range(pp) if running[r]]
        arrivals = [t for r in range(pp) if not running[r] and pos[r] < len(queues[r])
                    for t in [ready_at(r)] if t is not None and t > now]
        if not busy and not arrivals:
            raise ValueError(f"schedule {schedule!r} deadlocks with pp={pp}, m={m}, stages={stages}")
        speed = min(oversubscription, pp / len(busy)) if busy else 0.0
        step = min([left[r] / speed for r in busy] + [t - now for t in arrivals])
        now += step
        for r in busy:
            left[r] -= step * speed
            if left[r] <= 1e-12 * (1.0 + now):
                kind, k, mb = queues[r][pos[r]]
                done[kind][k][mb] = now
                if keep_events:
                    events.append((r, kind, k, mb, started[r], now))
                running[r], pos[r] = False, pos[r] + 1
                remaining -= 1
    return Timeline(makespan=now, busy=_busy(fwd, bwd, pp, m), events=tuple(events))


def makespan(fwd: Sequence[float], bwd: Sequence[float], pp: int, num_micro_batches: int, schedule: str,
             p2p: float = 0.0, exact_up_to: int = 16, oversubscription: float = 1.0) -> float:
    """Makespan of the schedule (on cores shared `oversubscription` times over: `simulate_shared`). Past
    exact_up_to·pp micro-batches, simulate k·pp micro-batches for k = 2, 3, ... until two successive
    increments agree (the schedule's steady state), then extrapolate."""
    m = num_micro_batches

    def span(count: int) -> float:
        return simulate_shared(fwd, bwd, pp, count, schedule, p2p, oversubscription).makespan

    if pp == 1 or m <= exact_up_to * pp:
        return span(m)
    times = [span(k * pp) for k in (2, 3)]
    k = 3
    while k * pp < m:
        steps = [b - a for a, b in zip(times[-4:], times[-3:])]
        if len(steps) == 3 and max(steps) - min(steps) <= 1e-9 * times[-1]:
            break
        k += 1
        times.append(span(k * pp))
    if k * pp >= m:
        return span(m) if k * pp > m else times[-1]
    # A floor on the period for uneven interleaved stages: no rank runs faster than its own work (o times
    # faster at most on shared cores), and the node's cores do everyone's.
    work = max(sum(f + b for f, b in zip(fwd[r::pp], bwd[r::pp])) for r in range(pp))
    period = max(times[-1] - times[-2], pp * work / max(1.0, oversubscription), sum(fwd) + sum(bwd))
    return times[-1] + (m - k * pp) / pp * period


def bubble_closed_form(pp: int, num_micro_batches: int, interleave: int = 1) -> float:
    """Idle fraction of uniform stages: (p-1)/(m+p-1) for GPipe/1F1B, (p-1)/(v·m+p-1) interleaved."""
    return (pp - 1) / (interleave * num_micro_batches + pp - 1)
