"""Train a model from a TOML config, following a plan (a file, or "auto": planned for this machine).

    plait train examples/tiny-gpt.toml                      # plan + 2 local processes
    plait train run.toml --nproc 4 --steps 50               # 4 processes, fewer steps
    plait train run.toml --set optimizer.lr=1e-3 --set plan.file=plan.json
    torchrun --nnodes 2 --nproc-per-node 8 ... -m plait train run.toml   # many machines

Outside torchrun, plait checks the config, the data and the plan here (bad input exits 2
before any rank starts), writes the plan next to the metrics, and starts one process per
device of the plan (--nproc, default: the plan's device count; for "auto", [plan] devices
or 2). Under torchrun it is one of the workers. Writes LOG_DIR/metrics.jsonl (step, loss,
lr, tokens/s, MFU, step time), LOG_DIR/loss.png, and LOG_DIR/measured.json: what every rank spent per step
by part, which the run ends by comparing with the plan's prediction (and `plait tune --from-run LOG_DIR`
fits from). With --adapt it re-plans from those timings as it goes (LOG_DIR/adapt.jsonl logs each decision).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plait.errors import ConfigError, Interrupted

# Handy flags and the config key each one sets (`--steps 20` is `--set train.steps=20`).
FLAG_KEYS: dict[str, str] = {
    "steps": "train.steps",
    "seed": "train.seed",
    "lr": "optimizer.lr",
    "plan": "plan.file",
    "log_dir": "log.dir",
    "max_seconds": "train.max_seconds",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML config file (see examples/*.toml)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="local processes to start (default: the plan's device count)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.steps=20 (repeatable)")
    parser.add_argument("--steps", type=int, help="optimizer steps (train.steps)")
    parser.add_argument("--seed", type=int, help="seed of weights and data order (train.seed)")
    parser.add_argument("--lr", type=float, help="peak learning rate (optimizer.lr)")
    parser.add_argument("--plan", help='plan JSON file, or "auto" (plan.file)')
    parser.add_argument("--log-dir", help="where metrics.jsonl, plan.json and loss.png go (log.dir)")
    parser.add_argument("--max-seconds", type=float, help="stop after this much wall time (train.max_seconds)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in checkpoint.dir (checkpoint.resume); "
                             "with another --nproc than the plan's, re-plan and reshard. Stops (exit 2) when "
                             "there is no usable checkpoint")
    parser.add_argument("--start-over", action="store_true",
                        help="--resume, but start from step 0 when checkpoint.dir holds no usable checkpoint "
                             "(checkpoint.start_over); unreadable checkpoints are kept, renamed step_N.unreadable")
    parser.add_argument("--fresh", action="store_true",
                        help="start this config over: removes the checkpoints earlier runs left in checkpoint.dir "
                             "(step_N, best/; each named as it goes) and lets export_hf replace its folder's weights "
                             "(checkpoint.export_overwrite); metrics.jsonl is rewritten as on any new run")
    parser.add_argument("--adapt", action="store_true",
                        help="re-plan from the run's own timings (a straggler rank, a step far off its prediction) and "
                             "switch to a faster plan where that pays for the switch (plan.adapt); off by default")
    parser.add_argument("--no-profile", action="store_true",
                        help="plan on the uncalibrated local-cpu preset rather than a quick profile of this machine "
                             "(plan.profile = false)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart all local ranks up to K times when one dies; they resume from the "
                             "newest checkpoint (torchrun's --max-restarts)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="kill the local run after this many seconds (default: no limit)")


def overrides_of(args: argparse.Namespace) -> list[str]:
    """--set items and the handy flags, as section.key=value strings (flags last, so they win)."""
    from plait.train.config import toml_value

    items = list(args.overrides)
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is not None:
            items.append(f"{key}={toml_value(value)}")
    if getattr(args, "resume", False) or getattr(args, "start_over", False):
        items.append("checkpoint.resume=true")
    if getattr(args, "start_over", False):
        items.append("checkpoint.start_over=true")
    if getattr(args, "adapt", False):
        items.append("plan.adapt=true")
    if getattr(args, "fresh", False):
        items.append("checkpoint.export_overwrite=true")
    if getattr(args, "no_profile", False):
        items.append("plan.profile=false")
    return items


def main(args: argparse.Namespace) -> int:
    from plait.runtime.launch import in_torchrun
    from plait.train.config import load_config

    overrides = overrides_of(args)
    config = load_config(args.config, overrides)
    if args.fresh:
        start_fresh(config, resuming=args.resume or args.start_over, under_torchrun=in_torchrun())
    from plait.train.module_run import check_module_config

    check_module_config(config)  # what a per-operator run cannot honour, before anything is started
    if config.islands.island >= 0:  # one island of a run across islands (plait/train/island_loop.py)
        return _island(args.config, config, overrides)
    if in_torchrun():
        from plait.train.loop import run

        run(config)
        return 0
    config, overrides = _on_quick_profile(config, overrides, args.nproc)
    return launch(args.config, config, overrides, nproc=args.nproc, timeout_s=args.timeout,
                  max_restarts=args.max_restarts)


def _island(config_path: str, config, overrides: list[str]) -> int:
    from plait.runtime.launch import in_torchrun
    from plait.train.island_loop import island_launcher, run_island, with_config_h
    from plait.train.resolve import resolve_plan

    plan = with_config_h(resolve_plan(config), config)
    if plan.islands is None:
        raise ConfigError(f"islands.island={config.islands.island} is set, but the plan has no islands; plan with a "
                          "cluster file that has `islands:` (docs/islands.md)")
    if not 0 <= config.islands.island < plan.islands.count:
        raise ConfigError(f"islands.island={config.islands.island} must lie in [0, {plan.islands.count}) for the "
                          f"plan's {plan.islands.count} islands")
    if config.islands.lighthouse != "local":  # a multi-node run: every island points at the same lighthouse
        import os

        from plait.train.islands import LIGHTHOUSE_ENV, lighthouse_url
        from plait.train.islands_launch import check_lighthouse

        check_lighthouse(config.islands.lighthouse)  # one line, exit 2, before this island's ranks start
        os.environ[LIGHTHOUSE_ENV] = lighthouse_url(config.islands.lighthouse)
    if in_torchrun():
        run_island(config, plan)
        return 0
    return island_launcher(config_path, config, overrides, plan)


def _on_quick_profile(config, overrides: list[str], nproc: int | None):
    """The config and overrides planning on this machine's quick profile where the run wants one (the ranks get
    the same cluster, so a restart that re-plans plans on it too)."""
    import sys

    from plait.profile.quick import with_quick_profile
    from plait.train.config import toml_value
    from plait.train.resolve import DEFAULT_DEVICES

    devices = nproc or config.plan.devices or DEFAULT_DEVICES
    profiled = with_quick_profile(config, devices, lambda line: print(line, file=sys.stderr, flush=True))
    if profiled is config:
        return config, overrides
    return profiled, [*overrides, f"plan.cluster={toml_value(profiled.plan.cluster)}"]


def start_fresh(config, *, resuming: bool, under_torchrun: bool) -> None:
    """--fresh: clear what an earlier run of this config left in checkpoint.dir, saying what goes."""
    import sys

    from plait.errors import ConfigError
    from plait.train.checkpoint import clear_checkpoints

    if resuming:
        raise ConfigError("--fresh starts over and --resume continues: pass one of them")
    if under_torchrun:
        raise ConfigError("--fresh clears checkpoint.dir before ranks start: use it with a local `plait train` (or "
                          "empty checkpoint.dir yourself before torchrun)")
    if config.checkpoint.dir is None:
        return
    for path in clear_checkpoints(config.checkpoint.dir):
        print(f"plait train: --fresh removed {path}", file=sys.stderr)


def launch(config_path: str | None, config, overrides: list[str], *, nproc: int | None,
           timeout_s: float | None, max_restarts: int = 0) -> int:
    """Check everything here, then run `plait train` on the plan's ranks; returns their exit code."""
    from rich.console import Console

    from plait.runtime.launch import run_local
    from plait.profile.quick import uncalibrated_note
    from plait.train.checkpoint import check_launch, plan_for_launch
    from plait.runtime.faults import check_fault
    from plait.train.hooks import checkpointer_class
    from plait.train.documents import check_packing, with_document_len
    from plait.train.module_run import check_module_run, is_module_run
    from plait.train.resolve import check_data, check_devices, check_outputs, resolve_model, write_plan

    check_outputs(config)  # log.dir, checkpoint.dir: before anything is planned or started
    checkpointer_class(config)  # refuses e.g. resume without a checkpoint dir, before ranks start
    if not is_module_run(config):  # a decoder's data documents, which the plan prices
        config = with_document_len(config, resolve_model(config.model))
    plan = plan_for_launch(config, nproc)  # resolve_plan, or a new plan when resuming on another world size
    if plan.islands is not None:  # every island on this machine, each a torchft replica group
        from plait.extras import require
        from plait.train.island_loop import launch_islands, with_config_h

        require("islands", f"a plan across {plan.islands.count} islands", "plan for one island")

        check_data(config, resolve_model(config.model))
        return launch_islands(config_path, config, overrides, with_config_h(plan, config), timeout_s=timeout_s)
    check_devices(plan)
    check_launch(config, plan)
    check_fault(plan.num_devices, config.train.steps)
    if is_module_run(config):  # its batch factories, and the plan's first step dry-run here
        check_module_run(config, plan)
    else:
        check_data(config, resolve_model(config.model))
        check_packing(config, plan)
    plan_path = write_plan(plan, config.log.dir).resolve()
    console = Console(stderr=True)
    placed = f" per operator ({plan.operators.describe()})" if plan.operators is not None else ""
    console.print(f"[bold]plait train[/]: {plan.describe()}{placed} on {plan.num_devices} local processes; "
                  f"logs in {config.log.dir}", highlight=False, soft_wrap=True)
    note = uncalibrated_note(plan)
    if note:
        console.print(note, highlight=False, soft_wrap=True)
    if plan.operators is not None and plan.operators.replicated_ops:  # priced so, named here
        ops = plan.operators.replicated_ops
        console.print(f"plait train: note: {len(ops)} operator(s) have no DTensor rule and run replicated, as priced: "
                      f"{', '.join(ops[:6])}{', ...' if len(ops) > 6 else ''} (add a rule with register_sharding)",
                      highlight=False, soft_wrap=True)
    argv = ["train"] + ([config_path] if config_path else [])
    for item in overrides + [f'plan.file="{plan_path}"']:
        argv += ["--set", item]
    try:
        code = run_local(plan.num_devices, argv, timeout_s=timeout_s, max_restarts=max_restarts)
    except KeyboardInterrupt:
        raise Interrupted(_where_to_resume(config)) from None
    if code == 0:
        _print_outputs(console, Path(config.log.dir))
    else:
        console.print(f"[red]plait train: the run failed (exit code {code}); see the rank output above", highlight=False)
    return code


def _where_to_resume(config) -> str:
    """What Ctrl-C left: the newest complete checkpoint (an unfinished save is never read)."""
    if config.checkpoint.dir is None:
        return "no checkpoints (checkpoint.dir is unset)"
    from plait.train.checkpoint import complete_dirs

    saved = complete_dirs(Path(config.checkpoint.dir))
    if not saved:
        return f"no complete checkpoint in {config.checkpoint.dir} yet"
    return f"the last complete checkpoint is {saved[-1][1]} (continue with --resume)"


def _print_outputs(console, log_dir: Path) -> None:
    for name in ("metrics.jsonl", "loss.png"):
        if (log_dir / name).exists():
            console.print(f"  {name:<14} {log_dir / name}", highlight=False)

