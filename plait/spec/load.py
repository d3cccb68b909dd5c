"""Turn what a user types (a preset name or a file path) into a ModelSpec, ClusterSpec or TrainSpec.

Accepted model inputs:

* a preset name from plait.spec.models.MODEL_PRESETS (``gpt3-175b``, ``llama3-8b``, ...);
* a plait model file (YAML or JSON) holding ModelSpec fields, optionally ``preset: NAME`` to
  start from a preset and override some fields;
* a Hugging Face ``config.json`` of any causal LM the installed transformers knows, read offline (no network, no
  weights): its blocks measured on ``meta`` from the class itself (plait.hf.spec), the shape fields from
  the cost model's closed forms where the family has them (Llama-like -> arch "llama"; GPT-2 -> arch "gpt"), read
  generically from the config otherwise. Mixture-of-experts classes run as they are too, their experts included
  (plait/hf/expert_parallel.py); Mixtral's and Qwen3-MoE's shape fields come from the closed forms.

Accepted cluster inputs: a preset name from plait.spec.clusters.CLUSTER_PRESETS, or a YAML/JSON
file holding ClusterSpec fields (optionally ``preset: NAME`` plus overrides). Sizes may be plain
numbers (bytes, FLOP/s, bytes/s, seconds) or strings with units: ``80GiB``, ``312 TFLOPS``,
``230 GB/s``, ``5us``.

Every failure is a ConfigError whose one line names the value and what would work.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from plait.errors import ConfigError
from plait.inputs import read_text
from plait.spec.cluster import ClusterSpec
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.model import ModelSpec
from plait.spec.models import MODEL_PRESETS
from plait.spec.train import TrainSpec

FILE_SUFFIXES = (".json", ".yaml", ".yml")

# Hugging Face model types plait runs (plait.hf.adapter), and the class names that imply them.
HF_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
HF_MOE_TYPES = ("mixtral", "qwen3_moe")
"""Mixture-of-experts types the closed forms describe (a config.json alone, model_from_hf_config, is planned as
plait's reference MoE decoder of the same shape: top-k routing renormalized over the k, as both do); a model
directory runs the class itself."""
HF_GPT_TYPES = ("gpt2",)
HF_CLOSED_FORM_TYPES = HF_LLAMA_TYPES + HF_GPT_TYPES + HF_MOE_TYPES
"""Families whose ModelSpec fields the cost model's closed forms describe (plait.hf.spec measures the rest)."""
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "GPT2LMHeadModel": "gpt2",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


# ---- public API -----------------------------------------------------------------------------
def load_model(name_or_path: str | Path | ModelSpec) -> ModelSpec:
    """A ModelSpec from a preset name, a plait model file or a Hugging Face config.json."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    text = str(name_or_path)
    if text.startswith("module:"):
        from plait.models.factory import factory_spec  # imports the user's module (and torch) to measure it

        return factory_spec(text)
    if text.startswith("hf:"):
        text = text.removeprefix("hf:")
    elif not _looks_like_path(text):
        return _preset(MODEL_PRESETS, text, "model")
    path = _existing_file(text, "model")
    data = read_mapping(path)
    if _is_hf_config(data):
        return _hf_spec(path, data)
    return _spec_from_mapping(ModelSpec, MODEL_PRESETS, data, "model", path, _default_name(path))


def load_cluster(name_or_path: str | Path | ClusterSpec) -> ClusterSpec:
    """A ClusterSpec from a preset name or a YAML/JSON cluster file (human units allowed)."""
    if isinstance(name_or_path, ClusterSpec):
        return name_or_path
    text = str(name_or_path)
    if not _looks_like_path(text):
        return _preset(CLUSTER_PRESETS, text, "cluster")
    path = _existing_file(text, "cluster")
    data = _normalize_cluster_units(read_mapping(path), str(path))
    return _spec_from_mapping(ClusterSpec, CLUSTER_PRESETS, data, "cluster", path, _default_name(path))


def load_train(source: str | Path | Mapping[str, Any] | TrainSpec | None = None, **fields: Any) -> TrainSpec:
    """A TrainSpec from a mapping or a YAML/JSON file, with keyword fields overriding it.

    ``load_train(global_batch=8, seq_len=128)`` is TrainSpec(...) whose bad values raise ConfigError.
    """
    if isinstance(source, TrainSpec):
        base: dict[str, Any] = source.to_dict()
    elif source is None:
        base = {}
    elif isinstance(source, Mapping):
        base = dict(source)
    else:
        base = read_mapping(_existing_file(str(source), "train"))
    base.update({k: v for k, v in fields.items() if v is not None})
    return TrainSpec.from_dict(base)


def model_from_hf_config(config: Mapping[str, Any], *, name: str = "hf-model", where: str = "config.json",
                         source: str = "plait") -> ModelSpec:
    """Map a Hugging Face config dict to a ModelSpec (shapes only; weights are never read). With `source`
    "hf:<dir>" the executor runs the Hugging Face class itself; "plait" runs plait's reference decoder of
    the same shape."""
    model_type = _hf_model_type(config, where)
    if model_type not in HF_CLOSED_FORM_TYPES:
        raise ConfigError(f"{where}: Hugging Face model type {model_type!r} has no closed form in plait's cost model "
                          f"(those: {', '.join(HF_CLOSED_FORM_TYPES)}); give its model directory instead, and plait "
                          f"measures the class on meta")
    if model_type in HF_MOE_TYPES:
        fields, source = _moe_fields(config, where, model_type), "plait"
    elif model_type in HF_LLAMA_TYPES:
        fields = _llama_fields(config, where, model_type)
    else:
        fields = _gpt2_fields(config, where)
    try:
        return ModelSpec(name=name, source=source, **fields)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def read_mapping(path: str | Path) -> dict[str, Any]:
    """Parse a YAML or JSON file into a dict; syntax errors name the file, line and column."""
    path = Path(path)
    text = read_text(path, "file")
    if path.suffix == ".json":
        data = _parse_json(text, path)
    else:
        data = _parse_yaml(text, path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields (key: value), got {type(data).__name__}")
    return data


def closest_first(name: str, choices: list[str] | tuple[str, ...]) -> list[str]:
    """`choices` with the ones closest to `name` first (difflib), the rest in their given order."""
    close = difflib.get_close_matches(name.lower(), list(choices), n=len(choices), cutoff=0.5)
    return close + [c for c in choices if c not in close]


# ---- presets and files ----------------------------------------------------------------------
def _looks_like_path(text: str) -> bool:
    return "/" in text or "\\" in text or text.lower().endswith(FILE_SUFFIXES) or Path(text).is_file()


def _preset(presets: Mapping[str, Any], name: str, kind: str) -> Any:
    if name in presets:
        return presets[name]
    lowered = {k.lower(): k for k in presets}
    if name.lower() in lowered:
        return presets[lowered[name.lower()]]
    ordered = closest_first(name, list(presets))
    hint = f"did you mean {ordered[0]!r}? " if difflib.get_close_matches(name.lower(), list(presets), n=1) else ""
    raise ConfigError(
        f"unknown {kind} {name!r}; {hint}presets: {', '.join(ordered)} (or a path to a {kind} file)"
    )


def _existing_file(text: str, kind: str) -> Path:
    path = Path(text).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"  # a Hugging Face model directory
    if not path.is_file():
        raise ConfigError(f"{kind} file {text!r} does not exist; give a preset name or a .yaml/.json {kind} file")
    return path


def _default_name(path: Path) -> str:
    return path.stem if path.stem != "config" else path.parent.name or "custom"


def _spec_from_mapping(cls: type, presets: Mapping[str, Any], data: dict[str, Any], kind: str, path: Path,
                       default_name: str) -> Any:
    """Fields of `cls` from a file, optionally on top of ``preset: NAME`` (nested mappings merged)."""
    data = dict(data)
    if hasattr(cls, "upgrade_dict"):  # keys an older plait wrote elsewhere, moved before merging on a preset
        try:
            data = cls.upgrade_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    base: dict[str, Any] = {"name": default_name}
    try:
        if "preset" in data:
            base = _preset(presets, str(data.pop("preset")), kind).to_dict()
        return cls.from_dict(_merge(base, data))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _parse_json(text: str, path: Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None


def _parse_yaml(text: str, path: Path) -> Any:
    import yaml  # only needed for YAML files

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or "syntax error"
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML: {problem}{at}") from None


# ---- Hugging Face config.json ---------------------------------------------------------------
def _is_hf_config(data: Mapping[str, Any]) -> bool:
    return "model_type" in data or "architectures" in data


def _hf_name(path: Path, data: Mapping[str, Any]) -> str:
    given = data.get("_name_or_path")
    if isinstance(given, str) and given:
        return given.rstrip("/").split("/")[-1]
    return _default_name(path)


def _hf_model_type(config: Mapping[str, Any], where: str) -> str:
    model_type = config.get("model_type")
    if model_type is None:
        for arch in config.get("architectures") or ():
            if arch in HF_ARCHITECTURES:
                model_type = HF_ARCHITECTURES[arch]
                break
    if model_type is None:
        raise ConfigError(f"{where}: a Hugging Face config.json needs a 'model_type' (architectures "
                          f"{config.get('architectures')!r} do not say it); add it")
    return str(model_type)


def _hf_spec(path: Path, data: Mapping[str, Any]) -> ModelSpec:
    """A Hugging Face model directory's ModelSpec: its blocks measured on meta (plait.hf.spec)."""
    where = str(path)
    model_type = _hf_model_type(data, where)
    name, source = _hf_name(path, data), "hf:" + str(path.resolve().parent)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        import transformers

        near = difflib.get_close_matches(model_type, list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), n=3)
        raise ConfigError(f"{where}: model_type {model_type!r} is no causal language model of the installed "
                          f"transformers {transformers.__version__}" + (f"; did you mean {', '.join(near)}?" if near
                                                                         else ""))
    closed = None
    if model_type in HF_CLOSED_FORM_TYPES:
        try:
            closed = model_from_hf_config(data, name=name, where=where, source=source).to_dict()
        except ConfigError as error:  # a variant the closed forms do not describe (biases, ...): read generically
            if "not supported" not in str(error):
                raise
            closed = None
    from plait.hf.spec import hf_model_spec

    return hf_model_spec(path.parent, name=name, closed_form=closed)


