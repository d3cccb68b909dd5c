"""Write a plait checkpoint of a Hugging Face model as a Hugging Face folder that `from_pretrained` loads.

    plait export runs/ft/ckpt runs/ft/hf                  # the newest complete checkpoint in checkpoint.dir
    plait export runs/ft/ckpt/step_000200 runs/ft/hf      # or one step
    plait export runs/ft/ckpt out --model base/ --force   # the model folder moved; replace out's weights

The checkpoint may come from any plan: its sharded files are read in one process, a shard file's worth of
tensors at a time, and written as consolidated safetensors (several files of at most --max-shard-size, with
model.safetensors.index.json, when the model is larger), with the model's config.json (its dtype set to the
weights') and the tokenizer files: those of the tokenizer the run used ([data] tokenizer), else the model
folder's. The checkpoint's meta.json names the model folder; --model and --tokenizer override them.

A run can also export at its end: [checkpoint] export_hf = "DIR" in the training config.

A LoRA run's checkpoint holds its adapters: the export merges them into the base the run started from (a plain
Hugging Face folder), or with --adapter writes peft's adapter folder (plait.execute.lora_export).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plait.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint step folder (step_000200), or a checkpoint.dir: its newest "
                                           "complete checkpoint")
    parser.add_argument("out", help="the Hugging Face folder to write (created; must be empty without --force)")
    parser.add_argument("--model", metavar="DIR", help="the Hugging Face model folder (config.json) the run trained; "
                                                      "default: the one the checkpoint names")
    parser.add_argument("--tokenizer", metavar="DIR", help="a folder whose tokenizer files to copy; default: the "
                                                           "run's data.tokenizer folder, else the model folder's")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest safetensors file, e.g. 5GB, 500MiB (default 5GB)")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run's checkpoint: write peft's adapter folder (adapter_config.json, "
                             "adapter_model.safetensors) instead of the weights with the adapters merged")
    parser.add_argument("--force", action="store_true",
                        help="write into a folder that is not empty, replacing the weights there")


def main(args: argparse.Namespace) -> int:
    from plait.outputs import filled_dir
    from plait.spec.load import parse_bytes

    out = filled_dir(args.out, "export folder", args.force, "pass --force")
    max_bytes = int(parse_bytes(args.max_shard_size, "--max-shard-size"))
    if max_bytes <= 0:
        raise ConfigError(f"--max-shard-size {args.max_shard_size!r} must be positive")
    step_dir, meta = checkpoint_step(Path(args.checkpoint))
    model_dir, tokenizer_dir = _folders(meta, args)
    from plait.execute.lora_export import export_checkpoint_lora, is_lora_checkpoint

    if is_lora_checkpoint(meta):  # the adapters merged into the run's base, or peft's adapter folder
        export_checkpoint_lora(step_dir, out, model_dir, tokenizer_dir, meta, adapter_only=args.adapter,
                               max_shard_bytes=max_bytes)
    elif args.adapter:
        raise ConfigError(f"--adapter writes a LoRA run's adapters, but {str(step_dir)!r} is a checkpoint of a run "
                          f"without [model] lora; leave --adapter out to export its weights")
    else:
        from plait.hf.checkpoint import export_checkpoint

        export_checkpoint(step_dir, out, model_dir, tokenizer_dir, _tied(meta, model_dir), max_shard_bytes=max_bytes)
    files = sorted(p.name for p in out.iterdir())
    print(f"plait export: step {meta.get('step')} of {step_dir.parent} -> {out} ({', '.join(files)})")
    return 0


def checkpoint_step(path: Path) -> tuple[Path, dict]:
    """The verified step folder `path` names (itself, or the newest complete one under it) and its meta.json."""
    from plait.train.checkpoint import META, latest_complete, read_meta, verify, warn

    if not path.is_dir():
        raise ConfigError(f"checkpoint {str(path)!r} is not a folder; give a checkpoint.dir or one of its "
                          f"step_NNNNNN folders")
    if (path / META).is_file():
        problem = verify(path)
        if problem:
            raise ConfigError(f"checkpoint {str(path)!r} is not usable: {problem}")
        step_dir = path
    else:
        found = latest_complete(path)
        for message in found.warnings():
            warn(message)
        if found.path is None:
            raise ConfigError(f"{str(path)!r} holds no complete checkpoint; give a checkpoint.dir of `plait train` "
                              f"or one of its step_NNNNNN folders")
        step_dir = found.path
    try:
        return step_dir, read_meta(step_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {str(step_dir)!r}: meta.json cannot be read ({e})") from None


def _folders(meta: dict, args: argparse.Namespace) -> tuple[Path, Path | None]:
    """The model folder (config.json) and the tokenizer folder to copy from."""
    source = str(meta.get("plan", {}).get("model", {}).get("source", ""))
    if args.model is None and not source.startswith("hf:"):
        raise ConfigError(f"the checkpoint's model ({meta.get('plan', {}).get('model', {}).get('name')!r}) is not a "
                          f"Hugging Face model; plait export writes Hugging Face folders of models trained from one "
                          f"(model.file = a model folder)")
    model_dir = Path(args.model) if args.model else Path(source.removeprefix("hf:"))
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model folder {str(model_dir)!r} has no config.json (moved?); pass --model with the "
                          f"Hugging Face folder the run trained")
    tokenizer = args.tokenizer or meta.get("config", {}).get("data", {}).get("tokenizer")
    if tokenizer in (None, "byte"):
        return model_dir, None
    if not Path(tokenizer).is_dir():
        raise ConfigError(f"tokenizer folder {tokenizer!r} does not exist; pass --tokenizer with the folder of the "
                          f"tokenizer the run used")
    return model_dir, Path(tokenizer)


def _tied(meta: dict, model_dir: Path) -> dict[str, str]:
    """The model's tied names (output layer -> embedding), from its adapter: the alias is not written."""
    from plait.models import adapter_for
    from plait.spec import ModelSpec

    spec = ModelSpec.from_dict(meta["plan"]["model"])
    return dict(adapter_for(spec.replace(source="hf:" + str(model_dir.resolve()))).tied)
