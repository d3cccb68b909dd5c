"""The choice of how islands talk (plait/cost/islands.py prices the options).

Inside each island the usual joint search runs on one island's devices and rows (ClusterSpec.island_view, the
global batch split evenly); across islands the options are synchronous data parallelism over the slow link and
DiLoCo / streaming DiLoCo. The rule:

* pinned (method, H, fragments, precision, overlap): price exactly that;
* else synchronous data parallelism wins where it is within SYNC_WITHIN of the fastest option: it trains exactly
  as one cluster would, with no quality question;
* else DiLoCo at the smallest H whose exchange hides under inner compute, fp32 before bf16 before int8 (less
  rounding of the pseudo-gradients), fewer fragments first; a larger H is the user's call, since quality at large
  H was validated only up to the published figures (plait.cost.islands.PUBLISHED_H).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from plait.cost.failures import FailureCost, price_failures
from plait.cost.islands import (
    PUBLISHED_H,
    IslandCost,
    outer_state_bytes,
    price_diloco,
    price_sync,
    smallest_hiding_h,
)
from plait.errors import ConfigError
from plait.plan import PSEUDO_GRADIENT_PRECISIONS, IslandPlan, Plan
from plait.spec import ClusterSpec, ModelSpec, TrainSpec

SYNC_WITHIN = 0.05
"""Synchronous data parallelism is chosen where its tokens/s are within this fraction of the fastest option: a few
percent of speed is worth less than the quality question DiLoCo raises."""

FRAGMENT_CHOICES = (1, 2, 4, 8)
RUNNABLE_PRECISIONS = ("fp32", "bf16")
"""Pseudo-gradient precisions plait's island runtime sends on any backend; int8 needs torchft's quantized
all-reduce (triton on CUDA), so it is priced and offered, and chosen only where pinned."""


@dataclass(frozen=True, kw_only=True)
class IslandPins:
    method: str | None = None
    inner_steps: int | None = None
    fragments: int | None = None
    precision: str | None = None
    overlap: int | None = None

    def __post_init__(self) -> None:
        if self.inner_steps is not None and self.inner_steps < 1:
            raise ConfigError(f"inner steps H={self.inner_steps} must be at least 1 (H is how many steps each island "
                              "takes between exchanges; 1 exchanges every step)")
        if self.fragments is not None and self.fragments < 1:
            raise ConfigError(f"fragments={self.fragments} must be at least 1")
        if self.precision is not None and self.precision not in PSEUDO_GRADIENT_PRECISIONS:
            raise ConfigError(f"pseudo-gradient precision {self.precision!r} is not one of "
                              f"{', '.join(PSEUDO_GRADIENT_PRECISIONS)}")
        if self.method == "sync" and any(v not in (None, d) for v, d in
                                         ((self.inner_steps, 1), (self.fragments, 1), (self.overlap, 0))):
            raise ConfigError("--island-method sync exchanges gradients every step: leave out H, fragments and overlap")


@dataclass(frozen=True, kw_only=True)
class IslandChoice:
    """The islands' plan and what it was chosen over."""

    plans: list[Plan]
    """The island plans, best first (the inner search's top plans, each with the chosen exchange)."""
    options: list[IslandCost]
    """Every exchange priced for the best inner plan, fastest first."""
    chosen: IslandCost
    sync: IslandCost
    why: str
    failures: dict[str, FailureCost] = field(default_factory=dict)
    """Per option shown ("sync", the chosen one): what failures cost it, where the cluster gives a failure rate."""
    inner: Any = None
    """The inner search's SearchResult."""


