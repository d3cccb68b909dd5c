"""Training the learned solver offline against the cost model (`plait solver train`): no cluster in the loop.

Problems are generated (decoder shapes, device counts, batches, presets of hardware) from a seed. For each,
the cost model prices every layout once (the reward: minus the estimated step time; a layout that does not fit
earns nothing). The policy is a softmax over the network's layout scores. Each step samples K layouts of a
problem from the policy and applies a contrastive loss: the best of the sample is the positive, the rest the
negatives (InfoNCE over the policy's own samples) -- the policy learns to raise what beats its alternatives,
from rewards alone. Adam in numpy; a few minutes on one core.

Held-out families for the benchmark (benchmarks/solvers.py) use other size ranges and seeds.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import numpy as np

from plait.search.learned import LAYOUT_FEATURES, layout_features
from plait.search.pricing import Pricer
from plait.search.space import Pins, Space, degree_choices
from plait.cost.layout import Setting
from plait.spec import ModelSpec, TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS

HIDDEN = 32


@dataclass
class LayoutProblem:
    """One search problem with every layout priced: features [n, f] and estimated step times [n] (inf: no fit)."""

    name: str
    features: np.ndarray
    times: np.ndarray


def random_problem(rng: random.Random, family: str) -> tuple[ModelSpec, str, TrainSpec, int]:
    """A decoder, a hardware preset, a batch and a device count. `family` "train" and "held-out" draw from
    different ranges (held-out: wider and deeper models, more devices, longer sequences)."""
    held = family == "held-out"
    heads = rng.choice([16, 32, 48, 64] if not held else [40, 64, 80, 96])
    head_dim = 128
    hidden = heads * head_dim
    layers = rng.randint(16, 48) if not held else rng.randint(40, 96)
    kv = rng.choice([d for d in (1, 2, 4, 8, heads) if heads % d == 0])
    arch = rng.choice(["gpt", "llama"])
    model = ModelSpec(name=f"{family}-{rng.randrange(10**6)}", arch=arch, num_layers=layers, hidden_size=hidden,
                      num_heads=heads, num_kv_heads=kv if arch == "llama" else None,
                      vocab_size=rng.choice([32000, 50304, 128256]), max_seq_len=32768)
    devices = rng.choice([16, 32, 64, 128] if not held else [128, 256, 512])
    seq = rng.choice([2048, 4096] if not held else [4096, 8192])
    batch = devices * rng.choice([1, 2, 4]) // rng.choice([1, 2])
    return model, rng.choice(["a100-80g", "h100-80g", "a100-40g"]), TrainSpec(global_batch=batch, seq_len=seq), devices


def priced_problem(model: ModelSpec, cluster: str, train: TrainSpec, devices: int) -> LayoutProblem | None:
    spec = CLUSTER_PRESETS[cluster].with_devices(devices)
    pins = Pins()
    degrees = degree_choices(pins, model, spec, train, devices)
    if not degrees:
        return None
    pricer = Pricer(Setting(model, spec, train), pins, None)
    layouts = Space(pins, degrees, train.global_batch, model.num_layers).all_layouts()
    if len(layouts) < 4:
        return None
    best_bound = min(pricer.lower_bound(layout) for layout in layouts)
    x = np.stack([layout_features(pricer, layout, best_bound) for layout in layouts])
    times = np.array([t if (t := pricer.evaluate(layout)) is not None else math.inf for layout in layouts])
    if not np.isfinite(times).any():
        return None
    return LayoutProblem(model.name, x, times)


def make_problems(seed: int, count: int, family: str = "train") -> list[LayoutProblem]:
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        problem = priced_problem(*random_problem(rng, family))
        if problem is not None:
            out.append(problem)
    return out


class Network:
    """The layout scorer's parameters (plait.search.learned.mlp_forward) and their Adam state."""

    def __init__(self, features: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        shapes = {"w1": (features, HIDDEN), "b1": (HIDDEN,), "w2": (HIDDEN, HIDDEN), "b2": (HIDDEN,),
                  "w3": (HIDDEN, 1), "b3": (1,)}
        self.params = {k: (rng.normal(0, 1 / math.sqrt(s[0]), s) if k.startswith("w") else np.zeros(s))
                       for k, s in shapes.items()}
        self.moments = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in self.params.items()}
        self.steps = 0

    def scores(self, x: np.ndarray) -> tuple[np.ndarray, tuple]:
        p = self.params
        h1 = np.tanh(x @ p["w1"] + p["b1"])
        h2 = np.tanh(h1 @ p["w2"] + p["b2"])
        return (h2 @ p["w3"] + p["b3"])[:, 0], (x, h1, h2)

    def gradients(self, cache: tuple, d_scores: np.ndarray) -> dict[str, np.ndarray]:
        x, h1, h2 = cache
        p = self.params
        d_out = d_scores[:, None]
        grads = {"w3": h2.T @ d_out, "b3": d_out.sum(0)}
        d_h2 = d_out @ p["w3"].T * (1 - h2**2)
        grads.update(w2=h1.T @ d_h2, b2=d_h2.sum(0))
        d_h1 = d_h2 @ p["w2"].T * (1 - h1**2)
        grads.update(w1=x.T @ d_h1, b1=d_h1.sum(0))
        return grads

    def adam(self, grads: dict[str, np.ndarray], lr: float, betas=(0.9, 0.999), eps=1e-8) -> None:
        self.steps += 1
        for k, g in grads.items():
            m, v = self.moments[k]
            m[...] = betas[0] * m + (1 - betas[0]) * g
            v[...] = betas[1] * v + (1 - betas[1]) * g * g
            m_hat, v_hat = m / (1 - betas[0] ** self.steps), v / (1 - betas[1] ** self.steps)
            self.params[k] -= lr * m_hat / (np.sqrt(v_hat) + eps)


