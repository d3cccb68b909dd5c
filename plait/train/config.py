"""The `plait train` config: a TOML file read into nested frozen dataclasses.

    [model]      preset = "tiny-gpt"              # or file = "model.json" (plait model file / HF config.json),
                                                  # or module = "pkg.mod:factory" (one of the three);
                                                  # weights = "pretrained": start from the HF checkpoint in `file`;
                                                  # lora = {rank = 16, targets = ["q_proj", "v_proj"]}: adapters
    [data]       source = "shipped"               # or "text" / "jsonl" / "tokens" with path (and dtype);
                                                  # tokenizer = "byte" or a folder with tokenizer.json
    [optimizer]  lr = 3e-3, warmup = 20, schedule = "cosine", clip = 1.0
    [train]      steps = 200, global_batch = 16, seq_len = 128, seed = 0
    [plan]       file = "auto", cluster = "local-cpu", devices = 2   # or file = "plan.json"; adapt = false
    [checkpoint] dir = "runs/x/ckpt", every = 50, keep = 3, resume = false, start_over = false,
                 export_hf = "runs/x/hf"          # a Hugging Face folder written at the end
    [log]        dir = "runs/x", every = 10, tensorboard = false, wandb = "off"   # or "offline" / "online"
    [eval]       every = 0, fraction = 0.05 (or path = "val.txt", or split = "validation"), batches = 4,
                 keep_best = false   # a per-operator run (data.batch = "pkg.mod:batch"): batch = "pkg.mod:held_out"

Every key has a default except none: an empty file trains tiny-gpt on the shipped text.
Unknown keys and wrong types raise ConfigError naming the key and the keys that exist.
Overrides from the command line use dotted keys: ``--set train.steps=20``; the value is
read as TOML (``20``, ``3e-4``, ``"cosine"``, ``[0.9, 0.95]``) and falls back to a string.

This module imports no torch: the launcher reads and checks the config before starting ranks.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from plait.errors import ConfigError
from plait.spec import TrainSpec
from plait.spec._dict import from_dict, to_dict
from plait.spec.lora import Lora


DEFAULT_PRESET = "tiny-gpt"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Exactly one of `preset`, `file` and `module` names the model (none: the tiny-gpt preset)."""

    preset: str | None = None
    """A name from plait.spec.models.MODEL_PRESETS; None: tiny-gpt when neither `file` nor `module` is set."""
    file: str | None = None
    """A plait model file (JSON/YAML of ModelSpec fields), or a Hugging Face model directory / config.json (the
    executor then runs the transformers class itself)."""
    module: str | None = None
    """Your own model: "package.module:factory", a callable returning an nn.Module with `blocks`, `embed(tokens)`
    and `head(hidden)` (plait.models.factory)."""
    path: str | None = None
    """A folder to import `module` from (relative to the working directory); added to every rank's PYTHONPATH."""
    tp_plan: dict[str, str] = field(default_factory=dict)
    """Tensor parallelism of a `module` model, HF-style: "blocks.*.attn.q" = "colwise", "tokens" = "embedding", ...
    (styles: plait.models.adapter.STYLES). Without it such a model runs with tp = 1."""
    weights: Literal["seed", "pretrained"] = "seed"
    """The initial weights: "seed" (drawn from train.seed), or "pretrained": the Hugging Face checkpoint in the
    folder of `file` (model.safetensors, or shards listed by model.safetensors.index.json), each rank reading
    only its own slices (plait.hf.checkpoint)."""
    lora: Lora | None = None
    """Train low-rank adapters on the frozen model instead of every weight: {rank, alpha, targets, dropout}
    (plait.spec.lora; docs/lora.md), e.g. {rank = 16, alpha = 32, targets = ["q_proj", "v_proj"]}."""

    def __post_init__(self) -> None:
        named = [key for key in ("preset", "file", "module") if getattr(self, key)]
        if len(named) > 1:
            # Which one would win is a guess the user should not have to make: refuse both.
            raise ValueError(f"{' and '.join(f'{k}={getattr(self, k)!r}' for k in named)} are both set; keep one "
                             f"(preset: a named model, file: a model file or Hugging Face model, module: your factory)")
        if self.weights == "pretrained" and not self.file:
            raise ValueError("weights=\"pretrained\" loads a Hugging Face checkpoint: set model.file to its folder")

    @property
    def source(self) -> str:
        """The preset name when the model is a preset (tiny-gpt when nothing is set)."""
        return self.preset or DEFAULT_PRESET


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the tokens come from (plait.train.data): tokenized once, cached, documents packed with EOS between."""

    source: Literal["shipped", "text", "jsonl", "tokens", "hf"] = "shipped"
    """"shipped": the text in plait/data; "text": a UTF-8 file (one document); "jsonl": JSON lines, one document
    each (`text_key`); "tokens": a pre-tokenized uint16/uint32 file; "hf": a Hugging Face `datasets` dataset on
    disk (a save_to_disk folder, or a local parquet / JSON / Arrow file), one document per row (`text_key`)."""
    path: str | None = None
    """The file (or, for "hf", the folder) for source "text" / "jsonl" / "tokens" / "hf"."""
    dtype: Literal["auto", "uint16", "uint32"] = "auto"
    """Element type of a token file; "auto" reads it from the name (train.u16.bin, train.uint32.bin)."""
    text_key: str = "text"
    """The key of each JSON line (the column of an "hf" dataset) that holds its document."""
    split: str = "train"
    """The split of an "hf" dataset folder that holds several (a DatasetDict)."""
    chat: bool = False
    """Chat fine-tuning: each row (source "jsonl" or "hf") holds a list of {"role", "content"} messages under
    `text_key`, rendered with the tokenizer's chat template; the loss is on the assistant's tokens only."""
    packing: Literal["documents", "stream", "padded"] | None = None
    """How documents make training rows (plait.train.documents): "documents", packed into windows, each attending to
    itself only, positions restarting where it begins; "stream", packed, attending across boundaries; "padded", one
    document per row, cut at seq_len and padded. None: "documents" for a Hugging Face model, "stream" for plait's own
    decoders and module:factory models (their attention spans documents)."""
    tokenizer: str | None = None
    """"byte" (one token per byte, vocabulary 256), or a folder holding a tokenizer.json (read locally, never
    downloaded); None: the Hugging Face model folder's tokenizer when it has one, else "byte"."""
    cache_dir: str | None = None
    """Where tokenized files are kept, keyed by the file's content and the tokenizer; None: <log.dir>/tokens."""
    batch: str | None = None
    """A per-operator run's batch factory, "package.module:function" (function(batch_size, generator) -> the
    tensors model.module's forward takes; it returns the loss): no tokens, plait.train.module_run."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with linear warm-up, then a cosine decay to `min_lr_ratio`·lr or a constant rate."""

    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup: int = 10
    """Steps of linear warm-up from lr/warmup to lr."""
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    """Final rate of the cosine schedule as a fraction of lr."""
    clip: float = 1.0
    """Clip the global gradient norm (over all shards) to this; 0 turns clipping off."""
    schedule_steps: int | None = None
    """Steps the schedule spans (warm-up, then decay to its floor); None: train.steps of the run that started it, so
    a resume with more (or fewer) train.steps keeps the schedule, and says so. Set it to re-stretch the schedule."""

    def __post_init__(self) -> None:
        if self.schedule_steps is not None and self.schedule_steps <= 0:
            raise ValueError(f"schedule_steps={self.schedule_steps} must be a positive integer (or unset)")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if self.warmup < 0 or self.clip < 0 or self.weight_decay < 0:
            raise ValueError(f"warmup={self.warmup}, clip={self.clip}, weight_decay={self.weight_decay} must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas={list(self.betas)} must be two numbers in [0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")