def _need(config: Mapping[str, Any], key: str, where: str) -> Any:
    if config.get(key) is None:
        raise ConfigError(f"{where}: missing required key {key!r} for this model_type")
    return config[key]


def _llama_fields(config: Mapping[str, Any], where: str, model_type: str) -> dict[str, Any]:
    hidden = _need(config, "hidden_size", where)
    heads = _need(config, "num_attention_heads", where)
    if config.get("num_local_experts") or config.get("num_experts"):
        raise ConfigError(f"{where}: mixture-of-experts models of type {model_type!r} are not supported")
    if config.get("attention_bias") and model_type not in ("qwen2",) or config.get("mlp_bias"):
        raise ConfigError(f"{where}: attention_bias / mlp_bias are not supported for model_type {model_type!r}")
    activation = config.get("hidden_act") or config.get("hidden_activation") or "silu"
    rope = config.get("rope_parameters") or {}
    tied_default = model_type == "gemma"
    return dict(
        arch="llama",
        mlp="swiglu" if activation == "silu" else "geglu",
        bias="qkv" if model_type == "qwen2" else "none",
        qk_norm=model_type == "qwen3",
        num_layers=_need(config, "num_hidden_layers", where),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or None,
        ffn_hidden_size=_need(config, "intermediate_size", where),
        vocab_size=_need(config, "vocab_size", where),
        max_seq_len=config.get("max_position_embeddings") or 2048,
        tied_embeddings=bool(config.get("tie_word_embeddings", tied_default)),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        **window_fields(config),
    )