def info_nce(logits: np.ndarray, positive: int) -> tuple[float, np.ndarray]:
    """InfoNCE (van den Oord et al. 2018): -log softmax(logits)[positive], and its gradient in the logits."""
    soft = np.exp(logits - logits.max())
    soft /= soft.sum()
    loss = -math.log(soft[positive] + 1e-12)
    d_logits = soft.copy()
    d_logits[positive] -= 1.0
    return loss, d_logits


def contrastive_step(net: Network, problem: LayoutProblem, mean, std, rng: np.random.Generator,
                     samples: int, temperature: float) -> float:
    """Sample `samples` layouts from the policy softmax(scores); InfoNCE with the best sampled one as positive."""
    x = (problem.features - mean) / std
    scores, cache = net.scores(x)
    logits = scores / temperature
    policy = np.exp(logits - logits.max())
    policy /= policy.sum()
    policy = 0.8 * policy + 0.2 / len(policy)  # keep exploring what the policy dismisses
    k = min(samples, len(policy))
    picked = rng.choice(len(policy), size=k, replace=False, p=policy)
    rewards = -problem.times[picked]
    if not np.isfinite(rewards).any() or len(set(rewards.tolist())) == 1:
        return 0.0
    positive = int(np.argmax(rewards))
    loss, d_chosen = info_nce(logits[picked], positive)
    d_scores = np.zeros_like(scores)
    d_scores[picked] = d_chosen / temperature
    net.adam(net.gradients(cache, d_scores), lr=3e-3)
    return loss


def proposal_gap(weights: dict[str, np.ndarray], problems: list[LayoutProblem], proposals: int = 12) -> np.ndarray:
    """Per problem: how much slower the best of the network's top proposals is than the best layout (as the
    solver runs: the next proposals where none of them fits)."""
    from plait.search.learned import mlp_forward

    gaps = []
    for p in problems:
        order = np.argsort(-mlp_forward(weights, (p.features - weights["layout_mean"]) / weights["layout_std"], "layout"),
                           kind="stable")
        got, start = math.inf, 0
        while not math.isfinite(got):
            got = p.times[order[start:start + proposals]].min()
            start += proposals
        gaps.append(got / p.times.min() - 1.0)
    return np.array(gaps)


