"""`plait train` of a per-operator plan: a module of any shape, its own batches and the loss its forward returns,
through the one launcher and loop every plan trains with (plait.commands.train, plait.train.loop): metrics sinks,
validation, time limits, restarts, resume and resharding, bf16, the end table and measured.json.

    [model] module = "dlrm:build"            # an nn.Module whose forward takes the batch and returns the loss
            path = "examples/operators"           # where to import it from
    [data]  batch = "dlrm:batch"             # batch(batch_size, generator) -> the forward's tensors
    [eval]  every = 10, batch = "dlrm:batch" # held-out batches: a factory of its own, or data.batch's own on
                                             # generator seeds training never draws
    [plan]  devices = 2, pins = {tp = 2, memory_budget = 2.3, table_optimizer = "sgd", place = {"fc.weight" = "S0"}}
            # what the pins leave free, the joint search chooses (plait.operators.search: dp x tp x pp, micro-
            # batches, ZeRO stage, recompute); pins = {pp = 2} cuts pipeline stages between the module's repeated
            # blocks, {zero = 1, recompute = "full", num_micro_batches = 4} pins the rest
            # or file = "plan.json" from `plait plan --model module:... --batch ... --json`

What a per-operator run cannot do is refused in one line before any rank starts (MODULE_RUN_KEYS says, for every
config key, whether it acts or why it is refused).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

from plait.errors import ConfigError

PLAN_PINS = ("dp", "tp", "pp", "schedule", "num_micro_batches", "zero", "recompute", "memory_budget",
             "table_optimizer", "place")
"""[plan] pins a per-operator run takes: the dp, tp and pp degrees (pp: stages cut between the module's repeated
blocks), the pipeline schedule (gpipe or 1f1b) and micro-batches per step (without a pipeline: gradients
accumulated over them), the ZeRO stage (0-3), recompute ("none" or "full": every repeated block, without a
pipeline), a per-device budget in MiB, the fused table optimizer, and placements pinned by parameter or module
name. What they leave free the joint search chooses
(plait.operators.search: every mesh shape of the devices, each solved per operator)."""

_TOKENS = "reads token data; a per-operator run draws its batches from data.batch (the factory's tensors): unset it"
ACTS = "acts"
MODULE_RUN_KEYS: dict[str, str] = {
    "model.preset": "names a preset decoder; a per-operator run trains model.module: unset it",
    "model.file": "names a model file; a per-operator run trains model.module: unset it",
    "model.module": ACTS, "model.path": ACTS,
    "model.tp_plan": "is a decoder module's tensor plan; a per-operator plan places every operator itself: pin "
                     "placements with plan.pins.place",
    "model.weights": "loads a Hugging Face checkpoint; a per-operator run starts from the module's own initial "
                     "weights (train.seed): unset it",
    **{f"data.{key}": _TOKENS for key in ("source", "path", "dtype", "text_key", "split", "chat", "tokenizer",
                                          "cache_dir")},
    "data.batch": ACTS,
    **{f"optimizer.{key}": ACTS for key in ("lr", "weight_decay", "betas", "eps", "warmup", "schedule",
                                            "min_lr_ratio", "clip")},
    "train.steps": ACTS, "train.global_batch": ACTS, "train.seed": ACTS, "train.max_seconds": ACTS,
    "train.precision": ACTS,  # bf16: CPU autocast; fp16 is refused as for every plan (no loss scaler)
    "train.seq_len": "is tokens per sequence; a per-operator run's samples are the batch factory's (their shapes "
                     "are its own): unset it",
    "plan.file": ACTS, "plan.cluster": ACTS, "plan.devices": ACTS, "plan.pins": ACTS, "plan.profile": ACTS,
    "plan.adapt": "re-plans from the decoder cost model's measured terms, which a per-operator plan is not priced "
                  "by: unset it (plan again with `plait plan --model module:...` to change plans; checkpoints "
                  "reshard on --resume)",
    "checkpoint.dir": ACTS, "checkpoint.every": ACTS, "checkpoint.keep": ACTS, "checkpoint.resume": ACTS,
    "checkpoint.start_over": ACTS,
    "checkpoint.export_hf": "writes a Hugging Face folder, which a module of your own has no class for: unset it "
                            "(log.save_model = true writes the full state dict, model.pt)",
    "checkpoint.export_overwrite": ACTS,  # what --fresh sets: lets a fresh start replace an export (none here)
    **{f"log.{key}": ACTS for key in ("dir", "every", "progress", "save_model", "tensorboard", "wandb",
                                      "wandb_project")},
    "eval.every": ACTS, "eval.batches": ACTS, "eval.keep_best": ACTS, "eval.batch": ACTS,
    "eval.fraction": "holds out a fraction of token data; a per-operator run's held-out batches come from "
                     "eval.batch: use that",
    "eval.path": "names held-out token data; a per-operator run's held-out batches come from eval.batch: use that",
    "eval.split": "names a split of held-out token data; a per-operator run's held-out batches come from eval.batch: "
                  "use that",
    "model.lora": "adds LoRA adapters to a decoder's blocks; a per-operator run trains every parameter of the "
                  "module: unset it",
    "data.packing": _TOKENS,
    "optimizer.schedule_steps": ACTS,
    "train.document_len": "is the mean document length of token data, which a per-operator run has none of: unset it",
    "checkpoint.export_adapter": "writes a peft adapter folder of a LoRA run on a Hugging Face class: unset it",
    **{f"islands.{key}": "trains across islands of a cluster, which a per-operator run does not: unset it"
       for key in ("outer_lr", "outer_momentum", "nesterov", "inner_steps", "lighthouse", "max_restarts",
                   "timeout_s", "island")},
}
"""Every config key under a per-operator run (data.batch set): ACTS, or why a value other than its default is
refused. A test walks every key of plait.train.config.Config against this table."""


def is_module_run(config: Any) -> bool:
    return config.data.batch is not None


def check_module_config(config: Any) -> None:
    """ConfigError in one line for a key a per-operator run cannot honour (MODULE_RUN_KEYS), or a per-operator key
    in a token run."""
    if not is_module_run(config):
        if config.eval.batch is not None:
            raise ConfigError(f"eval.batch = {config.eval.batch!r} is a per-operator run's held-out batch factory; "
                              f"this run trains on tokens (data.batch is unset): use eval.fraction or eval.path")
        return
    if not config.model.module:
        raise ConfigError(f"data.batch = {config.data.batch!r} trains a module that returns its loss: set model.module "
                          "= 'package.module:factory' (an nn.Module whose forward takes the batch)")
    for section in dataclasses.fields(config):
        value, default = getattr(config, section.name), section.default_factory()
        for key in dataclasses.fields(value):
            name = f"{section.name}.{key.name}"
            why = MODULE_RUN_KEYS.get(name, ACTS)
            if why != ACTS and getattr(value, key.name) != getattr(default, key.name):
                raise ConfigError(f"{name} = {getattr(value, key.name)!r} {why}")
    if config.eval.every and config.eval.batch is None:
        raise ConfigError(f"eval.every = {config.eval.every} needs held-out batches: set eval.batch (a factory of "
                          f"held-out batches, or data.batch's {config.data.batch!r} itself: drawn on seeds training "
                          f"never draws)")


def plan_module_run(config: Any, num_devices: int | None) -> Any:
    """The per-operator plan of this config: read from plan.file, or planned here for its pins and devices; with
    train.precision when the config sets one."""
    from plait.plan import Plan

    check_module_config(config)
    if config.model.path:
        from plait.train.resolve import import_path

        import_path(config.model.path)
    if config.plan.file != "auto":
        plan = Plan.from_json(config.plan.file)
        if plan.operators is None:
            raise ConfigError(f"plan.file {config.plan.file!r} has no per-operator placements; write one with "
                              "`plait plan --model module:... --batch ... --json FILE`")
        plan.operators.check_stages(plan.pp)
        from plait.models.factory import use_import_roots

        use_import_roots(plan.operators.import_paths)
        _check_plan_fits(plan, config, num_devices)
    else:
        plan = _plan_from_pins(config, num_devices)
    if config.train.precision and config.train.precision != plan.train.precision:
        plan = plan.replace(train=dataclasses.replace(plan.train, precision=config.train.precision))
    from plait.spec.train import untrainable_precision

    refusal = untrainable_precision(plan.train.precision)
    if refusal:
        raise ConfigError(f"train.{refusal}")
    return plan


def _check_plan_fits(plan: Any, config: Any, num_devices: int | None) -> None:
    source = "module:" + config.model.module.removeprefix("module:")
    if plan.model.source != source or plan.operators.batch != config.data.batch:
        raise ConfigError(f"plan.file {config.plan.file!r} is for {plan.model.source} with batches "
                          f"{plan.operators.batch!r}, the config trains {source} with {config.data.batch!r}; plan it "
                          f"with `plait plan --model {source} --batch {config.data.batch} --json FILE`")
    if plan.train.global_batch != config.train.global_batch:
        raise ConfigError(f"the plan was made for global_batch={plan.train.global_batch} but the config has "
                          f"train.global_batch={config.train.global_batch}; set it so or re-plan")
    if num_devices is not None and plan.num_devices != num_devices:
        raise ConfigError(f"the plan needs {plan.num_devices} devices ({plan.degrees.describe()}) but {num_devices} "
                          f"processes were asked for; use --nproc {plan.num_devices} or another plan")


def _plan_from_pins(config: Any, num_devices: int | None) -> Any:
    """The best plan of the joint search (plait.operators.search: every mesh shape of the devices, each solved per
    operator) under the config's pins."""
    pins = dict(config.plan.pins)
    unknown = sorted(set(pins) - set(PLAN_PINS))
    if unknown:
        raise ConfigError(f"plan.pins key {unknown[0]!r} does not apply to a per-operator run; it takes "
                          f"{', '.join(PLAN_PINS)}")
    devices = num_devices or config.plan.devices or 2
    degrees = {}
    for key in ("dp", "tp", "pp"):
        value = pins.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1 or devices % value):
            raise ConfigError(f"plan.pins {key} = {value!r} must be a whole number dividing the {devices} devices")
        degrees[key] = value
    fixed = [degrees[k] for k in degrees if degrees[k] is not None]
    if devices % math.prod(fixed):
        raise ConfigError(f"plan.pins {' x '.join(f'{k}{v}' for k, v in degrees.items() if v)} must divide the "
                          f"{devices} devices")
    zero = pins.get("zero")
    if zero is not None and (isinstance(zero, bool) or zero not in (0, 1, 2, 3)):
        raise ConfigError(f"plan.pins zero = {zero!r} must be a ZeRO stage: 0, 1, 2 or 3")
    budget = pins.get("memory_budget")
    if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
        raise ConfigError(f"plan.pins memory_budget = {budget!r} must be a positive number of MiB")
    micro_batch = _micro_batch(pins, degrees, devices, config.train.global_batch)
    from plait.operators.search import DegreePins, search
    from plait.spec.load import load_cluster

    result = search(config.model.module, config.data.batch, load_cluster(config.plan.cluster), devices=devices,
                    global_batch=config.train.global_batch,
                    degrees=DegreePins(micro_batch=micro_batch, schedule=pins.get("schedule"), zero=zero,
                                       recompute=pins.get("recompute"), **degrees),
                    pins=pins.get("place") or None, memory_limit=budget * 2**20 if budget else None,
                    table_optimizer=pins.get("table_optimizer"))
    from plait.execute.module_dryrun import runnable

    [best], failed = runnable(list(result.plans), 1)  # the best plan whose first step runs
    for reason in failed:
        print(f"plait train: note: a faster plan was left out: {reason}", file=sys.stderr, flush=True)
    return best


