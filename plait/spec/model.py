"""ModelSpec: what the planner needs to know about a decoder-only model, and where it comes from.

No weights: shapes only. A decoder is an embedding, `num_layers` repeated blocks and a head. A block
is described by its shape (hidden, heads, kv-heads, head_dim, ffn, experts) and a few features:

* ``mlp``: "gelu" (GPT-2: up, GeLU, down), "swiglu" (Llama: down(silu(gate) * up)) or "geglu" (Gemma);
* ``norm``: "layernorm" (weight and bias) or "rmsnorm" (weight);
* ``bias``: which linear layers have biases: "all" (GPT-2), "qkv" (Qwen2), "none" (Llama);
* ``positions``: "learned" (a table of max_seq_len rows: a hard limit on seq_len) or "rope";
* ``qk_norm``: a norm over head_dim on queries and keys (Qwen3);
* ``attention``: how the attention core runs: "fused" (``F.scaled_dot_product_attention``'s flash or
  memory-efficient kernels: no s x s matrix is kept, the backward reruns the scores inside the kernel,
  and causal blocks above the diagonal are skipped) or "math" (the unfused softmax(q·kᵀ)·v of 2021's
  Megatron, which keeps the s x s probabilities for backward). The executor runs what it says (the math
  path through SDPA's MATH backend), and the cost model prices it (plait.cost.compute).

``arch`` is a shorthand that fills the features left unset: "gpt" (gelu, layernorm, all biases,
learned positions) and "llama" (swiglu, rmsnorm, no biases, rope). Blocks may differ (a user's own
module measured on ``meta``): ``blocks`` then holds each block's measured cost, and the cost model
prices them one by one.

``source`` says which model adapter builds the module the executor runs (plait.models.adapter):
"plait" (plait's reference decoder for this spec), "hf:<dir>" (a Hugging Face model directory or
config.json) or "module:<package.module:factory>" (a user's own module). The planner's spec and the
executor's module come from the same source, so the cost model prices what runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from plait.spec._dict import from_dict, to_dict
from plait.spec.lora import Lora

Mlp = Literal["gelu", "swiglu", "geglu"]
Norm = Literal["layernorm", "rmsnorm"]
Bias = Literal["all", "qkv", "none"]
Positions = Literal["learned", "rope"]
Attention = Literal["fused", "math"]
ATTENTION_PATHS: tuple[str, ...] = ("fused", "math")

ARCH_FEATURES: dict[str, dict[str, Any]] = {
    "gpt": {"mlp": "gelu", "norm": "layernorm", "bias": "all", "positions": "learned"},
    "llama": {"mlp": "swiglu", "norm": "rmsnorm", "bias": "none", "positions": "rope"},
}
FEATURES = ("mlp", "norm", "bias", "positions")


SEQ_PROBES = (64, 128)
"""Sequence lengths at which a block is measured on meta (plait.models.measure: two points fix the parts linear and
quadratic in the sequence); the per-token measurements of BlockCost are taken at the first."""


@dataclass(frozen=True, kw_only=True)
class BlockCost:
    """One block as measured on `meta` (plait.models.measure): what the cost model needs when blocks are not
    all the same transformer layer. Per token of a micro-batch, forward pass, whole block (before tensor
    parallelism)."""

    params: int
    """Parameters of the block."""
    flops_per_token: float
    """Forward FLOPs per token that do not grow with the sequence (weight GEMMs)."""
    attention_flops_per_token: float = 0.0
    """Forward FLOPs per token per position of the sequence (attention scores and values: 4·h for a
    transformer layer): the block costs flops_per_token + s · attention_flops_per_token per token."""
    activation_bytes_per_token: float = 0.0
    """Bytes the block keeps for backward per token without recompute, in fp32, measured on meta on the path the run
    takes (fused attention; weights, views and the tables its model hands every layer left out:
    plait.models.saved_bytes), at the shorter measured length."""
    activation_bytes_per_token_position: float = 0.0
    """fp32 bytes per token and position of the sequence the block keeps besides: 0 where attention is fused; an
    attention the class computes itself (soft-capped scores) keeps its s x s probabilities."""
    half_activation_bytes_per_token: float = 0.0
    """As activation_bytes_per_token, with parameters and residual stream in 16 bits (fully_shard's mixed precision):
    what the class upcasts to fp32 shows here. 0: not measured (priced from the fp32 bytes)."""
    autocast_activation_bytes_per_token: float = 0.0
    """As activation_bytes_per_token, under autocast to 16 bits over fp32 parameters (one replica, DDP): a norm's fp32
    output is cast again by every linear that reads it. 0: not measured."""
    half_activation_bytes_per_token_position: float = 0.0
    """As activation_bytes_per_token_position, with 16-bit parameters and residual stream."""
    autocast_activation_bytes_per_token_position: float = 0.0
    """As activation_bytes_per_token_position, under autocast."""
    selective_elements_per_token: float = 0.0
    """Compute-dtype elements per token selective recompute keeps besides the block input (every second GEMM's output
    and the fused attention's: plait.execute.recompute's policy). 0: not measured."""
    selective_fp32_elements_per_token: float = 0.0
    """fp32 elements per token it keeps (the fused attention's logsumexp)."""
    selective_rerun_flops_per_token: float = 0.0
    """Forward FLOPs per token of the GEMMs selective recompute does not keep (every second one, in the class's own
    order), which its backward runs again. 0: not measured (half the block's weight GEMMs)."""
    tensors: int = 0
    """Parameter tensors of the block."""
    unpriced_elements_per_token: float = 0.0
    """Elements per token (at the shorter measured length) written by ops FlopCounterMode has no formula for and that
    do arithmetic (elementwise maths, reductions, scans): work the FLOPs above leave out. Transformer layers write a
    few percent of their FLOPs; a state-space or linear-attention scan written as elementwise steps writes far more
    (plait.models.measure.unpriced_blocks flags it)."""
    expert_params: int = 0
    """Of `params`, the routed experts' (a mixture-of-experts block): what expert parallelism splits."""
    expert_flops_per_token: float = 0.0
    """Of `flops_per_token`, the routed experts' (k experts per token): what the router's imbalance stretches."""
    replicated_params: int = 0
    """Of `params`, those of modules tensor parallelism keeps whole on every rank (a Hugging Face class's attention
    its plan leaves unplaced: plait.hf.flow's replicate_module): held and updated whole by every tensor rank."""
    replicated_flops_per_token: float = 0.0
    """Of `flops_per_token`, those of the modules `replicated_params` belong to: computed whole by every tensor rank."""
    replicated_attention_flops_per_token: float = 0.0
    """Of `attention_flops_per_token`, those of the same modules."""

    def __post_init__(self) -> None:
        if self.params < 0 or self.flops_per_token < 0 or self.attention_flops_per_token < 0 or min(
                self.activation_bytes_per_token, self.activation_bytes_per_token_position,
                self.half_activation_bytes_per_token, self.autocast_activation_bytes_per_token,
                self.half_activation_bytes_per_token_position, self.autocast_activation_bytes_per_token_position,
                self.selective_elements_per_token, self.selective_fp32_elements_per_token,
                self.selective_rerun_flops_per_token) < 0:
            raise ValueError("block costs must be >= 0")
        if not 0 <= self.expert_params <= self.params or not 0 <= self.expert_flops_per_token <= self.flops_per_token:
            raise ValueError("a block's experts are part of it: 0 <= expert_params <= params and 0 <= "
                             "expert_flops_per_token <= flops_per_token")
        if not 0 <= self.replicated_params <= self.params or not 0 <= self.replicated_flops_per_token \
                <= self.flops_per_token or not 0 <= self.replicated_attention_flops_per_token \
                <= self.attention_flops_per_token:
            raise ValueError("a block's replicated modules are part of it: 0 <= replicated_params <= params, 0 <= "
                             "replicated_flops_per_token <= flops_per_token and 0 <= "
                             "replicated_attention_flops_per_token <= attention_flops_per_token")


NOT_THE_MODULE = ("name", "router_imbalance")
"""ModelSpec fields that change neither the module nor its weights (a label, and a pricing assumption): a plan or a
checkpoint is for the same model whatever they hold (plait.train.resolve.check_plan, plait.train.checkpoint)."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str = "custom"
    """A label for tables and checkpoints."""
    source: str = "plait"
    """The adapter that builds the module: "plait", "hf:<dir>" or "module:<package.module:factory>"."""
    arch: str = "gpt"
    """Shorthand for the block features left unset: "gpt" or "llama" (see the module docstring)."""
    num_layers: int
    """Repeated blocks (transformer layers)."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Attention (query) heads a."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means num_heads (plain multi-head)."""
    head_dim: int | None = None
    """Width of one head; None means hidden_size / num_heads (Qwen3 and Gemma decouple it)."""
    ffn_hidden_size: int | None = None
    """MLP inner width; None means 4h for gelu, and Llama's rule (2/3·4h rounded up to 256) for gated MLPs."""
    vocab_size: int
    """Vocabulary V."""
    max_seq_len: int = 2048
    """Longest sequence (the size of the learned position table; a default only for RoPE)."""
    tied_embeddings: bool = False
    """Share the input embedding with the output layer."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    mlp: Mlp | None = None
    norm: Norm | None = None
    bias: Bias | None = None
    positions: Positions | None = None
    qk_norm: bool = False
    """A norm over head_dim applied to queries and keys (Qwen3)."""
    attention: Attention = "fused"
    """The attention core's path: "fused" (SDPA's flash / memory-efficient kernels, the default) or "math"
    (unfused, keeps the s x s probabilities); see the module docstring."""
    sliding_window: int | None = None
    """Attention window of the model's own code (Mistral, Starcoder2, Gemma's local layers): a query attends to the
    keys fewer than this many positions behind it. A Hugging Face class runs its own window masks at any seq_len;
    plait's own decoders have none, so there seq_len must stay within it (plait.legality)."""
    full_attention_layers: tuple[int, ...] = ()
    """Layers that attend over the whole sequence although the model has a sliding_window (Gemma 2's every other
    layer, Qwen2's first max_window_layers); (): every layer slides. Priced by plait.cost.attention."""
    num_experts: int = 0
    """Experts of each mixture-of-experts MLP (0: a dense model)."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k)."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of one expert; None means ffn_hidden_size."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (plait.models.moe)."""
    router_imbalance: float = 1.25
    """Slots the busiest expert-parallel rank receives in a MoE layer's pass, over the mean: dropless routing waits
    for it, so the cost model stretches the experts' compute, dispatch and activations by it under ep > 1
    (plait.cost.compute.busiest_rank_load). The default is an assumption, not fitted: the capacity factor at which
    Switch Transformer's routers, trained with the balance loss, drop almost no tokens (Fedus et al. 2022,
    section 2.2 and Table 1). A run measures its own router's (`plait train`, LOG_DIR/measured.json); give that
    here or with `plait plan --router-imbalance`."""
    blocks: tuple[BlockCost, ...] = ()
    """Per-block measured costs (num_layers entries) of a module measured on meta; () means every block is
    the transformer layer the shape describes."""
    pre_params: int | None = None
    """Measured parameters of what runs before the blocks (None: the embedding the shape describes)."""
    post_params: int | None = None
    """Measured parameters of what runs after the blocks (None: final norm and output layer of the shape)."""
    tp_plan: dict[str, str] = dataclasses.field(default_factory=dict, hash=False)
    """Tensor-parallel plan of a module:factory model (plait.models.adapter.STYLES): "blocks.*.attn.q":
    "colwise", ..., "embed": "embedding"; the other adapters derive theirs."""
    ep_plan: dict[str, str] = dataclasses.field(default_factory=dict, hash=False)
    """Expert-parallel plan of a Hugging Face class (its base_model_ep_plan's entries inside a block: "layers.*.mlp.
    experts": "ep_dispatch_experts", ...; a style plait cannot run is written as the reason), checked by
    plait.legality under ep > 1."""
    lora: Lora | None = None
    """Low-rank adapters on a frozen base (plait.spec.lora): only the adapters train, which the cost model prices
    (plait.cost.trainable) and the executor runs (plait.models.lora). None: every parameter trains."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        defaults = ARCH_FEATURES.get(self.arch, {})
        missing = [f for f in FEATURES if getattr(self, f) is None and f not in defaults]
        if missing:
            raise ValueError(f"arch={self.arch!r} is not one of {', '.join(ARCH_FEATURES)}; then set "
                             f"{', '.join(missing)} explicitly")
        for feature in FEATURES:
            if getattr(self, feature) is None:
                object.__setattr__(self, feature, defaults[feature])
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention={self.attention!r} is not one of {', '.join(ATTENTION_PATHS)}")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                    f"pick heads among the divisors of {self.hidden_size} or give head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", _default_ffn(self.gated_mlp, self.hidden_size))
        if self.num_experts and self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        for name in ("num_kv_heads", "ffn_hidden_size", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.num_experts < 0 or (self.num_experts and not 0 < self.experts_per_token <= self.num_experts):
            raise ValueError(f"experts_per_token={self.experts_per_token} must lie in [1, num_experts="
                             f"{self.num_experts}] for a mixture-of-experts model")
        if isinstance(self.router_imbalance, bool) or not isinstance(self.router_imbalance, (int, float)) \
                or not self.router_imbalance >= 1.0:
            raise ValueError(f"router_imbalance={self.router_imbalance!r} must be a number >= 1 (the busiest "
                             f"expert-parallel rank's slots over the mean; 1 is a perfectly balanced router)")
        object.__setattr__(self, "full_attention_layers", tuple(self.full_attention_layers))  # lists from JSON
        if any(not 0 <= layer < self.num_layers for layer in self.full_attention_layers):
            raise ValueError(f"full_attention_layers={list(self.full_attention_layers)} must be layer indices in "
                             f"[0, {self.num_layers})")
        if self.blocks and len(self.blocks) != self.num_layers:
            raise ValueError(f"blocks holds {len(self.blocks)} entries, num_layers={self.num_layers}")
        if self.source != "plait" and not self.source.startswith(("hf:", "module:")):
            raise ValueError(f"source={self.source!r} must be 'plait', 'hf:<model dir>' or "
                             f"'module:<package.module:factory>'")

    # ---- shapes -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """Width of the query projection: heads · head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection: kv_heads · head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def gated_mlp(self) -> bool:
        return self.mlp in ("swiglu", "geglu")

    @property
    def has_bias(self) -> bool:
        """Biases in the output projection and the MLP (GPT-2)."""
        return self.bias == "all"

    @property
    def uniform(self) -> bool:
        """Whether every block is the same transformer layer (no measured per-block costs)."""
        return not self.blocks

    # ---- parameter counts (exactly those of the adapters' modules) --------------------
    @property
    def attention_params(self) -> int:
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        weights = h * q + 2 * h * kv + q * h  # q, k, v, out
        bias = {"all": q + 2 * kv + h, "qkv": q + 2 * kv, "none": 0}[self.bias]
        return weights + bias + (2 * self.head_dim if self.qk_norm else 0)

    def _mlp_params(self, ffn: int, bias: bool | None = None) -> int:
        h = self.hidden_size
        bias = self.has_bias if bias is None else bias
        if self.gated_mlp:
            return 3 * h * ffn + (2 * ffn + h if bias else 0)
        return 2 * h * ffn + (ffn + h if bias else 0)

    @property
    def mlp_params(self) -> int:
        """The dense MLP, or every expert and the router of a mixture-of-experts layer."""
        if self.num_experts:  # experts without biases, and the router
            expert = self._mlp_params(self.moe_ffn_hidden_size, bias=False)
            return self.num_experts * expert + self.hidden_size * self.num_experts
        return self._mlp_params(self.ffn_hidden_size)

    @property
    def active_mlp_params(self) -> int:
        """MLP parameters one token passes through (experts_per_token experts and the router)."""
        if self.num_experts:
            return (self.experts_per_token * self._mlp_params(self.moe_ffn_hidden_size, bias=False)
                    + self.hidden_size * self.num_experts)
        return self.mlp_params

    @property
    def norm_params(self) -> int:
        """Parameters of one normalization layer (LayerNorm has a bias, RMSNorm not)."""
        return 2 * self.hidden_size if self.norm == "layernorm" else self.hidden_size

    @property
    def params_per_layer(self) -> int:
        """Parameters of one transformer layer (the average block when blocks were measured)."""
        if self.blocks:
            return round(sum(b.params for b in self.blocks) / len(self.blocks))
        return self.attention_params + self.mlp_params + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Token embedding (plus the learned position table)."""
        if self.pre_params is not None:
            return self.pre_params
        positions = self.max_seq_len * self.hidden_size if self.positions == "learned" else 0
        return self.vocab_size * self.hidden_size + positions

    @property
    def head_params(self) -> int:
        """Final norm and, unless tied, the output projection."""
        if self.post_params is not None:
            return self.post_params
        out = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.norm_params + out

    @property
    def num_params(self) -> int:
        layers = sum(b.params for b in self.blocks) if self.blocks else self.num_layers * self.params_per_layer
        return layers + self.embedding_params + self.head_params

    # ---- (de)serialization -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelSpec":
        return from_dict(cls, data, "model")

    def replace(self, **changes: Any) -> "ModelSpec":
        """A copy with `changes`; a new `arch` resets the features it implies unless they are given too."""
        if "arch" in changes:
            changes = {**{f: None for f in FEATURES}, **changes}
        return dataclasses.replace(self, **changes)


def _default_ffn(gated: bool, hidden: int) -> int:
    if gated:
        ffn = int(2 * 4 * hidden / 3)
        return 256 * ((ffn + 255) // 256)
    return 4 * hidden