WINDOW_KEYS = ("sliding_window", "use_sliding_window", "layer_types")
"""The config keys window_fields reads."""


def window_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """sliding_window and full_attention_layers of a Hugging Face config (as a dict): its window where it uses one,
    and the layers its ``layer_types`` says attend over the whole sequence ("full_attention")."""
    window = config.get("sliding_window") if config.get("use_sliding_window") is not False else None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return {"sliding_window": None}
    kinds = config.get("layer_types")
    kinds = kinds if isinstance(kinds, (list, tuple)) else ()
    full = tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    return {"sliding_window": int(window), "full_attention_layers": full}


def _moe_fields(config: Mapping[str, Any], where: str, model_type: str) -> dict[str, Any]:
    """Mixtral (num_local_experts, Mistral's attention) and Qwen3-MoE (num_experts, moe_intermediate_size, Qwen3's
    q/k norms): every layer's MLP a set of experts without shared experts, top-k weights renormalized over the k."""
    dense = {k: v for k, v in config.items() if k not in ("num_local_experts", "num_experts")}
    fields = _llama_fields(dense, where, "mistral" if model_type == "mixtral" else "qwen3")
    experts = config.get("num_local_experts") or config.get("num_experts")
    if not experts:
        raise ConfigError(f"{where}: missing required key {'num_local_experts' if model_type == 'mixtral' else 'num_experts'!r} "
                          f"for model_type {model_type!r}")
    if config.get("shared_expert_intermediate_size") or config.get("n_shared_experts"):
        raise ConfigError(f"{where}: shared experts are not supported (plait's MoE routes every token to its top-k "
                          f"experts only)")
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{where}: dense layers between the MoE ones (mlp_only_layers / decoder_sparse_step) are not "
                          f"supported: every layer of plait's MoE decoder has experts")
    if config.get("norm_topk_prob") is False:
        raise ConfigError(f"{where}: norm_topk_prob=false is not supported: plait's router renormalizes the top-k "
                          f"weights (Mixtral's and Qwen3-MoE's default)")
    return dict(fields, num_experts=int(experts), experts_per_token=int(_need(config, "num_experts_per_tok", where)),
                moe_ffn_hidden_size=int(config.get("moe_intermediate_size") or fields["ffn_hidden_size"]),
                moe_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.01)))