def plan_islands(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, *, top: int = 5,
                 island_pins: IslandPins | None = None, **pins: Any) -> IslandChoice:
    """Search one island's plan, then choose how the islands talk (module docstring)."""
    from plait.search.search import plan_with_stats

    islands = cluster.islands
    if islands is None:
        raise ConfigError(f"cluster {cluster.name!r} has no islands; add an `islands:` section (docs/islands.md)")
    pins_i = island_pins or IslandPins()
    if train.global_batch % islands.count:
        raise ConfigError(f"global_batch={train.global_batch} does not split over {islands.count} islands; give a "
                          f"multiple of {islands.count}")
    island_train = dataclasses.replace(train, global_batch=train.global_batch // islands.count)
    inner = plan_with_stats(model, cluster.island_view(), island_train, top=top, **pins)
    best = inner.plans[0]
    check_fragments(best, pins_i.fragments)
    params, step_s = model.num_params, best.predicted.step_time_s
    tokens = train.global_batch * train.seq_len
    sync = price_sync(cluster, params, step_s, tokens)
    options = _options(cluster, best, params, step_s, tokens, pins_i)
    chosen, why = _choose(sync, options, pins_i)
    everything = sorted({o.describe(): o for o in [sync, *options]}.values(), key=lambda o: -o.tokens_per_s)
    plans = _fitting(inner.plans, cluster, train, chosen)
    if not plans and chosen.method == "diloco":  # the best plans leave no room for the outer state: look further
        everything = plan_with_stats(model, cluster.island_view(), island_train, top=None, **pins)
        plans = _fitting(everything.plans, cluster, train, chosen)[:top]
    if not plans:
        raise ConfigError(f"no plan of {model.name} leaves room for DiLoCo's outer state on {cluster.name} "
                          f"({chosen.describe()}); pin --island-method sync, more --fragments, or plan more devices "
                          "per island")
    failures = failure_table(cluster, sync, chosen, step_s)
    if chosen.method == "diloco" and chosen.describe() in failures:
        plans[0] = _with_goodput(plans[0], failures[chosen.describe()])
    elif chosen.method == "sync" and failures:
        plans[0] = _with_goodput(plans[0], failures["sync, islands as replica groups"])
    return IslandChoice(plans=plans, options=everything, chosen=chosen, sync=sync, why=why, failures=failures,
                        inner=inner)


def check_fragments(plan: Plan, fragments: int | None) -> None:
    """Refuse more fragments than the blocks a pipeline rank holds: each fragment is a run of whole blocks."""
    if fragments is None:
        return
    fewest = min(plan.layers_per_stage[s] for s in range(plan.num_stages))
    if fragments > fewest * plan.interleave or fragments > plan.model.num_layers:
        held = plan.model.num_layers if plan.pp == 1 else min(
            sum(plan.layers_per_stage[s] for s in plan.stages_of_rank(r)) for r in range(plan.pp))
        if fragments > held:
            raise ConfigError(f"fragments={fragments} is more than the {held} blocks "
                              f"{'the model has' if plan.pp == 1 else 'a pipeline rank holds'}; give at most {held}")


def _options(cluster: ClusterSpec, best: Plan, params: float, step_s: float, tokens: float,
             pins: IslandPins) -> list[IslandCost]:
    if pins.method == "sync":
        return []
    blocks = best.model.num_layers if best.pp == 1 else min(
        sum(best.layers_per_stage[s] for s in best.stages_of_rank(r)) for r in range(best.pp))
    fragment_choices = [pins.fragments] if pins.fragments else [f for f in FRAGMENT_CHOICES if f <= blocks]
    precisions = [pins.precision] if pins.precision else list(PSEUDO_GRADIENT_PRECISIONS)
    out = []
    for fragments in fragment_choices:
        for precision in precisions:
            if pins.inner_steps is None and pins.overlap is None:
                out.append(smallest_hiding_h(cluster, params, step_s, tokens, fragments=fragments,
                                             precision=precision))
                continue
            inner_steps = pins.inner_steps or fragments * ((pins.overlap or 0) + 1)
            if inner_steps % fragments:
                continue
            overlap = pins.overlap if pins.overlap is not None else _best_overlap(
                cluster, params, step_s, tokens, inner_steps, fragments, precision)
            if overlap >= inner_steps // fragments:
                continue  # the exchange would land after the fragment's next one: not this fragment count
            out.append(price_diloco(cluster, params, step_s, tokens, inner_steps=inner_steps, fragments=fragments,
                                    precision=precision, overlap=overlap))
    if not out:
        raise ConfigError(f"no fragment count of {', '.join(map(str, fragment_choices))} fits H={pins.inner_steps} "
                          f"with overlap={pins.overlap}: H must be a multiple of the fragments and overlap below "
                          "H / fragments")
    return out


def _best_overlap(cluster: ClusterSpec, params: float, step_s: float, tokens: float, inner_steps: int,
                  fragments: int, precision: str) -> int:
    """The fewest overlapped steps that hide the exchange at a pinned H, within what H / fragments allows."""
    every = inner_steps // fragments
    for overlap in range(every):
        cost = price_diloco(cluster, params, step_s, tokens, inner_steps=inner_steps, fragments=fragments,
                            precision=precision, overlap=overlap)
        if cost.hidden:
            return overlap
    return every - 1


def _choose(sync: IslandCost, options: list[IslandCost], pins: IslandPins) -> tuple[IslandCost, str]:
    if pins.method == "sync" or not options:
        return sync, "pinned: synchronous data parallelism across islands"
    fastest = max(o.tokens_per_s for o in options)
    if pins.method is None and sync.tokens_per_s >= (1 - SYNC_WITHIN) * fastest:
        return sync, (f"synchronous data parallelism is within {SYNC_WITHIN:.0%} of the fastest DiLoCo option: it "
                      "trains as one cluster would, with no quality question")
    order = {p: i for i, p in enumerate(PSEUDO_GRADIENT_PRECISIONS)}
    runnable = [o for o in options if o.precision in RUNNABLE_PRECISIONS or pins.precision]
    hidden = [o for o in runnable if o.hidden]
    pool = hidden or sorted(runnable or options, key=lambda o: -o.tokens_per_s)[:1]
    chosen = min(pool, key=lambda o: (o.inner_steps, order[o.precision], o.fragments))
    published = ", ".join(f"{name} H={h}" for name, h in PUBLISHED_H.items())
    pinned = [f"{name}={value}" for name, value in (("H", pins.inner_steps), ("fragments", pins.fragments),
                                                     ("precision", pins.precision), ("overlap", pins.overlap))
              if value is not None]
    if pinned:
        reason = f"pinned {', '.join(pinned)}" + ("; its exchange hides under inner compute" if chosen.hidden else
                                                  f"; {chosen.exposed_s:.3g} s of each exchange is waited for")
    else:
        reason = ("the smallest H whose exchange hides under inner compute" if chosen.hidden
                  else "no H tried hides the exchange; the fastest option")
    gain = chosen.tokens_per_s / sync.tokens_per_s
    return chosen, (f"{reason}: {gain:.2f}x synchronous data parallelism's tokens/s. Quality at large H is your "
                    f"call: published runs validated {published}")


def _fitting(inner: list[Plan], cluster: ClusterSpec, train: TrainSpec, cost: IslandCost) -> list[Plan]:
    """The island plans of `inner` that still fit the devices' memory with the exchange's state."""
    plans = [_with_islands(plan, cluster, train, cost) for plan in inner]
    return [p for p in plans if p.predicted is None or p.predicted.peak_memory_bytes <= cluster.memory_bytes]


def _with_islands(plan: Plan, cluster: ClusterSpec, train: TrainSpec, cost: IslandCost) -> Plan:
    """The island plan: one island's degrees, the whole cluster and batch, and the exchange chosen, with the
    prediction of the whole run."""
    islands = IslandPlan(count=cluster.islands.count, method=cost.method, inner_steps=cost.inner_steps,
                         fragments=cost.fragments, precision=cost.precision, overlap=cost.overlap)
    predicted = plan.predicted
    if predicted is not None:
        parts = dict(predicted.step_time_parts)
        inner_s = predicted.step_time_s
        link_s = max(0.0, cost.step_time_s - inner_s)
        if link_s:
            parts["island_link"] = link_s
        memory_parts, peak = dict(predicted.memory_parts), predicted.peak_memory_bytes
        if cost.method == "diloco":
            memory_parts["outer_state"] = outer_state_bytes(plan, cost.fragments, cost.overlap)
            peak += memory_parts["outer_state"]
        predicted = dataclasses.replace(predicted, step_time_s=inner_s + link_s, step_time_parts=parts,
                                        tokens_per_s=train.global_batch * train.seq_len / (inner_s + link_s),
                                        link_bytes_per_step=cost.link_bytes_per_step,
                                        link_busy_fraction=cost.link_busy_fraction,
                                        memory_parts=memory_parts, peak_memory_bytes=peak)
    return dataclasses.replace(plan, islands=islands, cluster=cluster, train=train, predicted=predicted)


def failure_table(cluster: ClusterSpec, sync: IslandCost, chosen: IslandCost, inner_step_s: float
                  ) -> dict[str, FailureCost]:
    """What failures cost, side by side: synchronous training as one job (a failure restarts every rank from
    the last checkpoint), and each option with the islands as torchft replica groups (a failure costs one island's
    recovery and its work since the last exchange). Empty without a failure rate."""
    if cluster.failures is None:
        return {}
    out = {"sync, one job": price_failures(cluster, sync.tokens_per_s)}
    for cost in {sync.describe(): sync, chosen.describe(): chosen}.values():
        lost = (cost.inner_steps / 2) * inner_step_s
        name = "sync, islands as replica groups" if cost.method == "sync" else cost.describe()
        out[name] = price_failures(cluster, cost.tokens_per_s, replica_groups=cluster.islands.count,
                                              lost_work_s=lost)
    return out


def _with_goodput(plan: Plan, failure: FailureCost) -> Plan:
    if plan.predicted is None:
        return plan
    return dataclasses.replace(plan, predicted=dataclasses.replace(
        plan.predicted, goodput_tokens_per_s=failure.goodput_tokens_per_s,
        checkpoint_interval_s=failure.checkpoint_interval_s))


@dataclass(frozen=True, kw_only=True)
class ReplicaGroups:
    """One job split into `count` torchft replica groups (synchronous data parallelism across them, over the
    cluster's inter-node links), priced with failures."""

    count: int
    group_devices: int
    tokens_per_s: float
    failure: FailureCost


def replica_group_choice(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, num_devices: int,
                         **pins: Any) -> list[ReplicaGroups]:
    """On a cluster with a failure rate and no islands: the run as 1, 2, 4, ... replica groups of whole nodes, each
    priced by expected goodput (a failure restarts one job; it costs a group's recovery among groups); best first.
    More groups lose less to each failure but pay the groups' all-reduce on the inter-node links, planned as
    islands of those links (every adapter of a group together)."""
    from plait.search.search import plan_with_stats
    from plait.spec.cluster import Islands

    whole = cluster.with_devices(num_devices)
    one_job = plan_with_stats(model, whole, train, num_devices=num_devices, top=1, **pins).plans[0]
    rows = [ReplicaGroups(count=1, group_devices=num_devices, tokens_per_s=one_job.predicted.tokens_per_s,
                          failure=price_failures(whole, one_job.predicted.tokens_per_s))]
    nodes = whole.num_nodes
    for count in (2, 4, 8, 16):
        if nodes % count or train.global_batch % count or nodes < count:
            continue
        devices = num_devices // count
        link = whole.inter_node.scaled(bandwidth=devices)
        grouped = dataclasses.replace(whole, islands=Islands(count=count, link=link))
        try:
            choice = plan_islands(model, grouped, train, top=1, island_pins=IslandPins(method="sync"), **pins)
        except ConfigError:
            continue
        failure = choice.failures.get("sync, islands as replica groups")
        rows.append(ReplicaGroups(count=count, group_devices=devices, tokens_per_s=choice.sync.tokens_per_s,
                                  failure=failure))
    return sorted(rows, key=lambda r: -r.failure.goodput_tokens_per_s)
