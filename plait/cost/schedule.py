"""Pipeline schedules as data, and an event simulator that times them.

A schedule is, per pipeline rank, the ordered list of its actions ``(kind, stage, micro_batch)``
with kind "F" (forward), "B" (full backward), or, where the backward is split (zero-bubble schedules,
Qi et al. 2024), "I" (gradient of the input, which the previous stage waits for) and "W" (gradient of the
weights, which nobody waits for); PyTorch's pipelining writes the same as "2F0". Virtual stage k lives on
rank k % p, or on a V for ZB-V and DualPipeV (rank r holds stages r and 2p - 1 - r; `stage_rank`). The simulator runs every rank's list in order: an action starts when its rank is
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

from plait.plan import stage_rank

Action = tuple[str, int, int]
"""("F" | "B" | "I" | "W", virtual stage, micro-batch)."""

WEIGHT_GRAD_SHARE = 0.5
"""Share of a stage's backward that is the weights' gradient (W) rather than the input's (I): a linear layer's two
backward GEMMs cost the same (2·tokens·params FLOPs each); the zero-bubble paper plans with T_F = T_B = T_W."""


STEADY_WITHIN = 2
"""Every schedule but GPipe repeats a steady state from this many times pp micro-batches on: after its warm-up (at
most 2p forwards) each rank runs a forward per backward, so what a rank holds at once (its activations in flight, its
receive buffers) peaks within 2p micro-batches, and more micro-batches repeat it (tests/unit/test_live_set.py checks
the receive buffers of every such schedule up to 12 ranks and 12p micro-batches, tests/unit/test_moe_cp_cost.py the
V schedules' activations up to 16p; checked once to 32 ranks and 5p). GPipe runs every forward first: what it holds
grows with the micro-batches."""


def steady_micro_batches(schedule: str, pp: int, num_micro_batches: int) -> int:
    """The micro-batches whose action order reaches every peak `num_micro_batches` reach (STEADY_WITHIN): what a
    schedule holds at once is read from this many."""
    if schedule == "gpipe":
        return num_micro_batches
    return min(num_micro_batches, STEADY_WITHIN * pp)


Slot = tuple[Action, ...]
"""One step of a rank's order as torch.distributed.pipelining's runtime steps it: one action, or two (DualPipeV's
overlapped forward + backward, which the runtime starts only once both inputs are there)."""


@lru_cache(maxsize=256)
def rank_actions(schedule: str, pp: int, num_micro_batches: int, interleave: int = 1) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, its actions in execution order."""
    return tuple(tuple(a for slot in slots for a in slot)
                 for slots in rank_slots(schedule, pp, num_micro_batches, interleave))


@lru_cache(maxsize=256)
def rank_slots(schedule: str, pp: int, num_micro_batches: int, interleave: int = 1) -> tuple[tuple[Slot, ...], ...]:
    """Per pipeline rank, its actions in the steps torch's runtime takes them (`Slot`): what its lowering of the
    receives reads (plait.cost.live_set)."""
    m = num_micro_batches
    if schedule == "dualpipev":
        return tuple(tuple(_dualpipev(r, pp, m)) for r in range(pp))
    if schedule == "zbv":
        actions = [_zbv(r, pp, m) for r in range(pp)]
    elif schedule == "gpipe":
        actions = [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(pp)]
    elif schedule == "interleaved":
        actions = [_interleaved(r, pp, m, interleave) for r in range(pp)]
    else:
        actions = [_one_f_one_b(r, pp, m) for r in range(pp)]
    return tuple(tuple((a,) for a in rank) for rank in actions)


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


def _zbv(rank: int, pp: int, m: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6), as torch.distributed.pipelining runs
    it: warm up chunk 0 with 2(p - r) - 1 forwards, interleave chunk 1's forwards, then each step runs a
    forward, an input- and a weight-gradient on each chunk; cool down with the deferred weight gradients.
    Micro-batches beyond m (the schedule needs 2p - 1 to fill) are left out."""
    n = max(2 * pp - 1, m)
    first, second = rank, 2 * pp - 1 - rank
    stages = (first, second)
    count = [0, 0, 0, 0]  # forwards of chunk 0, of chunk 1; backwards (each an I, then a W) of chunk 0, of chunk 1
    out: list[Action] = []

    def add(kind: str, chunk: int) -> None:
        slot = chunk if kind == "F" else 2 + chunk
        out.append((kind, stages[chunk], count[slot]))
        if kind != "I":
            count[slot] += 1

    for _ in range(2 * (pp - rank) - 1):
        add("F", 0)
    for _ in range(rank):
        add("F", 1)
        add("F", 0)
    for _ in range(pp - rank):
        add("F", 1), add("I", 1), add("W", 1)
    while count[1] < count[0] or count[0] < n:
        if count[0] < n:
            add("F", 0)
        add("I", 0), add("W", 0), add("F", 1), add("I", 1), add("W", 1)
    # cool-down: input gradients first, the weight gradients they leave behind after
    pending = {0: count[2], 1: count[3]}
    for _ in range(rank):
        out.append(("I", first, count[2])), out.append(("I", second, count[3]))
        count[2] += 1
        count[3] += 1
    for _ in range(pp - rank):
        out.append(("I", first, count[2]))
        count[2] += 1
        out.append(("W", first, pending[0]))
        pending[0] += 1
    out += [("W", second, i) for i in range(pending[1], count[3])]
    out += [("W", first, i) for i in range(pending[0], count[2])]
    return [a for a in out if a[2] < m]


def _dualpipev(rank: int, pp: int, m: int) -> list[Slot]:
    """DualPipeV (DeepSeek-V3's DualPipe cut in a V, as torch.distributed.pipelining runs it; needs m >= 2p): two
    chunks per rank, a forward of one chunk beside a full backward of the other in the steady state (an
    overlapped F+B: one step, its F then its B), input/weight gradients split only near the end."""
    first, second = rank, 2 * pp - 1 - rank
    counters: dict[tuple[int, str], int] = {}
    pending: list[tuple[int, int]] = []
    out: list[Slot] = []

    def act(stage: int, kind: str) -> Action:
        key = (stage, "I" if kind in ("I", "B") else kind)
        mb = counters.get(key, 0)
        counters[key] = mb + 1
        if kind == "I":
            pending.append((stage, mb))
        return (kind, stage, mb)

    def add(stage: int, kind: str) -> None:
        out.append((act(stage, kind),))

    def overlapped(forward: int, backward: int) -> None:
        out.append((act(forward, "F"), act(backward, "B")))

    def weight() -> None:
        if pending:
            stage, mb = pending.pop(0)
            out.append((("W", stage, mb),))

    for _ in range((pp - rank - 1) * 2):
        add(first, "F")
    for _ in range(rank + 1):
        add(first, "F"), add(second, "F")
    for _ in range(pp - rank - 1):
        add(second, "I"), weight(), add(second, "F")
    for i in range(m - 2 * pp + rank + 1):
        if i == 0 and rank == pp - 1:  # the first pair not overlapped
            add(first, "F"), add(second, "B")
        else:
            overlapped(first, second)
        overlapped(second, first)
    for _ in range(pp - rank - 1):
        add(second, "B"), overlapped(second, first)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        add(second, "I" if split else "B")
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        add(first, "I" if split else "B")
    for _ in range(pp - rank - 1):
        weight(), add(first, "I" if split else "B")
    for _ in range(rank + 1):
        weight()
    return out


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


def _duration(kind: str, k: int, fwd: Sequence[float], bwd: Sequence[float]) -> float:
    if kind == "F":
        return fwd[k]
    if kind == "I":
        return bwd[k] * (1.0 - WEIGHT_GRAD_SHARE)
    if kind == "W":
        return bwd[k] * WEIGHT_GRAD_SHARE
    return bwd[k]


def simulate(fwd: Sequence[float], bwd: Sequence[float], pp: int, num_micro_batches: int, schedule: str,
             p2p: float = 0.0, keep_events: bool = False) -> Timeline:
    """Run the schedule on stage times `fwd[k]`, `bwd[k]` (per micro-batch, len = pp·v)."""
    stages = len(fwd)
    m = num_micro_batches
    ranks = [stage_rank(schedule, pp, k) for k in range(stages)]
    if keep_events:
        return _simulate_traced(fwd, bwd, pp, m, schedule, p2p, ranks)
    plan = _compiled(schedule, pp, m, stages)
    # Durations and hops looked up by index: (kind code, stage) and crossing (0 or 1), as `_duration` and
    # `_input_time` define them (adding a 0.0 hop is exact, so the times are those of the traced form).
    durations = list(fwd) + list(bwd) + [b * (1.0 - WEIGHT_GRAD_SHARE) for b in bwd] + \
        [b * WEIGHT_GRAD_SHARE for b in bwd]
    hops = (0.0, p2p)
    done = [-1.0] * (2 * stages * m + 1)
    done[-1] = 0.0  # the slot a first stage's forward "waits" for: its input is there at once
    waiter = [-1] * len(done)  # the rank blocked on each slot, woken when the slot is produced
    free = [0.0] * pp
    pos = [0] * pp
    runnable = list(range(pp))
    while runnable:  # each action runs once, when its rank reaches it and its input exists
        r = runnable.pop()
        queue, i, now = plan[r], pos[r], free[r]
        n = len(queue)
        while i < n:
            needs, cross, duration_at, produces = queue[i]
            ready = done[needs]
            if ready < 0:
                waiter[needs] = r
                break
            ready += hops[cross]
            now = (now if now > ready else ready) + durations[duration_at]
            if produces >= 0:
                done[produces] = now
                if waiter[produces] >= 0:
                    runnable.append(waiter[produces])
            i += 1
        pos[r], free[r] = i, now
    if any(i < len(queue) for i, queue in zip(pos, plan)):
        raise ValueError(f"schedule {schedule!r} deadlocks with pp={pp}, m={m}, stages={stages}")
    return Timeline(makespan=max(free), busy=_busy(fwd, bwd, pp, m, ranks))


_KIND_CODE = {"F": 0, "B": 1, "I": 2, "W": 3}


@lru_cache(maxsize=256)
def _compiled(schedule: str, pp: int, m: int, stages: int) -> tuple[tuple[tuple[int, int, int, int], ...], ...]:
    """`rank_actions` as index arithmetic for `simulate`: per action (slot it waits for, whether its input
    crosses ranks, index of its duration, slot it produces or -1). Slots: forward of (k, mb) at k·m + mb,
    backward (or input gradient) at (stages + k)·m + mb, the last slot always 0.0."""
    ranks = [stage_rank(schedule, pp, k) for k in range(stages)]
    first = 2 * stages * m
    # per (kind code, stage): the slot its input is in less the micro-batch (None: the first slot, always there),
    # whether it crosses ranks, the slot it produces less the micro-batch (None for W, which produces nothing)
    forward = [(None, 0, 0) if k == 0 else ((k - 1) * m, int(ranks[k - 1] != ranks[k]), k * m) for k in range(stages)]
    backward = [(k * m, 0, (stages + k) * m) if k == stages - 1 else
                ((stages + k + 1) * m, int(ranks[k + 1] != ranks[k]), (stages + k) * m) for k in range(stages)]
    weight = [((stages + k) * m, 0, None) for k in range(stages)]
    table = (forward, backward, backward, weight)  # F, B, I, W (_KIND_CODE)
    out = []
    for queue in rank_actions(schedule, pp, m, stages // pp):
        compiled = []
        for kind, k, mb in queue:
            if not 0 <= mb < m:
                raise ValueError(f"schedule {schedule!r} with pp={pp} needs more than m={m} micro-batches")
            code = _KIND_CODE[kind]
            needs, cross, produces = table[code][k]
            compiled.append((first if needs is None else needs + mb, cross, code * stages + k,
                             -1 if produces is None else produces + mb))
        out.append(tuple(compiled))
    return tuple(out)


def _simulate_traced(fwd: Sequence[float], bwd: Sequence[float], pp: int, m: int, schedule: str, p2p: float,
                     ranks: Sequence[int]) -> Timeline:
    """`simulate` keeping every action's (rank, kind, stage, micro-batch, start, end): the readable form."""
    stages = len(fwd)
    queues = rank_actions(schedule, pp, m, stages // pp)
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
                ready = _input_time(kind, k, mb, done_f, done_b, p2p, ranks)
                if ready is None:
                    break
                duration = _duration(kind, k, fwd, bwd)
                end = max(free[r], ready) + duration
                if kind != "W":  # a weight gradient produces nothing another stage waits for
                    (done_f if kind == "F" else done_b)[k][mb] = end
                events.append((r, kind, k, mb, end - duration, end))
                free[r] = end
                i += 1
                remaining -= 1
                progressed = True
            pos[r] = i
        if not progressed:
            raise ValueError(f"schedule {schedule!r} deadlocks with pp={pp}, m={m}, stages={stages}")
    return Timeline(makespan=max(free), busy=_busy(fwd, bwd, pp, m, ranks), events=tuple(events))


def _input_time(kind: str, k: int, mb: int, done_f: list[list[float]], done_b: list[list[float]],
                p2p: float, ranks: Sequence[int]) -> float | None:
    """When the input of action (kind, virtual stage k, micro-batch mb) is on its rank: the previous stage's
    forward, the last stage's own forward, or the next stage's backward (input gradient), plus the transfer
    where the two stages are on different ranks; a weight gradient waits for its own input gradient. None while
    it has not been produced (done times are -1 until then)."""
    if kind == "W":
        return done_b[k][mb] if done_b[k][mb] >= 0 else None
    if kind == "F":
        if k == 0:
            return 0.0
        hop = p2p if ranks[k - 1] != ranks[k] else 0.0
        return done_f[k - 1][mb] + hop if done_f[k - 1][mb] >= 0 else None
    if k == len(done_f) - 1:
        return done_f[k][mb] if done_f[k][mb] >= 0 else None
    hop = p2p if ranks[k + 1] != ranks[k] else 0.0
    return done_b[k + 1][mb] + hop if done_b[k + 1][mb] >= 0 else None


def _busy(fwd: Sequence[float], bwd: Sequence[float], pp: int, m: int, ranks: Sequence[int]) -> tuple[float, ...]:
    """Compute time of each rank: m micro-batches through its virtual stages."""
    return tuple(m * sum(f + b for f, b, owner in zip(fwd, bwd, ranks) if owner == r) for r in range(pp))


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
    ranks = [stage_rank(schedule, pp, k) for k in range(stages)]
    done = {"F": [[-1.0] * m for _ in range(stages)], "B": [[-1.0] * m for _ in range(stages)]}
    pos, left = [0] * pp, [0.0] * pp  # next action per rank; work left of the one it runs (all-busy seconds)
    running, started = [False] * pp, [0.0] * pp
    events = []
    now = 0.0

    def ready_at(r: int) -> float | None:
        """When rank r's next action may start (None: its input is not produced yet)."""
        kind, k, mb = queues[r][pos[r]]
        return _input_time(kind, k, mb, done["F"], done["B"], p2p, ranks)

    remaining = sum(len(q) for q in queues)
    while remaining:
        for r in range(pp):  # start every action whose input is here
            if not running[r] and pos[r] < len(queues[r]):
                t = ready_at(r)
                if t is not None and t <= now + 1e-15:
                    kind, k, _ = queues[r][pos[r]]
                    running[r], left[r], started[r] = True, _duration(kind, k, fwd, bwd), now
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
                if kind != "W":
                    done["F" if kind == "F" else "B"][k][mb] = now
                if keep_events:
                    events.append((r, kind, k, mb, started[r], now))
                running[r], pos[r] = False, pos[r] + 1
                remaining -= 1
    return Timeline(makespan=now, busy=_busy(fwd, bwd, pp, m, ranks), events=tuple(events))


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
    ranks = [stage_rank(schedule, pp, k) for k in range(len(fwd))]
    work = max(sum(f + b for f, b, owner in zip(fwd, bwd, ranks) if owner == r) for r in range(pp))
    period = max(times[-1] - times[-2], pp * work / max(1.0, oversubscription), sum(fwd) + sum(bwd))
    return times[-1] + (m - k * pp) / pp * period


def bubble_closed_form(pp: int, num_micro_batches: int, interleave: int = 1) -> float:
    """Idle fraction of uniform stages: (p-1)/(m+p-1) for GPipe/1F1B, (p-1)/(v·m+p-1) interleaved."""
    return (pp - 1) / (interleave * num_micro_batches + pp - 1)
