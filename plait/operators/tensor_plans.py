"""A decoder's own tensor plan as a candidate of the per-operator program: Megatron's pattern as its class declares
it (a Hugging Face class's `base_model_tp_plan`, read by plait.hf.adapter.tensor_plan_of; plait's reference
Transformer's, plait.models.reference_adapter.ReferenceAdapter.tp_plan), turned into placement pins: a
column-parallel projection's weight split by rows (S0, its bias too), a row-parallel one's by columns (S1).

plait.operators.planner solves the module with these pins beside the free program and records the candidate's price
(OperatorSharding.tensor_plan_step_time_s): the program's plan is priced no higher (it may choose the candidate), so
planning a decoder per operator loses nothing against the decoder path's tensor plan at the same degrees.
"""

from __future__ import annotations

import fnmatch

from torch import nn

COLUMN_STYLES = ("colwise", "colwise_packed", "colwise_kv", "colwise_gather")
ROW_STYLES = ("rowwise", "rowwise_split")


def _block_patterns(model: nn.Module) -> tuple[str, dict[str, str]] | None:
    """(the path of the decoder's blocks inside `model`, {pattern in a block: style}) of the first decoder inside
    `model` (the module itself or a wrapper holding it), or None."""
    from plait.models.reference import Transformer

    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(module, Transformer):
            from plait.models.reference_adapter import ReferenceAdapter

            return f"{prefix}layers", ReferenceAdapter(module.spec).tp_plan().block
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "base_model_tp_plan", None) and \
                hasattr(module, "base_model_prefix"):
            from plait.hf.adapter import tensor_plan_of

            plan = {k.split("*.", 1)[1]: _style(v) for k, v in tensor_plan_of(config).items() if "*." in k}
            blocks = next((name for name, _ in module.named_modules() if name.endswith("layers")), None)
            if plan and blocks:
                return f"{prefix}{blocks}", plan
    return None


def _style(spelled: str) -> str:
    """"colwise", "plait:colwise_packed:3" -> the style's name ("colwise", "colwise_packed")."""
    from plait.hf.adapter import PLAIT_STYLE

    return spelled.removeprefix(PLAIT_STYLE).split(":")[0]


def tensor_plan_pins(model: nn.Module) -> dict[str, str]:
    """The decoder's tensor plan as parameter pins ({} for a module that is not a decoder with one)."""
    found = _block_patterns(model)
    if found is None:
        return {}
    blocks, patterns = found
    pins = {}
    for name, _ in model.named_parameters():
        if not name.startswith(blocks + "."):
            continue
        index, _, inner = name[len(blocks) + 1:].partition(".")
        module, _, leaf = inner.rpartition(".")
        # transformers' Conv1D (GPT-2) holds its weight as [in, out]: the split dimensions swap
        rows, columns = ("S1", "S0") if type(model.get_submodule(name.rpartition(".")[0])).__name__ == "Conv1D" \
            else ("S0", "S1")
        for pattern, style in patterns.items():
            if not fnmatch.fnmatchcase(module, pattern):
                continue
            if style in COLUMN_STYLES and leaf == "weight":
                pins[name] = rows
            elif style in COLUMN_STYLES and leaf == "bias":
                pins[name] = "S0"
            elif style in ROW_STYLES and leaf == "weight":
                pins[name] = columns
    return pins