def _gpt2_fields(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    hidden = _need(config, "n_embd", where)
    return dict(
        arch="gpt",
        num_layers=_need(config, "n_layer", where),
        hidden_size=hidden,
        num_heads=_need(config, "n_head", where),
        ffn_hidden_size=config.get("n_inner") or None,  # None in GPT-2 configs means 4 * n_embd
        vocab_size=_need(config, "vocab_size", where),
        max_seq_len=config.get("n_positions") or 1024,
        # GPT2LMHeadModel always ties lm_head to wte; the key is absent from most GPT-2 configs.
        tied_embeddings=bool(config.get("tie_word_embeddings", True)),
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
    )


# ---- human units for cluster files ----------------------------------------------------------
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15,
           "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_TIME_DIVISOR = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # divide: 5 / 1e6 is exactly 5e-6
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$")


def parse_bytes(value: Any, where: str = "value") -> float:
    """80GiB, 80 GB, 8e10, 80e9 -> bytes."""
    return _parse_unit(value, where, r"(k|m|g|t|p|ki|mi|gi|ti)?b", "bytes such as 80GiB or 8.6e10")


def parse_flops(value: Any, where: str = "value") -> float:
    """312 TFLOPS, 312e12, 989TFLOP/s -> FLOP/s."""
    return _parse_unit(value, where, r"(k|m|g|t|p)?flop(s|/s)?", "FLOP/s such as 312 TFLOPS or 3.12e14")


def parse_bandwidth(value: Any, where: str = "value") -> float:
    """230 GB/s, 25GBps, 2.3e11 -> bytes per second; a lower-case b means bits (200 Gb/s = 25e9 B/s)."""
    rate = _parse_unit(value, where, r"(k|m|g|t|ki|mi|gi|ti)?b(/s|ps)", "bytes/s such as 230 GB/s, 200 Gb/s or 2.3e11")
    is_bits = isinstance(value, str) and re.search(r"b(/s|ps)\s*$", value) is not None
    return rate / 8 if is_bits else rate


def parse_seconds(value: Any, where: str = "value") -> float:
    """5us, 0.5 ms, 5e-6 -> seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = _QUANTITY.match(str(value))
    if match and match.group(2).lower() in _TIME_DIVISOR:
        return float(match.group(1)) / _TIME_DIVISOR[match.group(2).lower()]
    if match and not match.group(2):
        return float(match.group(1))
    raise ConfigError(f"{where}: cannot read {value!r} as a time; write seconds such as 5e-6, 5us or 0.5ms")


def _parse_unit(value: Any, where: str, unit_pattern: str, example: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = _QUANTITY.match(str(value))
    unit = match.group(2).lower() if match else ""
    if match and (not unit or re.fullmatch(unit_pattern, unit)):
        prefix = re.match(r"^(ki|mi|gi|ti|k|m|g|t|p)?", unit).group(1) or ""
        return float(match.group(1)) * _PREFIX[prefix]
    raise ConfigError(f"{where}: cannot read {value!r}; write {example}")


_CLUSTER_UNITS: dict[str, Callable[[Any, str], float]] = {
    "memory_bytes": parse_bytes,
    "peak_flops": parse_flops,
}
_LINK_UNITS: dict[str, Callable[[Any, str], float]] = {
    "bandwidth": parse_bandwidth,
    "latency_s": parse_seconds,
}


def _normalize_cluster_units(data: dict[str, Any], where: str, prefix: str = "cluster") -> dict[str, Any]:
    out = dict(data)
    for key, parse in _CLUSTER_UNITS.items():
        if key in out and isinstance(out[key], str):
            out[key] = parse(out[key], f"{where}: {prefix}.{key}")
    host = out.get("host")
    if isinstance(host, Mapping):  # host time: 0.5ms, 300us, 3e-4
        out["host"] = {k: parse_seconds(v, f"{where}: {prefix}.host.{k}") if isinstance(v, str) else v
                       for k, v in host.items()}
    for level in ("intra_node", "inter_node", "between_groups"):
        link = out.get(level)
        if isinstance(link, Mapping):
            link = dict(link)
            for key, parse in _LINK_UNITS.items():
                if key in link and isinstance(link[key], str):
                    link[key] = parse(link[key], f"{where}: {prefix}.{level}.{key}")
            out[level] = link
    islands = out.get("islands")
    if isinstance(islands, Mapping) and isinstance(islands.get("link"), Mapping):  # the slow link: 100 Gb/s, 30ms
        islands = dict(islands)
        islands["link"] = {k: _LINK_UNITS[k](v, f"{where}: {prefix}.islands.link.{k}")
                           if k in _LINK_UNITS and isinstance(v, str) else v for k, v in islands["link"].items()}
        out["islands"] = islands
    groups = out.get("groups")
    if isinstance(groups, list) and groups and all(isinstance(g, Mapping) for g in groups):
        out["groups"] = [_normalize_cluster_units(g, where, f"{prefix}.groups[{i}]") for i, g in enumerate(groups)]
        # a mixed cluster's own hardware fields are its first group's, its device count their sum
        first = out["groups"][0]
        for key in ("memory_bytes", "peak_flops", "intra_node", "devices_per_node", "efficiency"):
            if key in first:
                out.setdefault(key, first[key])
        out.setdefault("inter_node", first.get("inter_node", first.get("intra_node")))
        out.setdefault("num_devices", sum(int(g.get("num_devices", 0)) for g in out["groups"]))
    return out