def train(seed: int = 0, problems: int = 60, epochs: int = 40, samples: int = 16, temperature: float = 0.5,
          log=print, validation_problems: int | None = None) -> dict[str, np.ndarray]:
    """Train from scratch; returns the weights learned.load_weights reads (layout_* arrays): those of the epoch
    whose proposals came closest to the optimum on validation problems of the training family (90th
    percentile of the gap, then the median; `validation_problems` of them, by default a quarter of `problems`
    and at least 10)."""
    began = time.perf_counter()
    data = make_problems(seed, problems, "train")
    validation = make_problems(seed + 1, validation_problems or max(10, problems // 4), "train")
    log(f"priced {len(data)} training problems ({sum(len(p.times) for p in data)} layouts) "
        f"in {time.perf_counter() - began:.0f} s")
    stacked = np.concatenate([p.features for p in data])
    mean, std = stacked.mean(0), stacked.std(0) + 1e-6
    mean[-1], std[-1] = 0.0, 1.0  # the bias feature stays 1
    net = Network(len(LAYOUT_FEATURES), seed)
    return keep_best(net, data, mean, std, seed, epochs, "layout",
                     lambda item, rng: contrastive_step(net, item, mean, std, rng, samples, temperature),
                     lambda weights: proposal_gap(weights, validation), ("", "weights"), log)


def keep_best(net: Network, data: list, mean: np.ndarray, std: np.ndarray, seed: int, epochs: int, prefix: str,
              step, gaps_of, names: tuple[str, str], log) -> dict[str, np.ndarray]:
    """Train `net` for `epochs` seeded passes over `data` (`step(item, rng)` returns an item's loss) and return the
    weights (`prefix`_* arrays, with the features' mean and std) of the epoch whose validation gaps (`gaps_of`)
    are least: their 90th percentile, then their median. `names`: how the log calls an epoch and what it keeps."""
    rng = np.random.default_rng(seed)
    best, best_key = None, (math.inf, math.inf)
    for epoch in range(epochs):
        losses = [step(data[i], rng) for i in rng.permutation(len(data))]
        weights = {f"{prefix}_{k}": v.copy() for k, v in net.params.items()}
        weights.update({f"{prefix}_mean": mean, f"{prefix}_std": std})
        gaps = gaps_of(weights)
        key = (float(np.quantile(gaps, 0.9)), float(np.median(gaps)))
        if key < best_key:
            best, best_key = weights, key
        if epoch % 10 == 0 or epoch == epochs - 1:
            log(f"{names[0]}epoch {epoch + 1}/{epochs}: contrastive loss {np.mean(losses):.3f}, validation gap "
                f"median {key[1]:.2%}, 90th percentile {key[0]:.2%}")
    log(f"kept the {names[1]} of validation gap 90th percentile {best_key[0]:.2%}, median {best_key[1]:.2%}")
    return best


# ---- the device-group policy (mixed clusters) ----------------------------------------------------
PLACEMENT_FAMILIES = {
    # name: (device groups, nodes per group, stragglers' speed range); "train" alone is used in training
    "train": ((2,), (1, 2, 4), (0.4, 0.7)),
    "held-out": ((2, 3), (2, 4, 8), (0.4, 0.7)),
    "four-groups": ((4,), (1, 2, 4), (0.4, 0.7)),
    "slow-stragglers": ((2, 3), (1, 2, 4), (0.15, 0.35)),
    "large": ((2, 3), (16, 32, 64), (0.4, 0.7)),
}
"""Families of mixed clusters: the placement policy trains on "train" only; the others are kept out of training
(more device groups, more nodes so longer pipelines, slower stragglers, up to 1,536 devices) for
benchmarks/solvers.py and the tests."""


def mixed_cluster(rng: random.Random, family: str):
    """A cluster of `family` (PLACEMENT_FAMILIES): device groups of public parts, or a part beside its stragglers
    (the same part slowed), in whole nodes of 8."""
    from plait.spec.cluster import ClusterSpec, DeviceGroup

    if family not in PLACEMENT_FAMILIES:
        raise ValueError(f"mixed-cluster family {family!r} is not one of {', '.join(PLACEMENT_FAMILIES)}")
    group_counts, node_counts, speeds = PLACEMENT_FAMILIES[family]
    parts = ["h100-80g", "a100-80g", "a100-40g"]
    count = 2 if family == "train" else rng.choice(group_counts)  # "train" draws as it did when the weights were made
    if count > len(parts):  # more groups than parts: parts repeat, each repeat of the first a straggler
        chosen = [rng.choice(parts) for _ in range(count)]
    else:
        chosen = rng.sample(parts, count) if rng.random() < 0.7 else [rng.choice(parts)] * count
    groups = []
    for i, name in enumerate(chosen):
        preset = CLUSTER_PRESETS[name]
        slow = 1.0 if i == 0 or chosen[i] != chosen[0] else rng.uniform(*speeds)
        nodes = rng.choice(node_counts)
        groups.append(DeviceGroup(name=f"{name}-{i}", num_devices=8 * nodes, devices_per_node=8,
                                  memory_bytes=preset.memory_bytes, peak_flops=preset.peak_flops * slow,
                                  efficiency=preset.efficiency, intra_node=preset.intra_node,
                                  inter_node=preset.inter_node))
    first = groups[0]
    return ClusterSpec(name="mixed", num_devices=sum(g.num_devices for g in groups), devices_per_node=8,
                       memory_bytes=first.memory_bytes, peak_flops=first.peak_flops, efficiency=first.efficiency,
                       intra_node=first.intra_node, inter_node=first.inter_node, groups=tuple(groups),
                       between_groups=first.inter_node)


@dataclass
class GroupProblem:
    """One layout of a mixed cluster whose pipeline ranks are to be placed; rewards priced on demand, cached."""

    pricer: Pricer
    layout: object
    counts: dict[str, int]
    cache: dict

    def time(self, ordering: tuple[str, ...]) -> float:
        import dataclasses

        if ordering not in self.cache:
            result = self.pricer.evaluate(dataclasses.replace(self.layout, stage_groups=ordering))
            self.cache[ordering] = math.inf if result is None else result
        return self.cache[ordering]


def group_problems(seed: int, count: int, family: str = "train", per_cluster: int = 2) -> list[GroupProblem]:
    """Layouts with pipelines over mixed clusters: for each generated cluster and model, the `per_cluster` layouts of
    least lower bound among those with more than one way to place their pipeline ranks."""
    rng = random.Random(seed)
    out: list[GroupProblem] = []
    while len(out) < count:
        model, _, train, _ = random_problem(rng, family)
        cluster = mixed_cluster(rng, family)
        pins = Pins()
        degrees = [d for d in degree_choices(pins, model, cluster, train, cluster.num_devices) if d.pp > 1]
        if not degrees:
            continue
        groups = tuple((g.name, g.num_devices) for g in cluster.groups)
        space = Space(pins, degrees, train.global_batch, model.num_layers, groups)
        pricer = Pricer(Setting(model, cluster, train), pins, None)
        # the placements worth learning: pipelines long enough that their orderings are many
        bases = [(pricer.lower_bound(layout), i, layout, d) for i, d in enumerate(degrees)
                 for layout in space.base_layouts(d) if 20 <= space.count_orderings(d) <= 5000]
        for _, _, layout, d in sorted(bases, key=lambda b: b[:2])[:per_cluster]:
            out.append(GroupProblem(pricer, layout, space.group_counts(d), {}))
    return out[:count]


def sequence_step(net: Network, problem: GroupProblem, mean, std, rng: np.random.Generator, samples: int) -> float:
    """Sample `samples` orderings from the policy; InfoNCE over their log-probabilities, the fastest the positive."""
    from plait.search.groups import GroupContext, walk

    context = GroupContext(problem.pricer, problem.layout, problem.counts)

    def sample(x: np.ndarray) -> int:
        s, _ = net.scores((x - mean) / std)
        p = np.exp(s - s.max())
        p = 0.9 * p / p.sum() + 0.1 / len(p)
        return int(rng.choice(len(p), p=p / p.sum()))

    walks = [walk(context, sample) for _ in range(samples)]
    rewards = np.array([-problem.time(ordering) for ordering, _ in walks])
    if not np.isfinite(rewards).any() or len(set(rewards.tolist())) == 1:
        return 0.0
    rows = np.concatenate([x for _, steps in walks for x, _ in steps])
    scores, cache = net.scores((rows - mean) / std)
    # per walk, its log-probability: Σ over steps of score(chosen) - logsumexp(scores of that step)
    logp, spans, start = [], [], 0
    for _, steps in walks:
        total, walk_spans = 0.0, []
        for x, chosen in steps:
            s = scores[start:start + len(x)]
            soft = np.exp(s - s.max())
            soft /= soft.sum()
            total += math.log(soft[chosen] + 1e-12)
            walk_spans.append((start, len(x), chosen, soft))
            start += len(x)
        logp.append(total)
        spans.append(walk_spans)
    logp = np.array(logp)
    positive = int(np.argmax(np.where(np.isfinite(rewards), rewards, -np.inf)))
    loss, d_logp = info_nce(logp, positive)
    d_scores = np.zeros_like(scores)
    for i, walk_spans in enumerate(spans):
        for begin, size, chosen, soft in walk_spans:
            grad = -soft * d_logp[i]
            grad[chosen] += d_logp[i]
            d_scores[begin:begin + size] += grad
    net.adam(net.gradients(cache, d_scores), lr=3e-3)
    return loss


def ordering_gap(weights: dict[str, np.ndarray], problems: list[GroupProblem], samples: int = 4) -> np.ndarray:
    """Per problem: the best of the policy's proposals against the best of every ordering (enumerated)."""
    from plait.search.groups import propose
    from plait.search.space import _multiset_permutations

    gaps = []
    for p in problems:
        best = min(p.time(o) for o in _multiset_permutations(p.counts))
        got = min(p.time(o) for o in propose(p.pricer, p.layout, p.counts, samples, weights=weights))
        gaps.append(got / best - 1.0 if math.isfinite(best) else 0.0)
    return np.array(gaps)


def train_groups(seed: int = 0, problems: int = 40, epochs: int = 30, samples: int = 12, log=print
                 ) -> dict[str, np.ndarray]:
    """Train the device-group policy (group_* arrays); keeps the epoch with the least validation gap."""
    from plait.search.groups import GROUP_FEATURES, GroupContext

    data = group_problems(seed, problems, "train")
    validation = group_problems(seed + 1, max(8, problems // 4), "train")
    rows = []
    for p in data:
        context = GroupContext(p.pricer, p.layout, p.counts)
        rows.append(context.features(0, dict(p.counts), None)[1])
    stacked = np.concatenate(rows)
    mean, std = stacked.mean(0), stacked.std(0) + 1e-6
    mean[-1], std[-1] = 0.0, 1.0
    net = Network(len(GROUP_FEATURES), seed)
    return keep_best(net, data, mean, std, seed, epochs, "group",
                     lambda item, rng: sequence_step(net, item, mean, std, rng, samples),
                     lambda weights: ordering_gap(weights, validation), ("groups ", "group policy"), log)
