"""plait's reference mixture-of-experts MLP (Shazeer et al. 2017; Mixtral's top-k routing).

* Router: a linear layer to `num_experts` logits; each token goes to its `experts_per_token` most probable
  experts, weighted by their probabilities renormalized over those k (Mixtral).
* Dropless: every token reaches all k of its experts, whatever their load (no capacity factor, no dropped
  tokens, as MegaBlocks and torchtitan do), so the result does not depend on how tokens are grouped -- what lets
  a parallel run equal one process.
* Load balance: the auxiliary loss of Switch/GShard, E · Σ_e f_e · P_e (f_e: fraction of the routed slots that
  went to expert e, P_e: its mean router probability), computed per sequence and averaged over sequences
  (DeepSeek-V3's sequence-wise balance loss). Per sequence, it is the same however sequences are spread over
  micro-batches and data-parallel ranks; under context parallelism the sums are all-reduced over the ranks
  that share a sequence. It reaches the gradient through `AuxLoss` (attached to the output, no change to the
  loss function or the pipeline schedule), scaled by `aux_scale` (1 / micro-batches).
* Experts are stacked tensors [E, ...] so that expert parallelism shards their first dimension and tensor
  parallelism their inner width (plait/execute/expert.py). `dispatch` is where expert parallelism exchanges
  tokens; without it, every expert is here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.spec import ModelSpec


class AuxLoss(torch.autograd.Function):
    """Identity on `output` forward; backward also sends `scale` as the gradient of `aux` (Megatron's auto-scaler)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class _AllReduce(torch.autograd.Function):
    """Sum over `group`; the gradient of the sum is summed over the group too (every rank's loss uses it)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class Experts(nn.Module):
    """num_experts MLPs as stacked weights: w1, w3 [E, f, h] and w2 [E, h, f] (gated), or w1, w2 (GeLU)."""

    HIDDEN_DIM = {"w1": 2, "w3": 2, "w2": 1}
    """Each weight's dimension of width h: the one expert parallelism (E) and tensor parallelism (f) leave whole,
    along which data parallelism shards the experts (plait/execute/data.py)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        e, h, f = spec.num_experts, spec.hidden_size, spec.moe_ffn_hidden_size
        self.kind = spec.mlp
        self.w1 = nn.Parameter(torch.empty(e, f, h))
        self.w2 = nn.Parameter(torch.empty(e, h, f))
        self.w3 = nn.Parameter(torch.empty(e, f, h)) if spec.gated_mlp else None

    def local(self, name: str) -> torch.Tensor:
        """This rank's experts of one weight (a DTensor under expert or tensor parallelism)."""
        weight = getattr(self, name)
        return weight.to_local() if hasattr(weight, "to_local") else weight

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [tokens, h] grouped by this rank's experts, `counts[e]` tokens for local expert e."""
        w1, w2 = self.local("w1"), self.local("w2")
        if x.is_meta:  # tracing shapes only (plait check --dry-run): spread the tokens evenly
            base, extra = divmod(x.shape[0], w1.shape[0])
            counts = [base + (e < extra) for e in range(w1.shape[0])]
        w3 = self.local("w3") if self.w3 is not None else None
        outputs = []
        for e, chunk in enumerate(x.split(counts)):
            inner = chunk @ w1[e].t()
            if self.kind == "swiglu":
                inner = F.silu(inner) * (chunk @ w3[e].t())
            elif self.kind == "geglu":
                inner = F.gelu(inner, approximate="tanh") * (chunk @ w3[e].t())
            else:
                inner = F.gelu(inner, approximate="tanh")
            outputs.append(inner @ w2[e].t())
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])


class LocalDispatch:
    """Every expert is on this rank: tokens sorted by expert go straight to them."""

    def __call__(self, experts: Experts, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return experts(routed, [] if counts.is_meta else counts.tolist())


class MoE(nn.Module):
    """x [b, s, h] -> Σ over each token's top-k experts of weight · expert(x)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_experts, self.top_k = spec.num_experts, spec.experts_per_token
        self.aux_coef = spec.moe_aux_loss_coef
        self.router = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec)
        self.dispatch = LocalDispatch()
        self.aux_scale = 1.0
        self.sequence_group = None
        """Under context parallelism, the group of ranks holding the other tokens of the same sequences."""
        self.enter = self.leave = None
        """Under tensor parallelism, Megatron's f and g operators around the experts (plait/execute/expert.py)."""
        self.on_counts = None
        """Called with each pass's slots per expert [E] when set (plait.train.measure.RouterLoad)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        logits = self.router(tokens)
        probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)  # [T, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, tokens in order within each
        token_of = order // self.top_k
        # on meta (plait check --dry-run traces shapes) there are no counts: the experts spread the tokens evenly
        counts = flat.new_empty(self.num_experts) if flat.is_meta else torch.bincount(flat, minlength=self.num_experts)
        if self.on_counts is not None and not flat.is_meta:
            self.on_counts(counts)
        if self.enter is not None:  # tensor parallelism: the experts' outputs are partial sums over tp, so the
            tokens_in, weights = self.enter(tokens), self.enter(weights)  # gradients of what meets them are too
        else:
            tokens_in = tokens
        out = self.dispatch(self.experts, tokens_in[token_of], counts)  # [T·k, h], in `order`
        combined = torch.zeros_like(tokens).index_add(0, token_of, out * weights.reshape(-1)[order, None])
        combined = combined.reshape(b, s, h)
        if self.leave is not None:
            combined = self.leave(combined)
        if self.training and torch.is_grad_enabled() and self.aux_coef > 0:
            aux = self.balance_loss(probs.reshape(b, s, -1), chosen.reshape(b, s, -1))
            combined = AuxLoss.apply(combined, aux, self.aux_coef * self.aux_scale)
        return combined

    def balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Mean over sequences of E · Σ_e f_e · P_e (probs [b, s, E], chosen [b, s, k])."""
        routed = F.one_hot(chosen, self.num_experts).sum(2).to(probs.dtype)  # [b, s, E] slots per expert
        slot_sums, prob_sums = routed.sum(1), probs.sum(1)  # [b, E], over this rank's tokens of each sequence
        tokens = torch.tensor(float(probs.shape[1]), dtype=probs.dtype, device=probs.device)
        if self.sequence_group is not None:  # the sequence's other tokens are on the other context ranks
            from plait.torch_internals import all_reduce

            slot_sums = all_reduce(slot_sums, "sum", self.sequence_group)  # counts: no gradient
            prob_sums = _AllReduce.apply(prob_sums, self.sequence_group)
            tokens = tokens * torch.distributed.get_world_size(self.sequence_group)
        fraction = slot_sums / (tokens * self.top_k)
        mean_prob = prob_sums / tokens
        return (self.num_experts * (fraction * mean_prob).sum(-1)).mean()


def set_aux_scale(module: nn.Module, scale: float) -> None:
    """The weight of every MoE layer's balance-loss gradient in `module`: 1 / micro-batches, so that the micro-batches'
    balance losses add up to the whole batch's (a mean over its sequences), as their losses add up to its token mean
    (plait.execute.step_loss)."""
    for sub in module.modules():
        if isinstance(sub, MoE):
            sub.aux_scale = scale
