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
    chosen = logits[picked]
    soft = np.exp(chosen - chosen.max())
    soft /= soft.sum()
    loss = -math.log(soft[positive] + 1e-12)
    d_chosen = soft.copy()
    d_chosen[positive] -= 1.0
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
          log=print) -> dict[str, np.ndarray]:
    """Train from scratch; returns the weights learned.load_weights reads (layout_* arrays): those of the epoch
    whose proposals came closest to the optimum on validation problems of the training family (90th
    percentile of the gap, then the median)."""
    began = time.perf_counter()
    data = make_problems(seed, problems, "train")
    validation = make_problems(seed + 1, max(10, problems // 4), "train")
    log(f"priced {len(data)} training problems ({sum(len(p.times) for p in data)} layouts) "
        f"in {time.perf_counter() - began:.0f} s")
    stacked = np.concatenate([p.features for p in data])
    mean, std = stacked.mean(0), stacked.std(0) + 1e-6
    mean[-1], std[-1] = 0.0, 1.0  # the bias feature stays 1
    net = Network(len(LAYOUT_FEATURES), seed)
    rng = np.random.default_rng(seed)
    best, best_key = None, (math.inf, math.inf)
    for epoch in range(epochs):
        losses = [contrastive_step(net, data[i], mean, std, rng, samples, temperature)
                  for i in rng.permutation(len(data))]
        weights = {f"layout_{k}": v.copy() for k, v in net.params.items()}
        weights.update(layout_mean=mean, layout_std=std)
        gaps = proposal_gap(weights, validation)
        key = (float(np.quantile(gaps, 0.9)), float(np.median(gaps)))
        if key < best_key:
            best, best_key = weights, key
        if epoch % 10 == 0 or epoch == epochs - 1:
            log(f"epoch {epoch + 1}/{epochs}: contrastive loss {np.mean(losses):.3f}, validation gap median "
                f"{key[1]:.2%}, 90th percentile {key[0]:.2%}")
    log(f"kept the weights of validation gap 90th percentile {best_key[0]:.2%}, median {best_key[1]:.2%}")
    return best