def lr_at(step: int, optimizer: OptimizerConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of a schedule spanning `total_steps`: linear warm-up, then
    cosine (held at its floor past `total_steps`) or constant."""
    import math

    if optimizer.warmup and step < optimizer.warmup:
        return optimizer.lr * (step + 1) / optimizer.warmup
    if optimizer.schedule == "constant":
        return optimizer.lr
    decay_steps = max(1, total_steps - optimizer.warmup)
    progress = min(1.0, (step - optimizer.warmup) / decay_steps)
    floor = optimizer.lr * optimizer.min_lr_ratio
    return floor + 0.5 * (optimizer.lr - floor) * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 100
    """Optimizer steps."""
    global_batch: int = 16
    """Sequences per step over all data-parallel ranks."""
    seq_len: int = 128
    """Tokens per sequence (at most the model's max_seq_len)."""
    seed: int = 0
    """Seeds the initial weights and the data order."""
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    """Compute dtype; None: the plan file's, or for "auto" fp32 on CPU clusters and bf16 on GPUs."""
    max_seconds: float = 0.0
    """Stop early once this much wall time has passed (0: no limit); the demo uses it."""
    document_len: int | None = None
    """Mean tokens of a packed document, for pricing attention over each document's own square (TrainSpec);
    None: `plait train` measures its data's where data.packing is "documents"."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.max_seconds < 0:
            raise ValueError(f"max_seconds={self.max_seconds} must be >= 0")

    def spec(self, default_precision: str = "fp32") -> TrainSpec:
        return TrainSpec(global_batch=self.global_batch, seq_len=self.seq_len,
                         precision=self.precision or default_precision, document_len=self.document_len)


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    file: str = "auto"
    """A plan JSON (from `plait plan --json`, or by hand), or "auto" to plan for `cluster` here."""
    cluster: str = "local-cpu"
    """Cluster preset or cluster file that "auto" plans for."""
    devices: int | None = None
    """Devices "auto" plans for; None: --nproc, else 2."""
    pins: dict[str, Any] = field(default_factory=dict)
    """Pins passed to the search with "auto", e.g. {tp = 2, schedule = "1f1b"}."""
    profile: bool = True
    """With file = "auto" and cluster = "local-cpu": plan on a quick profile of this machine instead, measured once per
    machine and rank count and cached (plait/profile/quick.py); false: plan on the preset (`--no-profile`)."""
    adapt: bool = False
    """Re-plan from the run's own timings (a straggler, a step far off its prediction) and switch plans where it
    pays, exactly as a resume does (plait/train/adapt.py); `plait train --adapt`."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    dir: str | None = None
    """Where checkpoints go; None: no checkpoints."""
    every: int = 0
    """Save every this many steps (and at the end); 0: only at the end."""
    keep: int = 3
    """Complete checkpoints kept; older ones are deleted."""
    resume: bool = False
    """Continue from the newest complete checkpoint in `dir`; stop (exit 2) when there is none, unless start_over."""
    start_over: bool = False
    """With resume: when `dir` holds no usable checkpoint, start from step 0 instead of stopping. Checkpoints that
    could not be read are never overwritten: they are kept, renamed step_N.unreadable."""
    export_hf: str | None = None
    """At the end of training, write the weights as a Hugging Face folder here (safetensors, config.json, the
    tokenizer files) that `from_pretrained` loads; a Hugging Face model only. None: no export."""
    export_overwrite: bool = False
    """Let export_hf replace the weights in a folder that is not empty (refused otherwise, before training)."""
    export_adapter: str | None = None
    """With [model] lora: at the end of training, also write the adapters as peft's adapter folder here
    (adapter_config.json, adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads onto the base;
    export_hf then writes the adapters merged into the weights."""

    def __post_init__(self) -> None:
        if self.start_over and not self.resume:
            raise ValueError("start_over=true applies when resuming: set resume=true too (--resume --start-over)")
        if self.every < 0 or self.keep < 0:
            raise ValueError(f"every={self.every} and keep={self.keep} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    dir: str = "runs/train"
    """Gets metrics.jsonl, plan.json, loss.png (and model.pt with save_model)."""
    every: int = 10
    """Print a line every this many steps when the output is not a terminal."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    save_model: bool = False
    """Write the final weights as one full state dict, model.pt (what `plait demo` samples from)."""
    tensorboard: bool = False
    """Also write TensorBoard event files (torch's SummaryWriter) to <dir>/tensorboard: every metrics.jsonl field,
    the validation loss, and the plan and config as text. Needs the `tensorboard` extra."""
    wandb: Literal["off", "offline", "online"] = "off"
    """Also log to Weights & Biases: "offline" (a run folder under <dir>/wandb, `wandb sync` uploads it later) or
    "online"; the same fields, with the plan and config as the run's config. Needs the `wandb` extra."""
    wandb_project: str = "plait"
    """The W&B project the run is filed under."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Validation: the loss on held-out tokens, evaluated under the run's own plan (forward only; a pipeline runs
    its schedule's forward-only path), logged to every sink (eval.jsonl, TensorBoard's and W&B's val/loss)."""

    every: int = 0
    """Evaluate every this many steps (and after the last); 0: no validation."""
    fraction: float = 0.0
    """Hold out this tail fraction of the [data] tokens (the run trains on the rest); or give `path`."""
    path: str | None = None
    """A second file of the same kind as [data] source (text, JSON lines or tokens), with the same tokenizer."""
    split: str | None = None
    """The split of a Hugging Face DatasetDict folder to validate on (e.g. "validation"): of `path`, else of
    data.path. None: `path`'s data.split."""
    batches: int = 4
    """Batches of train.global_batch sequences per evaluation (the same ones every time: losses compare)."""
    keep_best: bool = False
    """Also save a checkpoint whenever the validation loss is the lowest so far, in <checkpoint.dir>/best (one
    kept); needs checkpoint.dir."""
    batch: str | None = None
    """A per-operator run's held-out batches (data.batch set): a batch factory "package.module:function" of your
    held-out data, or data.batch's own factory, then drawn on generator seeds training never draws
    (plait.operators.batch.held_out_step). The loss is the module's own."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.batches <= 0:
            raise ValueError(f"every={self.every} must be >= 0 and batches={self.batches} > 0")
        if not 0 <= self.fraction < 1:
            raise ValueError(f"fraction={self.fraction} must lie in [0, 1), e.g. 0.05")
        if self.every and not self.fraction and not self.path and not self.split and not self.batch:
            raise ValueError(f"every={self.every} needs held-out data: set fraction (e.g. 0.05), path or split (a "
                             "per-operator run: batch)")
        if self.fraction and (self.path or self.split):
            other = f"path={self.path!r}" if self.path else f"split={self.split!r}"
            raise ValueError(f"fraction={self.fraction} and {other} are both set; keep one")


@dataclass(frozen=True, kw_only=True)
class IslandsConfig:
    """Training across islands (a plan with `islands`, docs/islands.md): the outer optimizer, the lighthouse."""

    outer_lr: float = 0.7
    """The outer SGD's learning rate on the averaged pseudo-gradient (DiLoCo's 0.7, arXiv 2311.08105)."""
    outer_momentum: float = 0.9
    """Its Nesterov momentum (DiLoCo's 0.9); 0: plain SGD (with outer_lr 1 and H = 1: synchronous training)."""
    nesterov: bool = True
    inner_steps: int = 0
    """H, the inner steps between outer steps; 0: the plan's (what `plait plan` chose)."""
    lighthouse: str = "local"
    """torchft's lighthouse: "local" (plait starts one for a local run) or host:port of one already running
    (multi-node runs: start `torchft_lighthouse` once and point every island at it)."""
    max_restarts: int = 3
    """How many times an island whose rank died is restarted to rejoin the others (which train on meanwhile)."""
    timeout_s: float = 120.0
    """How long an exchange, a quorum or a recovery may wait (for a slow peer, a lighthouse) before it is an error."""
    island: int = -1
    """Set by plait for an island's own launcher and ranks (0-based); -1: the run as a whole."""

    def __post_init__(self) -> None:
        if not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_lr={self.outer_lr} must be > 0 and outer_momentum={self.outer_momentum} in [0, 1)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 (seconds)")
        if self.inner_steps < 0 or self.max_restarts < 0:
            raise ValueError(f"inner_steps={self.inner_steps} and max_restarts={self.max_restarts} must be >= 0 "
                             "(inner_steps 0: the plan's H)")


@dataclass(frozen=True, kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    islands: IslandsConfig = field(default_factory=IslandsConfig)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


# ---- reading --------------------------------------------------------------------------
INPUT_PATHS = (("model", "file"), ("model", "path"), ("data", "path"), ("data", "tokenizer"), ("plan", "file"),
               ("plan", "cluster"), ("eval", "path"))
"""Keys naming files the run reads. A relative one is looked up next to the config file first, then in the working
directory (where the examples' paths, written from the repository root, are); outputs (log.dir, checkpoint.dir,
...) and --set values stay relative to the working directory."""
INPUT_WORDS = {("plan", "file"): ("auto",), ("data", "tokenizer"): ("byte",)}
"""Values of an input key that are words, not paths: never looked up next to the config file (examples/operators is a
folder, and `file = "auto"` in examples/hf-finetune.toml still means "plan here")."""


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a TOML config (None: all defaults) and apply ``section.key=value`` overrides."""
    data = read_toml(Path(path)) if path is not None else {}
    if path is not None:
        resolve_inputs(data, Path(path).parent)
    for item in overrides:
        apply_override(data, item)
    return config_from_dict(data)


def resolve_inputs(data: dict[str, Any], folder: Path) -> None:
    """Point relative input paths that exist next to the config file there (see INPUT_PATHS)."""
    for section, key in INPUT_PATHS:
        table = data.get(section)
        value = table.get(key) if isinstance(table, dict) else None
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            continue
        if value in INPUT_WORDS.get((section, key), ()) or _is_preset(section, key, value):
            continue
        beside = folder / value
        if folder != Path(".") and beside.exists():
            table[key] = str(beside)


def _is_preset(section: str, key: str, value: str) -> bool:
    """A cluster preset's name is a word too (the loader takes presets before files)."""
    if (section, key) != ("plan", "cluster"):
        return False
    from plait.spec.clusters import CLUSTER_PRESETS

    return value in CLUSTER_PRESETS


def read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a TOML file (see examples/*.toml)")
    from plait.inputs import read_text

    text = read_text(path, "config file", allow_empty=True)  # an empty config is all defaults
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None


def config_from_dict(data: dict[str, Any]) -> Config:
    return from_dict(Config, data, "config")


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set ``section.key=value`` in the raw dict; the dataclasses then check the key and type."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.steps=20")
    section = _section_class(parts[0], item)
    allowed = {f.name for f in dataclasses.fields(section)}
    if parts[1] not in allowed:
        raise ConfigError(f"override {item!r}: unknown key {parts[0]}.{parts[1]}; "
                          f"known keys: {', '.join(sorted(allowed))}")
    table = data
    for part in parts[:-1]:
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError(f"override {item!r}: {part} is not a table")
    table[parts[-1]] = parse_value(text.strip())


def _section_class(name: str, item: str) -> type:
    sections = {f.name: f.default_factory for f in dataclasses.fields(Config)}
    if name not in sections:
        raise ConfigError(f"override {item!r}: unknown section {name!r}; known sections: {', '.join(sections)}")
    return sections[name]


def parse_value(text: str) -> Any:
    """A TOML value (number, bool, string, list, inline table), else the bare text as a string."""
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


# ---- writing --------------------------------------------------------------------------
def dump_toml(config: Config) -> str:
    """The config as TOML that `load_config` reads back (None values are left out: they are defaults)."""
    return toml_text(config.to_dict())


def toml_text(sections: dict[str, dict[str, Any]]) -> str:
    """Tables of key -> value as a TOML config file, written by tomli-w (None values are left out: they are
    defaults; TOML has no null)."""
    import tomli_w

    return tomli_w.dumps(_without_none(sections))


def toml_value(value: Any) -> str:
    """One value as TOML text, as an override `section.key=value` takes it."""
    import tomli_w

    return tomli_w.dumps({"v": _without_none(value)}).partition("=")[2].strip()


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_without_none(v) for v in value]
    return value
