"""LoRA as the planner sees it: which parameters train when the base model is frozen and low-rank adapters learn.

`Lora` is what a user writes (`[model] lora = {rank = 16, alpha = 32, targets = ["q_proj", "v_proj"]}`) and what
the Plan carries in its ModelSpec, with two counts plait measures on `meta` when it attaches the adapters
(plait.models.lora.with_lora): the adapters' parameters per block, and how many of them tensor parallelism keeps
whole. Nothing here imports torch: the cost model reads the counts (plait.cost.trainable).

Hu et al. 2021 (LoRA): a frozen linear W [out, in] gains h = W·x + (alpha / rank)·B·A·x with A [rank, in] and
B [out, rank], B starting at zero; only A and B train. peft (0.21) names them `<module>.lora_A` / `lora_B`.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_LINEAR = "all-linear"
"""peft's word for every linear layer of the blocks (the output layer excluded)."""


@dataclass(frozen=True, kw_only=True)
class Lora:
    rank: int = 8
    """The adapters' rank r (peft's `r`)."""
    alpha: float = 8.0
    """The scale's numerator: the adapter's output is multiplied by alpha / rank (peft's `lora_alpha`)."""
    targets: tuple[str, ...] = ()
    """The linear layers that get adapters: names of modules inside the repeated blocks, matched as peft matches
    `target_modules` (the module's name, or a dotted suffix of its path: "q_proj", "self_attn.o_proj"), or
    ["all-linear"]."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (peft's `lora_dropout`); `plait check` runs with it off."""
    adapter_params: int = 0
    """Measured: the adapters' parameters of one block (the mean block), r·(in + out) per target."""
    whole_params: int = 0
    """Measured: of `adapter_params`, those tensor parallelism keeps whole on every tensor rank (A of a
    column-wise projection, B of a row-wise one, both of a projection it does not split)."""
    activation_share: float = 1.0
    """Measured: what the blocks keep for backward with the base frozen, over what they keep with every weight
    trained (autograd keeps no input for a frozen linear without an adapter, nor a frozen norm's normalized
    input): the cost model scales a block's activations by it where nothing is recomputed."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"rank={self.rank!r} must be a positive integer (8, 16, 64 are usual)")
        if not self.alpha > 0:
            raise ValueError(f"alpha={self.alpha!r} must be > 0 (the adapters' scale is alpha / rank)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout!r} must lie in [0, 1)")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        if not self.targets or not all(isinstance(t, str) and t.strip(".") for t in self.targets):
            raise ValueError(f"targets={list(self.targets)!r} must name the linear layers to adapt, e.g. "
                             f"[\"q_proj\", \"v_proj\"] or [\"{ALL_LINEAR}\"]")
        if not 0 < self.activation_share <= 1.5:
            raise ValueError(f"activation_share={self.activation_share!r} must lie in (0, 1.5]")
        if not 0 <= self.whole_params <= self.adapter_params:
            raise ValueError(f"whole_params={self.whole_params} must lie in [0, adapter_params="
                             f"{self.adapter_params}]")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def settings(self) -> "Lora":
        """What the user chose, without the measured counts (what a config or a peft adapter folder holds)."""
        return Lora(rank=self.rank, alpha=self.alpha, targets=self.targets, dropout=self.dropout)
