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
from plait.axes import ALL_AXES, Degrees, OnAxes
from plait.errors import ConfigError
from plait.plan import RECOMPUTE_MODES, SCHEDULES, V_SCHEDULES
from plait.spec import ClusterSpec, ModelSpec, TrainSpec


MAX_INTERLEAVE = 8
"""Unpinned, the search tries 2..8 model chunks per rank: beyond 8 the bubble (p-1)/(v·m) is already small and
each extra chunk adds p2p messages (a pin may ask for more)."""


@dataclass(frozen=True, kw_only=True)
class Pins(OnAxes):
    degrees: Mapping[str, int] = field(default_factory=dict)
    """The pinned axes only (plait.axes), e.g. {"tp": 8}."""
    zero: int | None = None
    recompute: str | tuple[str, ...] | None = None
    micro_batch: int | None = None
    schedule: str | None = None
    interleave: int | None = None
    sequence_parallel: bool | None = None
    context_parallel: str | None = None
    """How context-parallel ranks exchange keys and values ("all_gather" or "all_to_all"); None: both are tried."""
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
        """The pinned degree of `name`, None where not pinned (pins.dp, pins.tp, ... read it: plait.axes.OnAxes)."""
        return self.degrees.get(name)

    def to_kwargs(self) -> dict[str, Any]:
        """The keywords `from_kwargs` reads back (for a search on another device count)."""
        out = dict(self.degrees)
        for name in ("zero", "recompute", "micro_batch", "schedule", "interleave", "sequence_parallel",
                     "context_parallel", "allow_cross_node_tp"):
            out[name] = getattr(self, name)
        return out


PIN_NAMES: tuple[str, ...] = ALL_AXES + ("zero", "recompute", "micro_batch", "schedule", "interleave",
                                         "sequence_parallel", "context_parallel", "allow_cross_node_tp")
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


CONTEXT_KINDS: tuple[str, ...] = ("all_gather", "all_to_all")
"""How context-parallel ranks see each other's keys and values (plait/execute/context.py); the search prices both."""


def cp_degrees(model: ModelSpec, seq_len: int, num_devices: int) -> list[int]:
    """Context degrees plait.legality allows for this model and sequence (cp = 1 always)."""
    return [c for c in divisors(num_devices) if c == 1 or not (
        legality.sequence_problems(model, seq_len, 1, False, c) or legality.context_problems(
            model, Degrees(cp=c), "all_gather"))]


def ep_degrees(model: ModelSpec, dp: int) -> list[int]:
    """Expert degrees plait.legality allows for this model inside a data-parallel group of `dp` (ep = 1 always)."""
    return [e for e in divisors(dp) if not legality.expert_problems(model, e)]


