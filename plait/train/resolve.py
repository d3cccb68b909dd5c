"""From a Config to the specs and the Plan a run uses, with every mismatch refused before work starts.

No torch here: `plait train` runs these checks in the launching process, so a bad config, a
missing data file or a plan for another model exits with code 2 before any rank starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from plait.errors import ConfigError
from plait.plan import Plan
from plait.spec import ModelSpec
from plait.spec.model import NOT_THE_MODULE
from plait.spec.train import untrainable_precision
from plait.spec.load import load_cluster, load_model
from plait.train.config import Config, ModelConfig

DEFAULT_DEVICES = 2


def resolve_model(config: ModelConfig) -> ModelSpec:
    """The ModelSpec a [model] section names: your module if given, else a model file, else a preset; with its LoRA
    adapters counted on meta (plait.models.lora.with_lora) where [model] lora asks for them."""
    spec = _resolve_base_model(config)
    if config.lora is None:
        return spec
    from plait.models.lora import with_lora

    return with_lora(spec, config.lora)


def _resolve_base_model(config: ModelConfig) -> ModelSpec:
    if config.module:
        if config.path:
            import_path(config.path)
        spec = load_model("module:" + config.module)
        return spec.replace(tp_plan=dict(config.tp_plan)) if config.tp_plan else spec
    if config.tp_plan:
        raise ConfigError("model.tp_plan applies to a model.module model; plait derives the plan of presets, model "
                          "files and Hugging Face models itself")
    if config.file:
        spec = load_model(config.file if "/" in config.file else f"./{config.file}")
        check_pretrained(config, spec)
        return spec
    return load_model(config.source)


# What plait.hf.checkpoint reads (named here too: this module runs in the launcher, without torch).
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def check_pretrained(config: ModelConfig, spec: ModelSpec) -> None:
    """model.weights = "pretrained" needs a Hugging Face model folder that holds its weights."""
    if config.weights != "pretrained":
        return
    if not spec.source.startswith("hf:"):
        raise ConfigError(f"model.weights=\"pretrained\" loads a Hugging Face checkpoint, but model.file "
                          f"{config.file!r} is a plait model file; give a Hugging Face model folder (config.json "
                          f"and model.safetensors) or set model.weights=\"seed\"")
    folder = Path(spec.source.removeprefix("hf:"))
    if not any((folder / name).is_file() for name in HF_WEIGHT_FILES):
        raise ConfigError(f"model.weights=\"pretrained\": {str(folder)!r} holds no {' nor '.join(HF_WEIGHT_FILES)}; "
                          f"put the checkpoint's weights there or set model.weights=\"seed\"")


def check_export(config: Config, model: ModelSpec) -> None:
    """checkpoint.export_hf writes a Hugging Face folder: for a Hugging Face model, into an empty folder unless
    checkpoint.export_overwrite, or a resume of the run that exported there (its checkpoints name the folder)."""
    from plait.outputs import filled_dir
    from plait.train.checkpoint import exports_here

    if config.checkpoint.export_adapter is not None:
        if model.lora is None:
            raise ConfigError("checkpoint.export_adapter writes LoRA adapters, but the model has none; set "
                              "model.lora or unset export_adapter")
        if not model.source.startswith("hf:"):
            raise ConfigError(f"checkpoint.export_adapter writes a peft folder for a Hugging Face model, but the model "
                              f"{model.name!r} is not one; set model.file to a Hugging Face model folder")
        filled_dir(config.checkpoint.export_adapter, "checkpoint.export_adapter", config.checkpoint.export_overwrite,
                   "set checkpoint.export_overwrite=true")
    if config.checkpoint.export_hf is None:
        return
    if not model.source.startswith("hf:"):
        raise ConfigError(f"checkpoint.export_hf writes a Hugging Face folder, but the model {model.name!r} is not a "
                          f"Hugging Face model; set model.file to a Hugging Face model folder or unset export_hf")
    own = exports_here(config)
    filled_dir(config.checkpoint.export_hf, "checkpoint.export_hf", config.checkpoint.export_overwrite or own,
               "set checkpoint.export_overwrite=true")


POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
"""Where Hugging Face configs keep the longest sequence the model was built for (the name varies by family)."""


def check_hf_run(config: Config, model: ModelSpec) -> None:
    """A Hugging Face model trains on its own tokenizer (bytes only when asked for) and within its positions."""
    if not model.source.startswith("hf:"):
        return
    folder = Path(model.source.removeprefix("hf:"))
    folder = folder.parent if folder.is_file() else folder
    if config.data.source != "tokens" and config.data.tokenizer is None and not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"model folder {str(folder)!r} holds no tokenizer.json, so the text has no tokenizer of "
                          f"this model; put the model's tokenizer.json there, set data.tokenizer to a folder holding "
                          f"it, or set data.tokenizer = \"byte\" to train on bytes on purpose")
    check_position_limit(model, config.train.seq_len)


def check_position_limit(model: ModelSpec, seq_len: int, key: str = "train.seq_len") -> None:
    """A Hugging Face model trains (and is planned) within the positions its config.json states; `key` names the
    setting that gave `seq_len` (`plait plan` passes "--seq-len")."""
    if not model.source.startswith("hf:"):
        return
    folder = Path(model.source.removeprefix("hf:"))
    folder = folder.parent if folder.is_file() else folder
    found = position_limit(folder)
    if found is not None and seq_len > found[1]:
        name, limit = found
        said = f"{key} {seq_len}" if key.startswith("--") else f"{key}={seq_len}"
        raise ConfigError(f"{said} is past {model.name}'s position limit ({name}={limit} in "
                          f"{str(folder / 'config.json')!r}); use {key} <= {limit}")


def position_limit(folder: Path) -> tuple[str, int] | None:
    """(key, value) of a Hugging Face model's position limit, read through transformers' config class (which maps
    each family's own name for it), or None when its config states none."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError):  # a config transformers cannot read: the model load says why
        return None
    for key in POSITION_KEYS:
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


def import_path(folder: str) -> None:
    """Make `folder` importable here and in every rank this process starts (PYTHONPATH is inherited)."""
    from plait.inputs import add_import_folder

    path = Path(folder).expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(f"model.path {folder!r} is not a folder; give the folder your model's module is in")
    add_import_folder(str(path))


def resolve_plan(config: Config, num_devices: int | None = None) -> Plan:
    """The plan this run follows: read from [plan] file, or searched for [plan] cluster ("auto")."""
    from plait.train.module_run import check_module_config, is_module_run, plan_module_run

    check_module_config(config)
    if is_module_run(config):  # a module of any shape, placed per operator
        return plan_module_run(config, num_devices)
    model = resolve_model(config.model)
    if config.plan.file == "auto":
        plan = auto_plan(config, model, num_devices)
    else:
        plan = with_config_lora(Plan.from_json(config.plan.file), model)
        if config.train.precision and config.train.precision != plan.train.precision:
            # Precision changes memory, not legality: the config may run a plan file in another dtype.
            plan = plan.replace(train=dataclasses.replace(plan.train, precision=config.train.precision))
    check_plan(plan, config, model)
    if num_devices is not None and plan.num_devices != num_devices:
        raise ConfigError(
            f"the plan needs {plan.num_devices} devices (dp{plan.dp} x tp{plan.tp} x pp{plan.pp}) but "
            f"{num_devices} processes were asked for; use --nproc {plan.num_devices} or another plan"
        )
    return plan


def with_config_lora(plan: Plan, model: ModelSpec) -> Plan:
    """A plan file's model with the config's LoRA alpha and dropout, where the adapters are the same (rank, targets:
    what the plan priced); `plait plan --lora-rank` writes peft's default alpha."""
    planned, wanted = plan.model.lora, model.lora
    if planned is None or wanted is None or planned == wanted:
        return plan
    if (planned.rank, planned.targets, planned.adapter_params) != (wanted.rank, wanted.targets, wanted.adapter_params):
        return plan
    return plan.replace(model=plan.model.replace(lora=wanted))


def plan_for_world(config: Config, world_size: int) -> Plan:
    """The plan of a worker under torchrun, whose world is what the rendezvous gathered: "auto" plans for it (a
    job that lost or gained a machine between rounds re-plans, and the checkpoint reshards); a plan file must
    have been made for it."""
    if config.plan.file == "auto":
        return resolve_plan(config, world_size)
    plan = resolve_plan(config)
    if plan.num_devices != world_size:
        raise ConfigError(
            f"plan file {config.plan.file!r} is for {plan.num_devices} ranks (dp{plan.dp} x tp{plan.tp} x pp{plan.pp}), "
            f"but this round of the job has {world_size} (torchrun's world: a machine left or joined); a fixed plan "
            f"cannot follow it. Set plan.file = \"auto\" to re-plan for each round's ranks (checkpoints reshard), or "
            f"start the job again with {plan.num_devices} ranks")
    return plan


def auto_plan(config: Config, model: ModelSpec, num_devices: int | None) -> Plan:
    """The planner's best plan for this model on [plan] cluster with the given device count."""
    from plait.search import plan as search

    cluster = load_cluster(config.plan.cluster)
    if cluster.islands is not None:  # planned whole: one island's plan, and how the islands talk
        from plait.search.islands import IslandPins, plan_islands

        precision = "fp32" if cluster.device_type == "cpu" else "bf16"
        pins = IslandPins(inner_steps=config.islands.inner_steps or None)
        return plan_islands(model, cluster, config.train.spec(precision), top=1, island_pins=pins,
                            **dict(config.plan.pins)).plans[0]
    devices = num_devices or config.plan.devices or DEFAULT_DEVICES
    cluster = cluster.with_devices(devices)
    pins: dict[str, Any] = dict(config.plan.pins)
    _check_pins(pins)
    precision = "fp32" if cluster.device_type == "cpu" else "bf16"
    plans = search(model, cluster, config.train.spec(precision), num_devices=devices, **pins)
    if not plans:
        raise ConfigError(f"the planner found no plan for {model.name} on {devices} {cluster.name} devices")
    return plans[0]


def _check_pins(pins: dict[str, Any]) -> None:
    from plait.search.space import PIN_NAMES

    known = list(PIN_NAMES)
    for name in pins:
        if name not in known:
            raise ConfigError(f"plan.pins: unknown pin {name!r}; pins: {', '.join(known)}")


def check_plan(plan: Plan, config: Config, model: ModelSpec) -> None:
    """Refuse a plan made for another model or another batch shape, naming the first difference, or one that
    breaks a legality rule (plait.legality: exit 2 before any rank starts)."""
    from plait import legality

    diff = _first_difference(plan.model, model, ignore=NOT_THE_MODULE)
    if diff and diff[0] == "lora":
        _, planned, wanted = diff
        how = (f"--lora-rank {wanted.rank} --lora-targets {','.join(wanted.targets)}" if wanted else "without --lora-rank")
        raise ConfigError(f"the plan is for {model.name} with {_lora_words(planned)} but the config trains it with "
                          f"{_lora_words(wanted)}; make a plan for it with `plait plan --model ... {how} --json FILE`")
    if diff:
        key, planned, wanted = diff
        raise ConfigError(
            f"the plan is for model {plan.model.name!r} ({key}={planned!r}) but the config trains {model.name!r} "
            f"({key}={wanted!r}); make a plan for it with `plait plan --model {model.name} --json FILE`"
        )
    train = config.train.spec()
    for key in ("global_batch", "seq_len"):
        if getattr(plan.train, key) != getattr(train, key):
            raise ConfigError(
                f"the plan was made for {key}={getattr(plan.train, key)} but the config has train.{key}="
                f"{getattr(train, key)}; set train.{key}={getattr(plan.train, key)} or re-plan"
            )
    legality.check(plan.island_plan())  # across islands: what each island runs
    refusal = untrainable_precision(plan.train.precision)
    if refusal:
        raise ConfigError(f"train.{refusal}")
    check_hf_run(config, model)
    check_export(config, model)


def _lora_words(lora: Any) -> str:
    return f"LoRA rank {lora.rank} on {', '.join(lora.targets)}" if lora is not None else "every weight trained (no LoRA)"


def _first_difference(a: Any, b: Any, ignore: tuple[str, ...]) -> tuple[str, Any, Any] | None:
    for field in dataclasses.fields(a):
        if field.name in ignore:
            continue
        left, right = getattr(a, field.name), getattr(b, field.name)
        if left != right:
            return field.name, left, right
    return None


def check_data(config: Config, model: ModelSpec) -> int:
    """Load the data once to refuse a missing or too-short file, or ids beyond the vocabulary; returns its length."""
    from plait.train.data import BatchLoader, training_tokens

    from plait.train.documents import packing_for

    packing = packing_for(config, model)  # "documents" for a model that cannot keep them apart: refused here
    tokens = training_tokens(config, model)  # tokenized (and cached) here, once, before any rank starts
    where = f"data ({config.data.path or 'shipped text'})"
    try:
        BatchLoader(tokens, global_batch=config.train.global_batch, seq_len=config.train.seq_len, packing=packing)
    except ConfigError as e:  # name the file: "data has 3 tokens" alone does not say which
        raise ConfigError(f"{where}: {e}") from None
    if config.eval.every:
        check_eval_data(config, model)
    return len(tokens)


def check_eval_data(config: Config, model: ModelSpec) -> None:
    """The held-out tokens must fill at least one batch; validating on the training documents is said."""
    import sys

    from plait.train.data import BatchLoader, eval_tokens, same_documents

    from plait.train.documents import packing_for

    held_out = eval_tokens(config, model)
    ev = config.eval
    where = (f"eval.path {ev.path!r}" if ev.path else f"eval.split {ev.split!r}" if ev.split else
             f"eval.fraction={ev.fraction}")
    same = same_documents(config)
    if same:
        print(f"plait: warning: validation reads the training documents ({same}): its loss says how well the run "
              f"fits them, not how it does on unseen text; set eval.split (or eval.path) to held-out documents, or "
              f"eval.fraction", file=sys.stderr, flush=True)
    try:
        BatchLoader(held_out, global_batch=config.train.global_batch, seq_len=config.train.seq_len,
                    packing=packing_for(config, model))
    except ConfigError as e:
        raise ConfigError(f"{where}: the held-out {e}; hold out more (a larger eval.fraction, a longer eval.path)") from None


def check_outputs(config: Config) -> None:
    """Refuse a log.dir or checkpoint.dir that cannot be written (plait.outputs), before any work."""
    from plait.outputs import output_dir

    from plait.train.sinks import check_sinks

    output_dir(config.log.dir, "log.dir")
    check_sinks(config.log)
    if config.checkpoint.export_adapter is not None:
        from plait.extras import require

        require("lora", "checkpoint.export_adapter", "export the merged model (checkpoint.export) instead")
    if config.eval.keep_best and config.checkpoint.dir is None:
        raise ConfigError("eval.keep_best=true saves the best checkpoint under checkpoint.dir: set checkpoint.dir")
    if config.checkpoint.dir is not None:
        output_dir(config.checkpoint.dir, "checkpoint.dir")
    if config.data.cache_dir is not None:
        output_dir(config.data.cache_dir, "data.cache_dir")


def check_devices(plan: Plan) -> None:
    """Refuse to start a GPU plan as local processes on a machine without that many GPUs: it would run
    on CPU (or fail in NCCL) as N processes the plan never meant to share one machine."""
    if plan.cluster.device_type != "cuda":
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < plan.num_devices:
        raise ConfigError(
            f"the plan is for {plan.num_devices} GPUs ({plan.cluster.name}) but this machine has {have}; local "
            f"processes cannot run it. Plan for this machine (plan.file = \"auto\" with plan.cluster = \"local-cpu\", "
            f"or `plait plan --cluster local-cpu --devices N --json FILE`), or start it with torchrun on the GPU nodes"
        )


def write_plan(plan: Plan, log_dir: str | Path) -> Path:
    """Save the plan next to the metrics, so every rank (and a later look) reads the same one."""
    path = Path(log_dir) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plan.to_json() + "\n")
    return path
