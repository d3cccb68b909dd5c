"""Checkpoints: atomic, verified, layout-independent; exact resume and resharding to another plan.

A checkpoint is a directory ``<dir>/step_000100/`` holding

* the ``torch.distributed.checkpoint`` (DCP) files of the model and optimizer state, saved as
  sharded DTensors / replicated tensors keyed like the single-process model
  (``layers.3.attn.wq.weight``), so any plan -- another dp/tp/pp layout, another world
  size -- can load it (DCP reads each rank's slice of each saved tensor);
* ``meta.json``: step, tokens, data-loader position, world size, and the plan (with its model
  spec) and config that produced it, and the steps the learning-rate schedule spans. The learning rate is a pure
  function of the step, that span and the [optimizer] config (plait.train.config.lr_at), so the step *is* the
  scheduler state: a resume with another train.steps keeps the span (schedule_span), and says so;
* ``rng/rank_00000.pt``: torch / python / numpy random states of each rank, as plain tensors, lists and
  numbers (read back with ``weights_only=True``: nothing in it is unpickled);
* ``MANIFEST.json``: size and SHA-256 of every file above, written last.

Saving is atomic: everything goes to ``step_000100.tmp/``, is fsynced, the manifest is written
and fsynced, and only then the directory is renamed to ``step_000100/`` (a rename is atomic
on POSIX file systems). A crash mid-save leaves a ``.tmp`` directory that is never read (and is
removed by the next save); the previous complete checkpoint is untouched. The last `keep`
complete checkpoints are kept.

On resume every candidate is verified against its manifest, newest first; a corrupt or
incomplete one (missing or truncated file, bad checksum, unreadable manifest) is named in a
warning and the previous complete one is used instead. A checkpoint that could not be read is
never overwritten or deleted: before the run goes on past it, it is renamed ``step_N.unreadable``.
A resume that finds no usable checkpoint at all stops (exit 2, nothing changed) unless
``checkpoint.start_over`` asks to start from step 0.

The module top imports no torch: the launcher uses the store functions (`latest_complete`,
`check_fresh_dir`) before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.errors import ConfigError
from plait.spec.model import NOT_THE_MODULE
from plait.runtime.faults import maybe_inject, planned_fault

MANIFEST = "MANIFEST.json"
META = "meta.json"
RNG_DIR = "rng"
FORMAT_VERSION = 2
"""2: the random-state files hold plain data (read with weights_only=True); 1 pickled numpy objects."""
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
UNREADABLE = ".unreadable"
"""Suffix of a checkpoint a resume could not read, kept for the user (plait reads and deletes none of them)."""
_CHUNK = 1 << 20


# ---- the store: directories, manifests, verification (no torch) ---------------------------
def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}.tmp"


def complete_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every published checkpoint directory (not verified), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(directory: Path, step: int) -> dict[str, Any]:
    """Fsync every file under `directory`, then write and fsync MANIFEST.json listing them."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        _fsync_file(path)
        files[path.relative_to(directory).as_posix()] = {"size": path.stat().st_size, "sha256": sha256_of(path)}
    for sub in sorted({p.parent for p in directory.rglob("*")} | {directory}):
        _fsync_dir(sub)
    manifest = {"format": FORMAT_VERSION, "step": step, "files": files}
    _write_synced(directory / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    _fsync_dir(directory)
    return manifest


def verify(directory: Path) -> str | None:
    """None if `directory` is a complete checkpoint matching its manifest, else what is wrong."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except FileNotFoundError:
        return f"{MANIFEST} is missing (an incomplete save)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    if not isinstance(files, dict) or META not in files or ".metadata" not in files:
        return f"{MANIFEST} does not list {META} and the DCP .metadata"
    if _STEP_DIR.match(directory.name) and int(_STEP_DIR.match(directory.name).group(1)) != step:
        return f"{MANIFEST} is for step {step}, not this directory's"
    for name, entry in files.items():
        problem = _file_problem(directory / name, entry)
        if problem:
            return f"file {name}: {problem}"
    return None


def _file_problem(path: Path, entry: dict[str, Any]) -> str | None:
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry.get("size"):
        return f"{size} bytes, the manifest says {entry.get('size')} (truncated or overwritten)"
    if sha256_of(path) != entry.get("sha256"):
        return "checksum differs from the manifest (corrupted)"
    return None


@dataclass(frozen=True, kw_only=True)
class Found:
    """The newest complete checkpoint (None if there is none) and the newer ones that were refused."""

    path: Path | None
    step: int
    refused: tuple[tuple[Path, str], ...] = ()

    def warnings(self) -> list[str]:
        fallback = f"falling back to {self.path.name}" if self.path else "no complete checkpoint is left"
        return [f"checkpoint {p} is not usable: {why}; {fallback}" for p, why in self.refused]

    def nothing_usable(self, root: str | Path) -> str:
        """Why a resume cannot start here, in one line, with what to do."""
        unfinished = sorted(p.name for p in Path(root).glob("step_*.tmp")) if Path(root).is_dir() else []
        if self.refused:
            names = ", ".join(p.name for p, _ in self.refused)
            held = f"holds {len(self.refused)} checkpoint(s), none usable ({names}; see the warnings above)"
        elif unfinished:
            held = f"holds only unfinished saves ({', '.join(unfinished)}), nothing complete"
        elif Path(root).is_dir():
            held = "holds no checkpoint"
        else:
            held = "does not exist"
        return (f"cannot resume: checkpoint.dir {str(root)!r} {held}; nothing was changed. Point checkpoint.dir "
                f"at the right folder, or pass --start-over (checkpoint.start_over=true) to start from step 0 "
                f"(unreadable checkpoints are kept, renamed *{UNREADABLE})")


def latest_complete(root: str | Path) -> Found:
    """The newest checkpoint under `root` that verifies, newest first; the refused ones with reasons."""
    refused = []
    for step, path in reversed(complete_dirs(Path(root))):
        problem = verify(path)
        if problem is None:
            return Found(path=path, step=step, refused=tuple(refused))
        refused.append((path, problem))
    return Found(path=None, step=0, refused=tuple(refused))


def check_fresh_dir(root: str | Path) -> None:
    """A run that does not resume must not mix its checkpoints with an earlier run's."""
    existing = complete_dirs(Path(root))
    if existing:
        raise ConfigError(
            f"checkpoint.dir {str(root)!r} already holds checkpoints (latest {existing[-1][1].name}); "
            f"pass --resume (checkpoint.resume=true) to continue from it, or choose another checkpoint.dir"
        )


def exports_here(config: Any) -> bool:
    """Whether a resuming run's checkpoints were saved by a run exporting to this config's export_hf folder: the
    folder then holds that run's own export, which this run may replace (without checkpoint.export_overwrite)."""
    ckpt = config.checkpoint
    if not (ckpt.resume and ckpt.dir and ckpt.export_hf):
        return False
    wanted = Path(ckpt.export_hf).expanduser().resolve()
    for _, path in reversed(complete_dirs(Path(ckpt.dir))):
        try:
            saved = read_meta(path).get("config", {}).get("checkpoint", {}).get("export_hf")
        except (OSError, ValueError):
            continue  # a damaged checkpoint says nothing; an older one may
        return saved is not None and Path(saved).expanduser().resolve() == wanted
    return False


def clear_checkpoints(root: str | Path) -> list[Path]:
    """`plait train --fresh`: remove what earlier runs saved under `root` -- checkpoints (step_N), unfinished saves
    (.tmp), set-aside unreadable ones and the best checkpoint (best/) -- and nothing else; returns what went."""
    root = Path(root)
    if not root.is_dir():
        return []
    doomed = sorted(p for p in root.iterdir() if p.is_dir() and (p.name.startswith("step_") or p.name == "best"))
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def plan_for_launch(config: Any, nproc: int | None) -> Any:
    """The plan `plait train` starts ranks with; on --resume, one for `nproc` devices if the
    configured plan needs another count (the world changed size): the checkpoint reshards to it."""
    import dataclasses

    from plait.train.resolve import resolve_plan

    if not config.checkpoint.resume or nproc is None or config.plan.file == "auto":
        return resolve_plan(config, nproc)
    configured = resolve_plan(config)
    if configured.num_devices == nproc:
        return configured
    warn(f"the configured plan needs {configured.num_devices} devices, {nproc} were asked for: "
         f"planning for {nproc} devices of {config.plan.cluster} and resharding the checkpoint")
    replanned = config.replace(plan=dataclasses.replace(config.plan, file="auto", devices=nproc))
    return resolve_plan(replanned, nproc)


def check_launch(config: Any, plan: Any = None) -> Found | None:
    """Before ranks start: refuse a non-resuming run into a used checkpoint.dir; on resume say
    which checkpoint will be loaded (and which newer ones are broken), and refuse one saved for
    another model (with `plan`) or another data order (seed, batch, sequence length)."""
    if config.checkpoint.dir is None:
        return None
    if not config.checkpoint.resume:
        check_fresh_dir(config.checkpoint.dir)
        return None
    found = latest_complete(config.checkpoint.dir)
    for message in found.warnings():
        warn(message)
    if found.path is None:
        if not config.checkpoint.start_over:
            raise ConfigError(found.nothing_usable(config.checkpoint.dir))
        warn(f"no usable checkpoint in {config.checkpoint.dir}; starting over from step 0 (checkpoint.start_over)")
        return found
    meta = read_meta(found.path)
    if plan is not None:
        check_compatible(meta, plan, found.path)
    for key in ("seed", "global_batch", "seq_len"):
        saved, wanted = meta.get("loader", {}).get(key), getattr(config.train, key)
        if saved is not None and saved != wanted:
            raise ConfigError(f"checkpoint {found.path} was saved with train.{key}={saved}, this run has "
                              f"train.{key}={wanted}; resume with train.{key}={saved} or use another checkpoint.dir")
    for rng_file in sorted((found.path / RNG_DIR).glob("*.pt")):  # refuse a planted pickle before ranks start
        read_rng_file(rng_file)
    note = schedule_note(config, meta)
    if note:
        warn(note)
    return found


def _saved_span(meta: dict[str, Any]) -> int | None:
    """The steps the checkpoint's run spanned its schedule over (its train.steps, for a checkpoint that does not
    record it)."""
    return meta.get("schedule_steps") or meta.get("config", {}).get("train", {}).get("steps")


def schedule_span(config: Any, meta: dict[str, Any]) -> int:
    """The steps a resumed run's learning-rate schedule spans: optimizer.schedule_steps when set, else the span the
    checkpoint's run used."""
    return config.optimizer.schedule_steps or _saved_span(meta) or config.train.steps


def schedule_note(config: Any, meta: dict[str, Any]) -> str | None:
    """One line when a resume's steps and the schedule it started with differ: the schedule is kept (the default) or
    re-stretched (optimizer.schedule_steps), with the learning rate of the next step under each."""
    from plait.train.config import lr_at

    opt, step, steps = config.optimizer, int(meta.get("step", 0)), config.train.steps
    saved, span = _saved_span(meta), schedule_span(config, meta)
    if saved is None or opt.schedule != "cosine" or (span == saved and steps == saved):
        return None
    kept, stretched = lr_at(step, opt, saved), lr_at(step, opt, span if span != saved else steps)
    if span == saved:
        return (f"train.steps={steps} resumes a run whose learning-rate schedule spans {saved} steps: it keeps that "
                f"schedule (lr {kept:.3g} at step {step + 1}, its floor {opt.lr * opt.min_lr_ratio:.3g} past step "
                f"{saved}); set optimizer.schedule_steps={steps} to re-stretch it over the new steps (lr "
                f"{stretched:.3g} at step {step + 1})")
    return (f"optimizer.schedule_steps={span} re-stretches the cosine schedule this run started over {saved} steps: "
            f"lr {stretched:.3g} at step {step + 1}, where the schedule it started with has {kept:.3g}")


def publish(tmp: Path, final: Path) -> None:
    """Make a finished temporary checkpoint visible under its final name (the commit point)."""
    if final.exists():  # a resume sets unreadable ones aside first; never overwrite one in any case
        set_aside(final)
    tmp.rename(final)
    _fsync_dir(final.parent)


def set_aside(path: Path) -> Path:
    """Rename a checkpoint plait could not read to `<name>.unreadable` (`.unreadable.2`, ... if taken): kept
    for the user, and out of the way of the step the run will save again."""
    target = path.with_name(path.name + UNREADABLE)
    number = 1
    while target.exists():
        number += 1
        target = path.with_name(f"{path.name}{UNREADABLE}.{number}")
    path.rename(target)
    _fsync_dir(path.parent)
    warn(f"kept the unreadable checkpoint {path.name} as {target.name} (plait will not read or delete it)")
    return target


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; returns the deleted paths."""
    dirs = [p for _, p in complete_dirs(root)]
    doomed = dirs[:-keep] if keep > 0 else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def remove_stale_tmp(root: Path) -> None:
    """Leftovers of saves that were cut short (a crash, Ctrl-C): never complete, never read, removed before the
    next save."""
    for path in root.glob("step_*.tmp"):
        shutil.rmtree(path, ignore_errors=True)


def read_meta(directory: Path) -> dict[str, Any]:
    return json.loads((directory / META).read_text())


def warn(message: str) -> None:
    print(f"plait: warning: {message}", file=sys.stderr, flush=True)


def restart_count() -> int:
    """How many times torchrun / the elastic agent has restarted this job's workers (the same on every machine)."""
    from plait.runtime.launch import restart_round

    return restart_round()


# ---- the Checkpointer the training loop calls (torch from here on) ------------------------
class Checkpointer:
    """The loop's checkpoint hooks (plait.train.hooks.CheckpointHooks) for a [checkpoint] config.

    `resume(state)` loads the newest complete checkpoint when `checkpoint.resume` is set or the
    job was restarted by torchrun after a crash; `after_step(state, final)` saves every
    `checkpoint.every` steps and at the end. Both are collective: every rank calls them."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.root = Path(config.checkpoint.dir)
        self.every = config.checkpoint.every
        self.keep = config.checkpoint.keep
        self.last_saved: int | None = None
        self.fault = planned_fault()  # PLAIT_FAULT, for crash-recovery tests (plait.runtime.faults)

    def wants_resume(self) -> bool:
        return bool(self.config.checkpoint.resume) or restart_count() > 0

    def resume(self, state: Any) -> None:
        import torch.distributed as dist

        from plait.runtime.launch import is_local_worker

        if not self.wants_resume():
            check_fresh_dir(self.root)
            return
        found = _broadcast_choice(self.root)
        if found.path is None and self.config.checkpoint.resume and not self.config.checkpoint.start_over:
            raise ConfigError(found.nothing_usable(self.root))  # every rank: the same choice, the same error
        if dist.get_rank() == 0:
            if not (is_local_worker() and restart_count() == 0):  # else the launcher has said so already
                for message in found.warnings():
                    warn(message)
            for path, _ in found.refused:  # the run will save these steps again: keep what it could not read
                set_aside(path)
        if found.path is None:
            if dist.get_rank() == 0:
                warn(f"no usable checkpoint in {self.root}; starting from step 0")
            return
        load_checkpoint(found.path, state)
        self.last_saved = state.step
        if dist.get_rank() == 0:
            print(f"plait: resumed from {found.path} (step {state.step})", file=sys.stderr, flush=True)
            note = schedule_note(self.config, read_meta(found.path))
            if note and not is_local_worker():  # a local launcher has said so before ranks started
                warn(note)

    def after_step(self, state: Any, final: bool) -> None:
        due = final or (self.every > 0 and state.step % self.every == 0)
        if due and state.step != self.last_saved:
            save_checkpoint(self.root, state, keep=self.keep, fault=self.fault)
            self.last_saved = state.step


def _broadcast_choice(root: Path) -> Found:
    """Rank 0 verifies the candidates (reading every file once); every rank loads what it chose."""
    import torch.distributed as dist

    box = [latest_complete(root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- state dicts keyed like the single-process model ----------------------------------------
def _options(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Sharded (not full) tensors: each rank writes and reads only its shards. Flattened optimizer
    # keys (state.<fqn>.exp_avg) name states by parameter, not by position, so pipeline stages and
    # ZeRO-1 shards -- each holding a different subset of parameters -- save and load independently.
    return StateDictOptions(full_state_dict=False, flatten_optimizer_state_dict=True, strict=strict)


def _saved(model: Any, name: str) -> bool:
    """Whether a checkpoint holds parameter `name`: every one, or a LoRA run's adapters alone (the frozen base is
    the run's starting weights, [model] weights, which a resume loads again before the adapters)."""
    from plait.models.lora import is_adapter

    plan = getattr(model, "plan", None)  # a per-operator run's parts carry no decoder plan, and no adapters
    return plan is None or plan.model.lora is None or is_adapter(name)


def _container(model: Any):
    """One module over this rank's stage modules (model_parts); their FQNs get an index prefix
    ("0.layers.3..."), removed again below so keys do not depend on the pipeline layout."""
    from torch import nn

    return nn.ModuleList(model.model_parts)


def _local_optimizer(optimizer: Any) -> Any:
    """ZeroRedundancyOptimizer keeps this rank's shard of AdamW states in `.optim`; its own
    state_dict() would need a consolidation onto one rank (collective, full size). Saving the
    local shard by parameter name is cheaper and reshards like any other layout."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _strip_part(fqn: str) -> str:
    return fqn.partition(".")[2]


def _optim_key(key: str, rename: dict[str, str]) -> str:
    kind, _, rest = key.partition(".")  # "state" | "param_groups", then "<part>.<fqn>.<name>"
    fqn, _, name = rest.rpartition(".")
    return f"{kind}.{rename[fqn]}.{name}"


def _plain_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """{"model": ..., "optim": ...} keyed by single-process names (and "tables": the fused embedding tables'
    optimizer states, plait.execute.embedding_tables), and the map back to this layout's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    container = _container(model)
    model_sd, optim_sd = get_state_dict(container, _local_optimizer(optimizer), options=_options())
    to_plain = {key: _strip_part(key) for key in model_sd}
    plain = {"model": {to_plain[k]: v for k, v in model_sd.items() if _saved(model, to_plain[k])},
             "optim": {_optim_key(k, to_plain): v for k, v in optim_sd.items()}}
    fused = getattr(model, "fused", None)  # a per-operator run's fused tables
    tables = fused.state_dict(model.model_parts[0]) if fused is not None else {}
    if tables:
        plain["tables"] = tables
    return plain, {v: k for k, v in to_plain.items()}


def _load_plain_state(model: Any, optimizer: Any, plain: dict[str, Any], to_layout: dict[str, str]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model_sd = {to_layout[k]: v for k, v in plain["model"].items()}
    optim_sd = {_optim_key(k, to_layout): v for k, v in plain["optim"].items()}
    set_state_dict(_container(model), _local_optimizer(optimizer), model_state_dict=model_sd,
                   optim_state_dict=optim_sd, options=_options(strict=model.plan.model.lora is None))


# ---- save ---------------------------------------------------------------------------------
def save_checkpoint(root: str | Path, state: Any, *, keep: int = 0, fault: Any = None,
                    extra: Any = None) -> Path:
    """Save `state` (plait.train.hooks.TrainState) as ``root/step_NNNNNN`` atomically (collective).

    `fault` (plait.runtime.faults) may interrupt the save half-way, after the shards are written and before
    the manifest: the moment a Ctrl-C would cost the most. `extra(folder)`, where given, writes more of this
    rank's state into the checkpoint's folder before the manifest covers it (a run across islands: its outer
    optimizer, plait/train/island_loop.py)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from plait.runtime.launch import note_progress

    root = Path(root)
    rank = dist.get_rank()
    note_progress(f"the checkpoint save of step {state.step}", state.step + 0.5)
    tmp, final = tmp_dir(root, state.step), step_dir(root, state.step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(root)
        (tmp / RNG_DIR).mkdir(parents=True)
    dist.barrier()
    plain, _ = _plain_state(state.model, state.optimizer)
    dcp.save(plain, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
    _save_rng(tmp / RNG_DIR / f"rank_{rank:05d}.pt")
    if extra is not None:
        extra(tmp)
    maybe_inject(rank, state.step, fault, during_save=True)
    dist.barrier()  # every rank's files are written and fsynced
    if rank == 0:
        _write_synced(tmp / META, json.dumps(_meta(state), indent=1) + "\n")
        write_manifest(tmp, state.step)
        publish(tmp, final)
        if keep > 0:
            prune(root, keep)
    dist.barrier()  # nobody runs ahead (and maybe crashes) before the checkpoint is visible
    return final


def _meta(state: Any) -> dict[str, Any]:
    import torch.distributed as dist

    return {"format": FORMAT_VERSION, "step": state.step, "tokens": state.tokens,
            "world_size": dist.get_world_size(), "loader": state.loader.state_dict(),
            "best_val_loss": state.best_val_loss, "schedule_steps": state.schedule_span(),
            "plan": json.loads(state.plan.to_json()), "config": state.config.to_dict()}


def _save_rng(path: Path) -> None:
    with path.open("wb") as f:
        _torch().save(rng_states(), f)
        f.flush()
        os.fsync(f.fileno())


def _torch():
    import torch

    return torch


def rng_states() -> dict[str, Any]:
    """This process's torch / python / numpy random states as plain data: tensors, lists, numbers and strings
    only, so that `torch.load(weights_only=True)` reads them back without unpickling any object."""
    import random

    import numpy as np
    import torch

    version, mt_state, gauss = random.getstate()
    key, keys, pos, has_gauss, cached = np.random.get_state()
    states = {"torch": torch.get_rng_state(),
              "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64), "gauss": gauss},
              "numpy": {"key": key, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """The inverse of `rng_states`."""
    import random

    import numpy as np
    import torch

    python, numpy_state = states["python"], states["numpy"]
    torch.set_rng_state(states["torch"])
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    np.random.set_state((numpy_state["key"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# ---- load ---------------------------------------------------------------------------------
def load_checkpoint(directory: str | Path, state: Any) -> None:
    """Load a checkpoint into `state` under its current plan, whatever plan saved it (collective)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    meta = read_meta(directory)
    check_compatible(meta, state.plan, directory)
    plain, to_layout = _plain_state(state.model, state.optimizer)
    # Hyper-parameters stay this run's (from its config; the lr follows the step): a saved
    # `foreach` or `lr` must not override what this layout's optimizer needs.
    loaded = {"model": plain["model"],
              "optim": {k: v for k, v in plain["optim"].items() if not k.startswith("param_groups.")}}
    reader = dcp.FileSystemReader(str(directory))
    if "tables" in plain:  # loaded in place; a checkpoint without them (saved under another optimizer) starts them
        saved = reader.read_metadata().state_dict_metadata
        loaded["tables"] = {k: v for k, v in plain["tables"].items() if f"tables.{k}" in saved}
        if len(loaded["tables"]) < len(plain["tables"]) and dist.get_rank() == 0:
            warn(f"{directory.name} holds no optimizer state for the tables "
                 f"{', '.join(sorted(set(plain['tables']) - set(loaded['tables'])))}: they start it afresh")
    dcp.load(loaded, storage_reader=reader)
    plain["optim"].update(loaded["optim"])
    _load_plain_state(state.model, state.optimizer, plain, to_layout)
    state.loader.load_state_dict(meta["loader"])
    state.step, state.tokens = int(meta["step"]), int(meta["tokens"])
    state.schedule_steps = schedule_span(state.config, meta)
    state.best_val_loss = lowest(meta.get("best_val_loss"), best_kept_loss(directory.parent))
    same_layout = meta["world_size"] == dist.get_world_size() and _layout(meta["plan"]) == _layout(
        json.loads(state.plan.to_json()))
    if same_layout:
        _load_rng(directory / RNG_DIR / f"rank_{dist.get_rank():05d}.pt")
    elif dist.get_rank() == 0:
        # Nothing in plait's training step draws random numbers (no dropout; data order is
        # seeded by (seed, epoch)), so the losses do not depend on them; say so all the same.
        warn(f"{directory.name} was saved under another layout; random states were not restored")


def best_kept_loss(root: Path) -> float | None:
    """The validation loss of the best checkpoint kept in root/best (eval.keep_best), None when there is none: it may
    be newer than the checkpoint a run resumes from, and must not be overwritten by a worse one."""
    from plait.train.evaluate import BEST_DIR

    kept = complete_dirs(root / BEST_DIR)
    return read_meta(kept[-1][1]).get("best_val_loss") if kept else None


def lowest(*losses: float | None) -> float | None:
    known = [loss for loss in losses if loss is not None]
    return min(known) if known else None


_LAYOUT_KEYS = ("dp", "tp", "pp", "zero", "sequence_parallel", "interleave", "layers_per_stage")


def _layout(plan: dict[str, Any]) -> tuple:
    return tuple(json.dumps(plan.get(key)) for key in _LAYOUT_KEYS)


def check_compatible(meta: dict[str, Any], plan: Any, directory: Path) -> None:
    """Refuse a checkpoint of another model (its weights cannot be loaded, only mis-loaded)."""
    if not isinstance(meta.get("plan"), dict) or not isinstance(meta["plan"].get("model"), dict):
        raise ConfigError(f"checkpoint {directory}: {META} names no model; it was not written by this plait")
    # a per-operator plan's module is its factory (the rest of its spec is the plan's account: layers per stage)
    keys = ("source",) if plan.operators is not None else None
    saved = {k: v for k, v in meta["plan"]["model"].items() if k not in NOT_THE_MODULE and (keys is None or k in keys)}
    current = {k: v for k, v in json.loads(plan.to_json())["model"].items()
               if k not in NOT_THE_MODULE and (keys is None or k in keys)}
    diff = [key for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]
    if diff:
        key = diff[0]
        raise ConfigError(
            f"checkpoint {directory} holds model {meta['plan']['model'].get('name')!r} with {key}={saved.get(key)!r}, "
            f"but this run's model has {key}={current.get(key)!r}; resume with the same model or use another "
            f"checkpoint.dir"
        )


def _load_rng(path: Path) -> None:
    if path.is_file():
        set_rng_states(read_rng_file(path))


def read_rng_file(path: Path) -> dict[str, Any]:
    """A rank's random states, read with `weights_only=True`: plain data only, no object is ever unpickled, so a
    planted pickle in a shared checkpoint cannot run code on --resume (it is refused here, in one line)."""
    import pickle

    torch = _torch()
    try:
        states = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"checkpoint file {path} holds more than plain tensors and numbers ({first_line[:160]}); plait reads its "
            f"own checkpoint files without unpickling objects and refuses this one. It was tampered with or written "
            f"by a plait older than checkpoint format {FORMAT_VERSION}: resume from a checkpoint this plait wrote, "
            f"or start over in another checkpoint.dir") from None
    if not isinstance(states, dict) or not {"torch", "python", "numpy"} <= set(states):
        raise ConfigError(f"checkpoint file {path} is not a plait random-state file (keys torch, python, numpy "
                          f"expected); resume from a checkpoint this plait wrote")
    return states


# ---- Hugging Face weights: in at the start ([model] weights), out at the end ([checkpoint] export_hf) ----------
def pretrained_dir(config: Any, plan: Any) -> str | None:
    """The Hugging Face checkpoint folder a run starts from (model.weights = "pretrained"), else None (seeded)."""
    if config.model.weights != "pretrained":
        return None
    return plan.model.source.removeprefix("hf:")


def export_at_end(state: Any) -> Path | None:
    """Write the trained weights as a Hugging Face folder when [checkpoint] export_hf asks (collective), with the
    tokenizer the data was tokenized with."""
    import torch.distributed as dist

    from plait.hf.checkpoint import export_hf

    config = state.config
    tokenizer = config.data.tokenizer if config.data.tokenizer not in (None, "byte") else None
    source = state.plan.model.source.removeprefix("hf:")
    if config.checkpoint.export_adapter is not None:
        from plait.execute.lora_export import export_adapter

        folder = export_adapter(state.model, config.checkpoint.export_adapter, source, tokenizer)
        if dist.get_rank() == 0:
            print(f"plait: exported the LoRA adapters of step {state.step} to {folder} (peft's adapter folder)",
                  file=sys.stderr, flush=True)
    if config.checkpoint.export_hf is None:
        return None
    from plait.execute.lora_export import export_merged  # LoRA: the adapters merged, a plain Hugging Face folder

    write = export_hf if state.plan.model.lora is None else export_merged
    out = write(state.model, config.checkpoint.export_hf, source, tokenizer)
    if dist.get_rank() == 0:
        merged = ", LoRA adapters merged" if state.plan.model.lora is not None else ""
        print(f"plait: exported the weights of step {state.step} to {out} (Hugging Face layout{merged})",
              file=sys.stderr, flush=True)
    return out
