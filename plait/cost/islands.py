"""How islands talk: the slow link's price for synchronous data parallelism and for DiLoCo / streaming DiLoCo.

Inside each island the usual plan runs (its step time `inner_step_s` comes from plait.cost.model.predict of the
island's plan); across islands one of two exchanges, both priced as a ring all-reduce over the islands
(plait.cost.comm.all_reduce on a view of the cluster whose only link is the islands' link, one island per "node"):

* sync: every step the gradients (fp32) cross the link; plait's island runtime reduces them once the island's
  backward is done, so none of it hides: step = inner + exchange.
* diloco: every H / fragments steps one fragment's pseudo-gradient (params / fragments elements of the chosen
  precision) crosses it. With overlap tau the exchange runs under the next tau inner steps and only what outlasts
  them is exposed: step = inner + max(0, exchange - tau * inner) / (H / fragments).

The link's bandwidth is what one island as a whole pushes to the others (ClusterSpec.Islands.link); in a ring
all-reduce each island sends 2(k-1)/k of the buffer. Published settings the choice cites (docs/islands.md):
DiLoCo was validated at H = 500 with 8 replicas (arXiv 2311.08105), INTELLECT-1 trained at H = 100 with int8
pseudo-gradients (arXiv 2412.01152), streaming DiLoCo at H = 100 with fragments and 4-bit values
(arXiv 2501.18512).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from plait.cost import comm
from plait.cost.activations import FP32_BYTES
from plait.spec.cluster import ClusterSpec, Islands

PRECISION_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0}
"""Bytes per pseudo-gradient element on the slow link (int8 as INTELLECT-1 sent them, its scales neglected)."""

PUBLISHED_H: dict[str, int] = {"DiLoCo (arXiv 2311.08105)": 500, "INTELLECT-1 (arXiv 2412.01152)": 100,
                               "Streaming DiLoCo (arXiv 2501.18512)": 100}
"""Inner steps the methods were validated at: past these, quality is the user's call (docs/islands.md)."""


@dataclass(frozen=True, kw_only=True)
class IslandCost:
    """One way for the islands to talk, priced. Times in seconds, per inner step unless said."""

    method: str
    inner_steps: int = 1
    fragments: int = 1
    precision: str = "fp32"
    overlap: int = 0
    step_time_s: float
    """Mean time of an inner step with the exposed part of the exchange."""
    tokens_per_s: float
    exchange_s: float
    """One exchange over the link (a fragment's, or a step's gradients)."""
    exposed_s: float
    """Of each exchange, what the training waits for."""
    link_bytes_per_step: float
    """Bytes one island sends over the link per inner step, on average."""
    link_busy_fraction: float
    """Fraction of the time the link carries exchanges."""

    @property
    def hidden(self) -> bool:
        """The exchange hides under inner compute (the islands never wait for the link)."""
        return self.exposed_s <= 1e-12

    def describe(self) -> str:
        """'sync' or 'diloco H=8 frag2 bf16 overlap1', as the plan names its exchange (IslandPlan.exchange)."""
        from plait.plan import IslandPlan

        return IslandPlan(count=2, method=self.method, inner_steps=self.inner_steps, fragments=self.fragments,
                          precision=self.precision, overlap=self.overlap).exchange()


def link_view(cluster: ClusterSpec, islands: Islands) -> ClusterSpec:
    """The cluster as the exchange between islands sees it: one island per node, every hop on the slow link."""
    return dataclasses.replace(cluster, num_devices=islands.count, devices_per_node=1, intra_node=islands.link,
                               inter_node=islands.link, islands=None, failures=None, groups=(), between_groups=None)


def exchange_time(nbytes: float, cluster: ClusterSpec) -> float:
    """Seconds of a ring all-reduce of `nbytes` (the whole model's share of it, summed over an island's ranks)
    over the islands' link."""
    islands = _islands(cluster)
    return comm.all_reduce(nbytes, comm.Group(islands.count, 1), link_view(cluster, islands))


def island_sends(nbytes: float, count: int) -> float:
    """Bytes one island sends over the link in a ring all-reduce of `nbytes` over `count` islands."""
    return 2 * (count - 1) / count * nbytes


def price_sync(cluster: ClusterSpec, params: float, inner_step_s: float, tokens_per_step: float) -> IslandCost:
    """Synchronous data parallelism across islands: every step's fp32 gradients all-reduced over the link."""
    count = _islands(cluster).count
    exchange = exchange_time(params * FP32_BYTES, cluster)
    step = inner_step_s + exchange
    return IslandCost(method="sync", step_time_s=step, tokens_per_s=tokens_per_step / step, exchange_s=exchange,
                      exposed_s=exchange, link_bytes_per_step=island_sends(params * FP32_BYTES, count),
                      link_busy_fraction=exchange / step)


def price_diloco(cluster: ClusterSpec, params: float, inner_step_s: float, tokens_per_step: float, *,
                 inner_steps: int, fragments: int = 1, precision: str = "fp32", overlap: int = 0) -> IslandCost:
    """DiLoCo (fragments 1, overlap 0) or streaming DiLoCo: one fragment exchanged every H / fragments steps."""
    count = _islands(cluster).count
    every = inner_steps // fragments
    fragment_bytes = params * PRECISION_BYTES[precision] / fragments
    exchange = exchange_time(fragment_bytes, cluster)
    exposed = max(0.0, exchange - overlap * inner_step_s)
    step = inner_step_s + exposed / every
    return IslandCost(method="diloco", inner_steps=inner_steps, fragments=fragments, precision=precision,
                      overlap=overlap, step_time_s=step, tokens_per_s=tokens_per_step / step, exchange_s=exchange,
                      exposed_s=exposed, link_bytes_per_step=island_sends(fragment_bytes, count) / every,
                      link_busy_fraction=min(1.0, exchange / (every * step)))


def outer_state_bytes(plan, fragments: int = 1, overlap: int = 0) -> float:
    """Device memory DiLoCo adds to a rank of `plan` (one island's plan): the outer optimizer's momentum over the
    rank's parameters (fp32), and for the fragment being exchanged its pseudo-gradient and, with overlap, the copy
    of the island's own progress it mixes back (torchft.local_sgd). The weights of the last outer step are kept in
    host memory, not on the device."""
    param_shards = plan.tp * plan.pp * (plan.dp if plan.data_parallel == "fully_shard" else 1)
    local = FP32_BYTES * plan.model.num_params / param_shards
    return local * (1 + (2 if overlap else 1) / fragments)


def smallest_hiding_h(cluster: ClusterSpec, params: float, inner_step_s: float, tokens_per_step: float, *,
                      fragments: int, precision: str) -> IslandCost:
    """The smallest H (a multiple of `fragments`) whose exchange hides under inner compute: each fragment's
    exchange overlapped with tau = ceil(exchange / inner step) inner steps, the next one tau + 1 steps later."""
    fragment_bytes = params * PRECISION_BYTES[precision] / fragments
    exchange = exchange_time(fragment_bytes, cluster)
    overlap = max(1, math.ceil(exchange / inner_step_s - 1e-9)) if inner_step_s > 0 else 1
    return price_diloco(cluster, params, inner_step_s, tokens_per_step, inner_steps=fragments * (overlap + 1),
                        fragments=fragments, precision=precision, overlap=overlap)


def _islands(cluster: ClusterSpec) -> Islands:
    if cluster.islands is None:
        raise ValueError(f"cluster {cluster.name!r} has no islands (ClusterSpec.islands)")
    return cluster.islands