def _micro_batch(pins: dict, degrees: dict, devices: int, global_batch: int) -> int | None:
    """The micro-batch size pins.num_micro_batches asks for (the search takes sizes); needs dp known: pinned, or
    the devices over pinned tp and pp."""
    count = pins.get("num_micro_batches")
    if count is None:
        return None
    dp = degrees["dp"] or (devices // (degrees["tp"] * degrees["pp"]) if degrees["tp"] and degrees["pp"] else None)
    if dp is None or not isinstance(count, int) or count < 1 or global_batch % (dp * count):
        raise ConfigError(f"plan.pins num_micro_batches = {count!r} needs dp known (pin dp, or tp and pp) and "
                          f"dp x num_micro_batches dividing train.global_batch = {global_batch}")
    return global_batch // (dp * count)


def check_module_run(config: Any, plan: Any) -> None:
    """Before any rank starts: the batch factories answer (batch_size, generator) with tensors of that many rows,
    and the plan's first step builds and runs on this machine (plait.execute.module_dryrun)."""
    from plait.execute.module_dryrun import dry_run_module, refuse_off_cpu, samples_note
    from plait.operators import batch as batches

    import torch

    if config.plan.file != "auto":  # the plan file decides these: a value set beside it would go unused
        from plait.train.config import PlanConfig

        default = PlanConfig()
        for key in ("pins", "cluster"):
            if getattr(config.plan, key) != getattr(default, key):
                raise ConfigError(f"plan.{key} = {getattr(config.plan, key)!r} plans for plan.file = \"auto\"; "
                                  f"plan.file {config.plan.file!r} is a plan already: unset one of them")
        if config.plan.devices not in (None, plan.num_devices):
            raise ConfigError(f"plan.devices = {config.plan.devices} but plan.file {config.plan.file!r} is for "
                              f"{plan.num_devices} devices ({plan.degrees.describe()}); unset plan.devices or re-plan")
    refuse_off_cpu(plan)
    batches.draw(config.data.batch, plan.micro_batch, torch.Generator().manual_seed(0))
    if config.eval.every:
        batches.draw(config.eval.batch, plan.micro_batch, torch.Generator().manual_seed(0))
    if config.plan.file != "auto":  # a plan of the search was dry-run as it was chosen (_plan_from_pins)
        dry_run_module(plan)
    note = samples_note(plan)
    if note:
        print(f"plait train: note: {note}", file=sys.stderr, flush=True)


class ModuleBatches:
    """A per-operator run's data: step k's global batch drawn from the factory with a generator seeded by (seed, k)
    (plait.operators.batch.step_batch; held-out batches on negative steps), this data-parallel rank's rows of it.
    The step alone is the position, so a resume (on any plan) continues the same sequence of batches. The loop's
    BatchLoader interface: next_batch() -> the train step's arguments (here the one batch), state_dict()."""

    unanswered_windows = 0  # a token loader's chat windows without an answer: none here

    def __init__(self, source: str, *, global_batch: int, seed: int, dp_rank: int, dp_degree: int,
                 held_out: bool = False) -> None:
        self.source, self.global_batch, self.seed = source, global_batch, seed
        self.dp_rank, self.dp_degree, self.held_out = dp_rank, dp_degree, held_out
        self.step = 0
        self.steps_per_epoch = math.inf  # a factory never runs out

    def next_batch(self) -> tuple[Any]:
        import torch

        from plait.operators import batch as batches

        step = batches.held_out_step(self.step) if self.held_out else self.step
        batch = batches.step_batch(self.source, self.global_batch, self.seed, step, torch.float32)
        self.step += 1
        return (batches.split(batch, self.dp_degree, self.dp_rank),)

    def rewind(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch, "batch": self.source}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def module_loader(config: Any, plan: Any, model: Any, held_out: bool = False) -> ModuleBatches:
    dp = model.mesh["dp"]
    return ModuleBatches(config.eval.batch if held_out else config.data.batch, global_batch=config.train.global_batch,
                         seed=config.train.seed, dp_rank=dp.get_local_rank(), dp_degree=dp.size(), held_out=held_out)