def context_kinds(pins: Pins, model: ModelSpec, d: Degrees) -> list[str]:
    """The key/value exchanges the pins and plait.legality allow for these degrees (["all_gather"] when cp = 1: the
    kind has no effect there)."""
    if d.cp == 1:
        return ["all_gather"]
    kinds = [pins.context_parallel] if pins.context_parallel else list(CONTEXT_KINDS)
    return [k for k in kinds if not legality.context_problems(model, d, k)]


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
            raise ConfigError(f"{why}; valid tp for {model.name} on {n} devices: {_listing(valid)}")
    if pins.pp is not None and pins.pp not in pp_degrees(model, n):
        raise ConfigError(f"pp={pins.pp} must divide {n} devices and be <= num_layers={model.num_layers}; "
                          f"valid pp: {_listing(pp_degrees(model, n))}")
    if pins.dp is not None:
        valid = [d for d in divisors(n) if batch % d == 0]
        if pins.dp not in valid:
            raise ConfigError(f"dp={pins.dp} must divide both {n} devices and global_batch={batch}; "
                              f"valid dp: {_listing(valid)}")
    _check_context_and_expert_pins(pins, model, train, n)
    axes = ("dp", "cp", "tp", "pp")
    fixed = [pins.axis(a) for a in axes if pins.axis(a) is not None]
    product = 1
    for v in fixed:
        product *= v
    if n % product or (len(fixed) == len(axes) and product != n):
        shown = " x ".join(str(pins.axis(a) or "?") for a in axes)
        raise ConfigError(f"dp x cp x tp x pp = {shown} cannot make {n} devices; the product of the pinned degrees "
                          f"must divide {n} (equal it when all four are pinned)")
    if isinstance(pins.recompute, tuple) and pins.pp is not None and len(pins.recompute) not in (1, pins.pp):
        raise ConfigError(f"recompute={list(pins.recompute)} must hold one mode or pp={pins.pp} modes (one per rank)")
    if pins.interleave is not None and pins.pp is not None:
        problems = legality.interleave_problems(pins.pp, pins.interleave)
        if problems:
            raise legality.IllegalPlan(problems)
    if pins.interleave is not None and pins.interleave > 1 and pins.schedule not in (None, "interleaved", *V_SCHEDULES):
        raise ConfigError(f"interleave={pins.interleave} needs schedule='interleaved', not {pins.schedule!r}")
    if pins.interleave not in (None, 2) and pins.schedule in V_SCHEDULES:
        raise ConfigError(f"schedule={pins.schedule!r} holds exactly two stages per pipeline rank (a V); use "
                          f"interleave=2 or leave it out, not {pins.interleave}")
    if pins.micro_batch is not None:
        dps = [d for d in divisors(n) if batch % d == 0 and (pins.dp is None or d == pins.dp)]
        if not any((batch // d) % pins.micro_batch == 0 for d in dps):
            valid = sorted({b for d in dps for b in divisors(batch // d)})
            raise ConfigError(f"micro_batch={pins.micro_batch} divides no per-replica batch of global_batch={batch}; "
                              f"valid micro_batch: {_listing(valid)}")


def _check_context_and_expert_pins(pins: Pins, model: ModelSpec, train: TrainSpec, n: int) -> None:
    cp, ep = pins.axis("cp"), pins.axis("ep")
    if pins.context_parallel is not None and pins.context_parallel not in CONTEXT_KINDS:
        raise ConfigError(f"context_parallel={pins.context_parallel!r} is not one of {', '.join(CONTEXT_KINDS)}")
    if cp is not None and cp not in cp_degrees(model, train.seq_len, n):
        problems = legality.sequence_problems(model, train.seq_len, 1, False, cp) or legality.context_problems(
            model, Degrees(cp=cp), "all_gather")
        why = problems[0].message if problems else f"cp={cp} does not divide {n} devices"
        raise ConfigError(f"{why}; valid cp: {_listing(cp_degrees(model, train.seq_len, n))}")
    if cp is not None and pins.context_parallel is not None:
        tp = pins.tp or 1
        problems = legality.context_problems(model, Degrees(cp=cp, tp=tp), pins.context_parallel)
        if problems and model.num_heads % tp == 0:
            raise legality.IllegalPlan(problems)
    if ep is not None:
        problems = legality.expert_problems(model, ep)
        if problems:
            raise legality.IllegalPlan(problems)
        dps = [d for d in divisors(n) if train.global_batch % d == 0 and d % ep == 0
               and (pins.dp is None or d == pins.dp)]
        if not dps:
            raise ConfigError(f"ep={ep} must divide dp (expert parallelism splits each data-parallel group), but no "
                              f"dp dividing {n} devices and global_batch={train.global_batch}"
                              f"{f' (pinned dp={pins.dp})' if pins.dp else ''} is a multiple of {ep}")


def _tp_reason(tp: int, model: ModelSpec, cluster: ClusterSpec, n: int, allow_cross_node: bool) -> str:
    """Why tp is refused, as a sentence that starts with "tp=N"."""
    if n % tp:
        return f"tp={tp} does not divide {n} devices"
    problems = legality.tensor_problems(model, tp)
    if problems and problems[0].rule.startswith("tp-divides-"):
        # "num_heads=12 is not divisible by tp=8" -> "tp=8 does not divide num_heads=12"
        return f"tp={tp} does not divide " + problems[0].message.split(" is not divisible")[0]
    if problems:  # the class's plan: its rule says it whole ("tp=2: stablelm declares ...")
        return problems[0].message
    return (f"tp={tp} does not fit inside a node of {cluster.devices_per_node} devices "
            f"(pass allow_cross_node_tp / --allow-cross-node-tp to allow it)")


def degree_choices(pins: Pins, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, num_devices: int
                   ) -> list[Degrees]:
    """Every (dp, cp, tp, pp) with dp·cp·tp·pp = N, and ep dividing dp, that honours the pins, divides the batch and
    that plait.legality allows (context parallelism for this sequence, expert parallelism for these experts)."""
    out = []
    cps = cp_degrees(model, train.seq_len, num_devices)
    for tp in tp_degrees(model, cluster, num_devices, pins.allow_cross_node_tp):
        for pp in pp_degrees(model, num_devices // tp):
            for cp in cps:
                if (num_devices // (tp * pp)) % cp:
                    continue
                dp = num_devices // (tp * pp * cp)
                if train.global_batch % dp:
                    continue
                if any(pins.axis(a) is not None and pins.axis(a) != v for a, v in (("dp", dp), ("tp", tp), ("pp", pp),
                                                                                   ("cp", cp))):
                    continue
                if isinstance(pins.recompute, tuple) and len(pins.recompute) not in (1, pp):
                    continue
                if cluster.mixed and any(g.num_devices % (dp * cp * tp) for g in cluster.groups):
                    continue  # every pipeline rank's dp x cp x tp devices must sit in one device group
                for ep in ep_degrees(model, dp):
                    if pins.axis("ep") is None or pins.axis("ep") == ep:
                        out.append(Degrees(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep))
    return out


def family_key(layout) -> tuple:
    """Everything of a layout but its micro-batch size (a family of layouts: the dichotomy solver bisects over b,
    the exact one skips a family's larger b once a smaller one missed memory)."""
    return (layout.degrees, layout.sp, layout.zero, layout.schedule, layout.interleave, layout.stage_groups,
            layout.context_parallel, layout.grad_sync)


def schedule_choices(pins: Pins, pp: int, num_micro_batches: int, num_layers: int,
                     v_schedules: bool = True) -> Iterator[tuple[str, int]]:
    """(schedule, interleave) pairs the pins allow and plait.legality accepts: with one stage the schedule has
    no effect (the pin, or 1f1b, is kept). The zero-bubble V schedules (ZB-V, DualPipeV: two stages per rank)
    are priced by the schedule simulator like the others; under them plait keeps fully_shard's parameters
    gathered through the schedule (plait.legality.data_parallel_mode: resharding between a micro-batch's
    forward and its split backward gives wrong gradients, docs/torch-on-cpu.md)."""
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
    candidates += [(name, 2) for name in V_SCHEDULES if pins.schedule == name or (pins.schedule is None and v_schedules)]
    for schedule, v in candidates:
        if pins.interleave is not None and v != pins.interleave:
            continue
        if legality.schedule_problems(schedule, pp, m, v) or legality.stage_problems(num_layers, pp, v):
            continue
        yield schedule, v


def searched_v_schedules(cluster: ClusterSpec) -> bool:
    """Whether the zero-bubble V schedules are searched unpinned on `cluster`: on GPUs, where the ZB paper measured
    them, yes; on CPU processes no. There torch's ZB-V and DualPipeV left 25-48% of the step outside their
    compute actions, against 1F1B's 17-27% at the same micro-batch count (benchmarks/pipeline_bubble.py), which the
    simulator's near-zero bubble does not see; a plan may still pin them (--schedule zbv)."""
    return cluster.device_type != "cpu"


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
    model: ModelSpec | None = None
    """The model, for the rules that depend on its shape and the sequence (None: cp = 1 and sequence parallelism
    always allowed)."""
    seq_len: int = 0
    v_schedules: bool = True
    """Search the V schedules unpinned (`searched_v_schedules`); pinned, they are always tried."""

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
        return (self.layout(d, choice) for choice in self.base_choices(d))

    @staticmethod
    def layout(d: Degrees, choice: tuple) -> "Any":
        """The Layout of degrees `d` and one of `base_choices(d)`."""
        from plait.plan import Layout

        sp, zero, b, m, schedule, v, kind = choice
        return Layout(degrees=d, sequence_parallel=sp, zero=zero, micro_batch=b, num_micro_batches=m, schedule=schedule,
                      interleave=v, context_parallel=kind)

    def base_choices(self, d: Degrees) -> Iterator[tuple[bool, int, int, int, str, int, str]]:
        """`base_layouts` as (sequence parallel, ZeRO, micro-batch, micro-batches, schedule, interleave, key/value
        exchange), before any Layout is made (the exact solver makes only those it reaches)."""
        pins = self.pins
        # Unpinned, sequence parallelism is always on for tp > 1: it moves the same bytes as tensor parallelism's
        # all-reduces and keeps less activation memory, so the cost model never prefers it off (unless the
        # sequence a context rank holds does not split over tp).
        sps = [False] if d.tp == 1 else ([pins.sequence_parallel] if pins.sequence_parallel is not None else [True])
        zeros = [pins.zero] if pins.zero is not None else distinct_zeros(d)
        per_replica = self.global_batch // d.dp
        if self.model is not None and d.tp > 1 and pins.sequence_parallel is None and legality.sequence_problems(
                self.model, self.seq_len, d.tp, True, d.cp):
            sps = [False]
        kinds = context_kinds(pins, self.model, d) if self.model is not None else ["all_gather"]
        for sp in sps:
            for b in divisors(per_replica):
                if pins.micro_batch is not None and b != pins.micro_batch:
                    continue
                if self._split_sequences_dominated(d, b):
                    continue
                m = per_replica // b
                schedules = list(schedule_choices(pins, d.pp, m, self.num_layers, self.v_schedules))
                b_kinds = [k for k in kinds if k != "all_to_all" or not self._swap_dominated(d, b)]
                for zero in zeros:
                    for schedule, v in schedules:
                        for kind in b_kinds:
                            yield sp and d.tp > 1, zero, b, m, schedule, v, kind

    def _split_sequences_dominated(self, d: Degrees, b: int) -> bool:
        """Whether context parallelism over micro-batches of `b` sequences is never faster nor smaller than data
        parallelism over the same ranks: where cp divides b, the layout with dp·cp replicas of b/cp sequences (in
        the space unless the pins fix dp, cp or b) computes the same tokens per rank with the same weights sharded
        over the same dp x cp ranks, the same micro-batches and attention FLOPs (the fused kernels either way; twice
        them under "all_gather"), and no key/value exchange: it is priced no higher in time or memory. Context
        parallelism pays where it splits what data parallelism cannot: fewer sequences per micro-batch than cp. On
        the math attention path the sequence-long probabilities make no such promise."""
        pins = self.pins
        return (d.cp > 1 and b % d.cp == 0 and self.model is not None and self.model.attention == "fused"
                and pins.dp is None and pins.axis("cp") is None and pins.micro_batch is None)

    def _swap_dominated(self, d: Degrees, b: int) -> bool:
        """The same for Ulysses' all-to-all over part of the sequence: with g = gcd(cp, b) > 1, cp/g context ranks
        of b/g sequences under g times the data parallelism compute the same tokens and attention per rank and keep
        the same per token, and swap less ((cp/g - 1)/(cp/g) of the same local bytes). (The all-gather kind keeps a
        mask of s/cp x s per micro-batch, which a smaller cp makes larger: no such promise there.)"""
        pins = self.pins
        return (d.cp > 1 and math.gcd(d.cp, b) > 1 and self.model is not None and self.model.attention == "fused"
                and pins.dp is None and pins.axis("cp") is None and pins.micro_batch is None)

    def all_layouts(self) -> list["Any"]:
        return [layout for d in self.degrees for layout in self.layouts(d)]


def grad_syncs(layout) -> list[str]:
    """When a layout's gradients may be reduced (Plan.grad_sync): a choice where ZeRO-3 accumulates several
    micro-batches (fully_shard, no pipeline) -- reduced once, the whole model's fp32 gradients held; after every
    micro-batch, their shards, for m reduce-scatters. The pricer prices both and keeps the faster that fits, in one
    place of the shortlist (plait.search.pricing.Pricer.evaluate). DDP holds whole gradients either way, so reducing
    every micro-batch only costs it time: never searched; nor under ZeRO 0-2 on fully_shard, where it would pay the
    same way (a plan may say so: the executor and the cost model run and price it), because its good closed-form
    estimates crowd the exactly priced shortlist of `--top` (tests/unit/test_moe_cp_cost.py's pruned search)."""
    if (layout.num_micro_batches > 1 and layout.pp == 1 and layout.zero == 3
            and layout.dp_mode.carrier == "fully_shard"):
        return ["step", "micro_batch"]
    return [layout.grad_sync]


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
