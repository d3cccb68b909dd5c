"""The joint search space and its pins: which degrees, micro-batches and schedules are legal.

A pin is any argument of `plait.search.plan` that is not None. Pins that contradict the
model, the batch or the device count raise ConfigError naming the value and listing what
would work; a pin on an axis of degree 1 that has no effect (a schedule with one stage,
ZeRO with one replica) is accepted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from plait import legality
from plait.axes import ALL_AXES, Degrees
from plait.errors import ConfigError
from plait.plan import RECOMPUTE_MODES, SCHEDULES
from plait.spec import ClusterSpec, ModelSpec, TrainSpec


MAX_INTERLEAVE = 8
"""Unpinned, the search tries 2..8 model chunks per rank: beyond 8 the bubble (p-1)/(v·m) is already small and
each extra chunk adds p2p messages (a pin may ask for more)."""


@dataclass(frozen=True, kw_only=True)
class Pins:
    degrees: Mapping[str, int] = field(default_factory=dict)
    """The pinned axes only (plait.axes), e.g. {"tp": 8}."""
    zero: int | None = None
    recompute: str | tuple[str, ...] | None = None
    micro_batch: int | None = None
    schedule: str | None = None
    interleave: int | None = None
    sequence_parallel: bool | None = None
    allow_cross_node_tp: bool = False

    @classmethod
    def from_kwargs(cls, **pins: Any) -> "Pins":
        """Pins from `plait.search.plan`'s keywords: axis names (dp=2, tp=8, ...) and the other choices;
        None means not pinned. An unknown name raises ConfigError listing the known ones."""
        known = set(PIN_NAMES)
        unknown = sorted(set(pins) - known)
        if unknown:
            raise ConfigError(f"unknown pin {unknown[0]!r}; pins: {', '.join(PIN_NAMES)}")
        degrees = {a: pins.pop(a) for a in ALL_AXES if pins.get(a) is not None}
        for a in ALL_AXES:
            pins.pop(a, None)
        if isinstance(pins.get("recompute"), list):
            pins["recompute"] = tuple(pins["recompute"])
        return cls(degrees=degrees, **{k: v for k, v in pins.items() if v is not None or k == "allow_cross_node_tp"})

    def axis(self, name: str) -> int | None:
        return self.degrees.get(name)

    @property
    def dp(self) -> int | None:
        return self.degrees.get("dp")

    @property
    def tp(self) -> int | None:
        return self.degrees.get("tp")

    @property
    def pp(self) -> int | None:
        return self.degrees.get("pp")

    def to_kwargs(self) -> dict[str, Any]:
        """The keywords `from_kwargs` reads back (for a search on another device count)."""
        out = dict(self.degrees)
        for name in ("zero", "recompute", "micro_batch", "schedule", "interleave", "sequence_parallel",
                     "allow_cross_node_tp"):
            out[name] = getattr(self, name)
        return out


PIN_NAMES: tuple[str, ...] = ALL_AXES + ("zero", "recompute", "micro_batch", "schedule", "interleave",
                                         "sequence_parallel", "allow_cross_node_tp")
"""Everything a search can be pinned to (`plait plan --dp ...`, `[plan] pins` in a train config)."""


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _listing(values: Sequence[int]) -> str:
    values = list(values)
    return ", ".join(map(str, values)) if values else "none"


def tp_degrees(model: ModelSpec, cluster: ClusterSpec, num_devices: int, allow_cross_node: bool) -> list[int]:
    """Tensor degrees the model allows (plait.legality.tensor_problems) that (unless allowed) stay inside a node."""
    out = []
    for t in divisors(num_devices):
        if legality.tensor_problems(model, t):
            continue
        if not allow_cross_node and (t > cluster.devices_per_node or cluster.devices_per_node % t):
            continue
        out.append(t)
    return out


def pp_degrees(model: ModelSpec, num_devices: int) -> list[int]:
    return [p for p in divisors(num_devices) if not legality.stage_problems(model.num_layers, p, 1)]


def check_pins(pins: Pins, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, num_devices: int) -> None:
    """Raise ConfigError for a pin no plan can honour."""
    n, batch = num_devices, train.global_batch
    for name, value in [*pins.degrees.items(), ("micro_batch", pins.micro_batch), ("interleave", pins.interleave)]:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    if pins.zero is not None and pins.zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero={pins.zero!r} is not one of 0, 1, 2, 3")
    if pins.schedule is not None and pins.schedule not in SCHEDULES:
        raise ConfigError(f"schedule={pins.schedule!r} is not one of {', '.join(SCHEDULES)}")
    modes = (pins.recompute,) if isinstance(pins.recompute, str) else (pins.recompute or ())
    for mode in modes:
        if mode not in RECOMPUTE_MODES:
            raise ConfigError(f"recompute={mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if pins.tp is not None:
        valid = tp_degrees(model, cluster, n, pins.allow_cross_node_tp)
        if pins.tp not in valid:
            why = _tp_reason(pins.tp, model, cluster, n, pins.allow_cross_node_tp)
            raise ConfigError(f"tp={pins.tp} {why}; valid tp for {model.name} on {n} devices: {_listing(valid)}")
    if pins.pp is not None and pins.pp not in pp_degrees(model, n):
        raise ConfigError(f"pp={pins.pp} must divide {n} devices and be <= num_layers={model.num_layers}; "
                          f"valid pp: {_listing(pp_degrees(model, n))}")
    if pins.dp is not None:
        valid = [d for d in divisors(n) if batch % d == 0]
        if pins.dp not in valid:
            raise ConfigError(f"dp={pins.dp} must divide both {n} devices and global_batch={batch}; "
                              f"valid dp: {_listing(valid)}")
    fixed = [v for v in (pins.dp, pins.tp, pins.pp) if v is not None]
    product = 1
    for v in fixed:
        product *= v
    if n % product or (len(fixed) == 3 and product != n):
        raise ConfigError(f"dp x tp x pp = {pins.dp or '?'} x {pins.tp or '?'} x {pins.pp or '?'} cannot make "
                          f"{n} devices; the product of the pinned degrees must divide {n} (equal it when all three are pinned)")
    if isinstance(pins.recompute, tuple) and pins.pp is not None and len(pins.recompute) not in (1, pins.pp):
        raise ConfigError(f"recompute={list(pins.recompute)} must hold one mode or pp={pins.pp} modes (one per rank)")
    if pins.interleave is not None and pins.pp is not None:
        problems = legality.interleave_problems(pins.pp, pins.interleave)
        if problems:
            raise legality.IllegalPlan(problems)
    if pins.interleave is not None and pins.interleave > 1 and pins.schedule not in (None, "interleaved"):
        raise ConfigError(f"interleave={pins.interleave} needs schedule='interleaved', not {pins.schedule!r}")
    if pins.micro_batch is not None:
        dps = [d for d in divisors(n) if batch % d == 0 and (pins.dp is None or d == pins.dp)]
        if not any((batch // d) % pins.micro_batch == 0 for d in dps):
            valid = sorted({b for d in dps for b in divisors(batch // d)})
            raise ConfigError(f"micro_batch={pins.micro_batch} divides no per-replica batch of global_batch={batch}; "
                              f"valid micro_batch: {_listing(valid)}")


def _tp_reason(tp: int, model: ModelSpec, cluster: ClusterSpec, n: int, allow_cross_node: bool) -> str:
    if n % tp:
        return f"does not divide {n} devices"
    problems = legality.tensor_problems(model, tp)
    if problems:  # "num_heads=12 is not divisible by tp=8" -> "does not divide num_heads=12"
        return "does not divide " + problems[0].message.split(" is not divisible")[0]
    return (f"does not fit inside a node of {cluster.devices_per_node} devices "
            f"(pass allow_cross_node_tp / --allow-cross-node-tp to allow it)")


def degree_choices(pins: Pins, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, num_devices: int
                   ) -> list[Degrees]:
    """Every (dp, tp, pp) with dp·tp·pp = N that honours the pins and divides the batch."""
    out = []
    for tp in tp_degrees(model, cluster, num_devices, pins.allow_cross_node_tp):
        for pp in pp_degrees(model, num_devices // tp):
            dp = num_devices // (tp * pp)
            if train.global_batch % dp:
                continue
            if any(pin is not None and pin != v for pin, v in ((pins.dp, dp), (pins.tp, tp), (pins.pp, pp))):
                continue
            if isinstance(pins.recompute, tuple) and len(pins.recompute) not in (1, pp):
                continue
            if cluster.mixed and any(g.num_devices % (dp * tp) for g in cluster.groups):
                continue  # every pipeline rank's dp x tp devices must sit in one device group
            out.append(Degrees(dp=dp, tp=tp, pp=pp))
    return out


def schedule_choices(pins: Pins, pp: int, num_micro_batches: int, num_layers: int) -> Iterator[tuple[str, int]]:
    """(schedule, interleave) pairs the pins allow and plait.legality accepts: with one stage the schedule has
    no effect (the pin, or 1f1b, is kept)."""
    m = num_micro_batches
    if pp == 1:
        if not legality.interleave_problems(pp, pins.interleave or 1):  # a pinned interleave needs a pipeline
            yield (pins.schedule or "1f1b"), 1
        return
    # GPipe has 1F1B's bubble and holds all m micro-batches instead of at most p: unpinned, it is tried only
    # where 1F1B cannot run (m < pp).
    candidates = []
    if pins.schedule == "gpipe" or (pins.schedule is None and m < pp):
        candidates.append(("gpipe", 1))
    if pins.schedule in (None, "1f1b"):
        candidates.append(("1f1b", 1))
    if pins.schedule in (None, "interleaved"):
        vs = [pins.interleave] if pins.interleave else range(2, min(MAX_INTERLEAVE, num_layers // pp) + 1)
        candidates += [("interleaved", v) for v in vs]
    for schedule, v in candidates:
        if pins.interleave is not None and v != pins.interleave:
            continue
        if legality.schedule_problems(schedule, pp, m, v) or legality.stage_problems(num_layers, pp, v):
            continue
        yield schedule, v


@dataclass(frozen=True)
class Space:
    """The joint space a solver searches: the degree choices the pins and legality allow, and every layout of
    each (sequence parallel x micro-batch x ZeRO x schedule, and on a mixed cluster x the device group of each
    pipeline rank)."""

    pins: Pins
    degrees: list[Degrees]
    global_batch: int
    num_layers: int
    groups: tuple[tuple[str, int], ...] = ()
    """A mixed cluster's (group name, devices) in rank order; () for a uniform cluster."""

    def group_counts(self, d: Degrees) -> dict[str, int]:
        """Pipeline ranks each device group holds for these degrees (its devices over dp x cp x tp)."""
        block = d.dp * d.cp * d.tp
        return {name: devices // block for name, devices in self.groups}

    def orderings(self, d: Degrees) -> list[tuple[str, ...]]:
        """Every distinct assignment of device groups to the pipeline ranks (a multiset permutation); [()] on a
        uniform cluster. Their number grows as pp! / Π c_g!: what the learned solver avoids enumerating."""
        if not self.groups:
            return [()]
        return list(_multiset_permutations(self.group_counts(d)))

    def count_orderings(self, d: Degrees) -> int:
        if not self.groups:
            return 1
        counts = self.group_counts(d)
        total = math.factorial(sum(counts.values()))
        for c in counts.values():
            total //= math.factorial(c)
        return total

    def families(self, d: Degrees) -> Iterator[tuple[tuple, list["Any"]]]:
        """Layouts of these degrees grouped by everything but the micro-batch size: (key, layouts by growing b)."""
        groups: dict[tuple, list] = {}
        for layout in self.layouts(d):
            key = (layout.degrees, layout.sp, layout.zero, layout.schedule, layout.interleave, layout.stage_groups)
            groups.setdefault(key, []).append(layout)
        yield from groups.items()

    def layouts(self, d: Degrees, orderings: list[tuple[str, ...]] | None = None, base=None) -> Iterator["Any"]:
        """Every layout of these degrees: sequence parallel x micro-batch x ZeRO x schedule (x the device-group
        `orderings`, default all of them, generated lazily), smaller b first; only `base`'s when given."""
        for one in (self.base_layouts(d) if base is None else [base]):
            for ordering in (self.iter_orderings(d) if orderings is None else orderings):
                yield dataclasses.replace(one, stage_groups=ordering) if ordering else one

    def iter_orderings(self, d: Degrees) -> Iterator[tuple[str, ...]]:
        if not self.groups:
            yield ()
            return
        yield from _multiset_permutations(self.group_counts(d))

    def base_layouts(self, d: Degrees) -> Iterator["Any"]:
        """The layouts of these degrees before device groups are assigned."""
        from plait.cost.layout import Layout

        pins = self.pins
        # Unpinned, sequence parallelism is always on for tp > 1: it moves the same bytes as tensor parallelism's
        # all-reduces and keeps less activation memory, so the cost model never prefers it off.
        sps = [False] if d.tp == 1 else ([pins.sequence_parallel] if pins.sequence_parallel is not None else [True])
        zeros = [pins.zero] if pins.zero is not None else distinct_zeros(d)
        per_replica = self.global_batch // d.dp
        for sp in sps:
            for b in divisors(per_replica):
                if pins.micro_batch is not None and b != pins.micro_batch:
                    continue
                m = per_replica // b
                for zero in zeros:
                    for schedule, v in schedule_choices(pins, d.pp, m, self.num_layers):
                        yield Layout(d, sp and d.tp > 1, zero, b, m, schedule, v)

    def all_layouts(self) -> list["Any"]:
        return [layout for d in self.degrees for layout in self.layouts(d)]


def distinct_zeros(d: Degrees) -> list[int]:
    """The ZeRO stages that run differently on these degrees (plait.legality.data_parallel_mode), each named by the
    largest stage of those that run alike: where fully_shard carries ZeRO 0/1 (a pipeline, tensor parallelism) it
    shards gradients and optimizer states as ZeRO-2 does, so only 2 is listed; under a pipeline ZeRO-3 runs as
    ZeRO-2 too, so it is listed only when pinned."""
    runs: dict[tuple[str, bool], int] = {}
    for zero in (0, 1, 2, 3):
        if zero == 3 and d.pp > 1:
            continue
        mode = legality.data_parallel_mode(d, zero)
        if mode.carrier == "none":  # one replica: ZeRO has nothing to shard
            return [0]
        # DDP runs ZeRO-1 apart (ZeroRedundancyOptimizer); fully_shard runs 0, 1 and 2 alike
        runs[(mode.carrier, mode.reshard_after_forward, zero if mode.carrier == "ddp" else None)] = zero
    return sorted(runs.values())


def _multiset_permutations(counts: dict[str, int]) -> Iterator[tuple[str, ...]]:
    """Each distinct sequence holding `counts[g]` copies of every g, in lexicographic order of the groups."""
    names = list(counts)
    total = sum(counts.values())
    left = dict(counts)
    prefix: list[str] = []

    def walk() -> Iterator[tuple[str, ...]]:
        if len(prefix) == total:
            yield tuple(prefix)
            return
        for name in names:
            if left[name]:
                left[name] -= 1
                prefix.append(name)
                yield from walk()
                prefix.pop()
                left[name] += 1

    yield from walk()
