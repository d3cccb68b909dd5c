"""`plait train` across islands: the parent starts the islands, each island's launcher its ranks, each rank this loop.

    plait train run.toml --set plan.file=islands-plan.json        # every island on this machine
    torchrun --nproc-per-node 8 ... -m plait train run.toml --set islands.island=1 --set islands.lighthouse=HOST:PORT

Every island reads the same global batches as synchronous data parallelism over all islands would (island i's
data-parallel rank r takes the rows of rank i·dp + r), runs the plan's degrees inside, and exchanges with the
others as the plan says (plait/train/islands.py). Rank 0 of each island writes LOG_DIR/island<i>/metrics.jsonl
(loss over its rows, tokens/s of the whole run, bytes sent over the islands' link so far, whether the step was
committed) and LOG_DIR/island<i>/link.json. Checkpoints go to CHECKPOINT_DIR/island<i>: the model, the inner
optimizer, the data position and, per rank, the outer state (the weights of the last outer step and the outer
optimizer's momentum, the exchange's step count), so that --resume continues exactly.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.errors import ConfigError
from plait.runtime.launch import restart_round
from plait.plan import Plan

OUTER_DIR = "outer"


def island_config(config: Any, island: int) -> Any:
    """The config of one island: its own log and checkpoint folders."""
    log = dataclasses.replace(config.log, dir=str(Path(config.log.dir) / f"island{island}"))
    checkpoint = config.checkpoint
    if checkpoint.dir is not None:
        checkpoint = dataclasses.replace(checkpoint, dir=str(Path(checkpoint.dir) / f"island{island}"))
    return config.replace(log=log, checkpoint=checkpoint)


def with_config_h(plan: Plan, config: Any) -> Plan:
    """The plan with islands.inner_steps from the config where set (0: the plan's)."""
    h = config.islands.inner_steps
    if not h or plan.islands is None or h == plan.islands.inner_steps:
        return plan
    try:
        islands = dataclasses.replace(plan.islands, inner_steps=h)
    except ValueError as e:
        raise ConfigError(f"islands.inner_steps={h}: {e}") from None
    return plan.replace(islands=islands)


def check_island_plan(plan: Plan) -> None:
    """What the island runtime cannot run, refused before any rank starts."""
    islands = plan.islands
    if islands.precision == "int8":
        raise ConfigError("islands.precision=\"int8\" needs torchft's quantized all-reduce (triton, CUDA), which "
                          "plait's island runtime does not call yet; use \"bf16\" (half the bytes of fp32)")
    from plait.search.islands import check_fragments

    check_fragments(plan.island_plan(), islands.fragments)


# ---- the parent: start every island ----------------------------------------------------------------------
def launch_islands(config_path: str | None, config: Any, overrides: list[str], plan: Plan, *,
                   timeout_s: float | None) -> int:
    """Start the lighthouse (or check the one named) and one launcher per island; wait for them."""
    from plait.runtime.faults import check_fault
    from plait.train.islands_launch import check_lighthouse, start_islands
    from plait.train.resolve import write_plan

    check_island_plan(plan)
    check_fault(plan.num_devices, config.train.steps)
    check_lighthouse(config.islands.lighthouse)
    check_island_checkpoints(config, plan.islands.count)
    plan_path = write_plan(plan, config.log.dir).resolve()
    print(f"plait train: {plan.describe()} on {plan.islands.count} islands of {plan.island_plan().num_devices} "
          f"local processes; logs in {config.log.dir}/island<i>", file=sys.stderr, flush=True)
    base = ["train"] + ([config_path] if config_path else [])
    for item in overrides + [f'plan.file="{plan_path}"']:
        base += ["--set", item]
    with start_islands(config.islands.lighthouse) as islands:
        for island in range(plan.islands.count):
            islands.start(island, base + ["--set", f"islands.island={island}"])
        code = islands.wait(timeout_s)
    for line in island_summary(Path(config.log.dir), plan.islands.count):
        print(f"plait train: {line}", file=sys.stderr)
    if code == 0:
        print(f"plait train: islands done; metrics in {config.log.dir}/island<i>/metrics.jsonl", file=sys.stderr)
    return code


def island_summary(log_dir: Path, count: int) -> list[str]:
    """Per island: its last step and loss, what it sent over the link, and each recovery (from the step it last
    logged before it failed to its 'rejoined' event)."""
    import json

    lines = []
    for island in range(count):
        path = log_dir / f"island{island}" / "metrics.jsonl"
        if not path.is_file():
            continue
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
        steps = [r for r in records if "loss" in r]
        if not steps:
            continue
        line = (f"island {island}: step {steps[-1]['step']}, loss {steps[-1]['loss']:.4f}, "
                f"{steps[-1]['link_bytes'] / 1e6:.3g} MB sent over the link by its rank 0")
        for i, record in enumerate(records):
            if record.get("event") == "rejoined":
                before = [r for r in records[:i] if "loss" in r]
                if before:
                    line += (f"; failed after step {before[-1]['step']}, rejoined at step {record['step']} "
                             f"{record['time'] - before[-1]['time']:.1f} s later")
        lines.append(line)
    return lines


def check_island_checkpoints(config: Any, count: int) -> None:
    """Before any rank starts: a fresh run must not mix its checkpoints with an earlier one's, and --resume needs a
    complete checkpoint of every island at the same step (the islands continue together)."""
    from plait.train.checkpoint import check_fresh_dir, latest_complete

    if config.checkpoint.dir is None:
        return
    roots = [Path(island_config(config, island).checkpoint.dir) for island in range(count)]
    if not config.checkpoint.resume:
        for root in roots:
            check_fresh_dir(root)
        return
    found = [latest_complete(root) for root in roots]
    missing = [root for root, f in zip(roots, found) if f.path is None]
    if missing and not config.checkpoint.start_over:
        raise ConfigError(found[roots.index(missing[0])].nothing_usable(missing[0]))
    steps = {f.step for f in found if f.path is not None}
    if len(steps) > 1 or (missing and steps):
        raise ConfigError(f"the islands' newest complete checkpoints are at different steps "
                          f"({', '.join(f'island {i}: {f.step}' for i, f in enumerate(found))}); keep the same step "
                          f"in every {config.checkpoint.dir}/island<i> (remove the newer ones) and resume")


def island_launcher(config_path: str | None, config: Any, overrides: list[str], plan: Plan) -> int:
    """One island's launcher: its ranks, restarted after a failure so that the island rejoins the others."""
    from plait.runtime.launch import run_local

    argv = ["train"] + ([config_path] if config_path else [])
    for item in overrides:
        argv += ["--set", item]
    return run_local(plan.island_plan().num_devices, argv, max_restarts=config.islands.max_restarts)


# ---- a rank ----------------------------------------------------------------------------------------------
def run_island(config: Any, plan: Plan) -> None:
    from plait.runtime.launch import ending_together, init_distributed
    from plait.train.loop import DIST_TIMEOUT_S

    inner = plan.island_plan()
    init_distributed(inner.cluster.backend, DIST_TIMEOUT_S)
    with ending_together():
        IslandRun(island_config(config, config.islands.island), plan).train()


class IslandRun:
    """One rank of one island, from build to the last step."""

    def __init__(self, config: Any, plan: Plan) -> None:
        from plait.execute import parallelize
        from plait.train.data import BatchLoader, rank_tokens
        from plait.train.hooks import TrainState
        from plait.train.islands import IslandExchange, OuterSettings

        self.config, self.plan, self.island = config, plan, config.islands.island
        self.inner = plan.island_plan()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) \
            if self.inner.cluster.device_type == "cuda" and torch.cuda.is_available() else torch.device("cpu")
        model = parallelize(self.inner, seed=config.train.seed, device=device)
        opt = config.optimizer
        optimizer = model.make_optimizer(lr=opt.lr, weight_decay=opt.weight_decay, betas=opt.betas, eps=opt.eps)
        dp = model.mesh["dp"]
        loader = BatchLoader(rank_tokens(config, plan.model), global_batch=config.train.global_batch,
                             seq_len=config.train.seq_len, seed=config.train.seed,
                             dp_rank=self.island * dp.size() + dp.get_local_rank(),
                             dp_degree=plan.islands.count * dp.size())
        self.state = TrainState(config=config, plan=plan, model=model, optimizer=optimizer, loader=loader)
        self.device = device
        outer = OuterSettings(lr=config.islands.outer_lr, momentum=config.islands.outer_momentum,
                              nesterov=config.islands.nesterov)
        self.exchange = IslandExchange(plan, self.island, model, optimizer, outer, extra_state=self._progress,
                                       load_extra=self._load_progress, timeout_s=config.islands.timeout_s)
        self.discarded = 0
        self.started_at = time.time()
        self.rejoining = restart_round() > 0  # restarted after a failure: a peer's state comes at the first quorum
        self.log: Any = None
        self._position: dict = {}
        self._lr = 0.0
        self._save_pending = False

    # what a rejoining island takes from a peer beside the weights: where the run stands
    def _progress(self) -> dict:
        return {"step": self.state.step, "tokens": self.state.tokens, "loader": self.state.loader.state_dict()}

    def _load_progress(self, progress: dict) -> None:
        self.state.step, self.state.tokens = int(progress["step"]), int(progress["tokens"])
        self.state.loader.load_state_dict(progress["loader"])
        self.rejoining = False
        self._event("rejoined")
        if dist.get_rank() == 0:
            print(f"plait: island {self.island} rejoined at step {self.state.step}: weights, optimizer and data "
                  f"position taken from a peer, {time.time() - self.started_at:.1f} s after its ranks started",
                  file=sys.stderr, flush=True)

    def _event(self, what: str) -> None:
        if self.log is not None:
            self.log.write_record({"event": what, "step": self.state.step, "time": time.time(),
                                   "started": self.started_at, "island": self.island})

    def train(self) -> None:
        from plait.runtime.faults import maybe_inject, planned_fault
        from plait.train.metrics import MetricsLog

        config, state = self.config, self.state
        self._resume()
        # a rejoining island keeps what its first ranks logged (its steps continue from a peer's)
        log = self.log = MetricsLog(Path(config.log.dir) / "metrics.jsonl", enabled=dist.get_rank() == 0,
                                    resumed_at=state.step or (sys.maxsize if self.rejoining else 0))
        fault = planned_fault()  # PLAIT_FAULT's rank counts every island's ranks: island i's rank r is i·n + r
        global_rank = self.island * dist.get_world_size() + dist.get_rank()
        tokens_per_step = config.train.global_batch * config.train.seq_len  # every island's rows together
        began = time.perf_counter()
        while state.step < config.train.steps:
            started = time.perf_counter()
            loss, counted = self._exchange_step()
            state.optimizer.zero_grad(set_to_none=True)
            step_s = time.perf_counter() - started
            if not counted:  # a failure across islands: nobody applied this step; take the same rows again
                state.loader.load_state_dict(self._position)
                self.discarded += 1
                continue
            state.step += 1
            state.tokens += tokens_per_step
            if self.rejoining and self.exchange.alone:
                if dist.get_rank() == 0:
                    print(f"plait: island {self.island} restarted, but no other island is training (they finished "
                          "or failed): nothing to rejoin", file=sys.stderr, flush=True)
                break
            if self.rejoining:  # trained blind until the quorum that heals it (DiLoCo's next exchange)
                continue
            log.write_record({"step": state.step, "loss": round(float(loss), 6), "lr": self._lr,
                              "step_time_s": round(step_s, 5), "tokens_per_s": round(tokens_per_step / step_s, 1),
                              "elapsed_s": round(time.perf_counter() - began, 3),
                              "link_bytes": self.exchange.counter.bytes_sent,
                              "outer_step": self.exchange.manager.current_step(), "island": self.island,
                              "time": time.time()})
            self._maybe_save(final=state.step == config.train.steps)
            maybe_inject(global_rank, state.step, fault)
        log.close()
        self._finish(time.perf_counter() - began)

    def _exchange_step(self) -> tuple[float, bool]:
        """One step with the exchange; a lighthouse that stopped answering becomes one clear error (the islands
        cannot agree who takes part without it), within the manager's timeout rather than a hang."""
        from plait.errors import PlaitError
        from plait.train.islands import LIGHTHOUSE_ENV, lighthouse_reachable

        try:
            clip = self.config.optimizer.clip
            return self.exchange.step(self._next_batch_forward_backward,
                                      clip=(lambda: self.state.model.clip_grad_norm_(clip)) if clip > 0 else None)
        except Exception as error:
            address = os.environ.get(LIGHTHOUSE_ENV, "")
            problem = lighthouse_reachable(address) if address else None
            if problem is None:
                raise
            raise PlaitError(f"island {self.island}: the lighthouse at {address} stopped answering mid-run "
                             f"({problem}); restart it and continue with --resume from the last checkpoint "
                             f"({type(error).__name__} in the exchange)") from None

    def _next_batch_forward_backward(self) -> float:
        """Read the step's rows (after the exchange's quorum, which may have moved the data position of an island
        that rejoined), then forward and backward."""
        from plait.train.loop import lr_at

        model = self.state.model
        self._lr = lr_at(self.state.step, self.config.optimizer, self.config.train.steps)
        for group in self.state.optimizer.param_groups:
            group["lr"] = self._lr
        self._position = self.state.loader.state_dict()
        tokens, targets = self.state.loader.next_batch()
        return model.train_step(tokens.to(self.device), targets.to(self.device))

    # ---- checkpoints ------------------------------------------------------------------------------------
    def _maybe_save(self, final: bool) -> None:
        from plait.train.checkpoint import save_checkpoint

        checkpoint = self.config.checkpoint
        if checkpoint.dir is None:
            return
        due = final or (checkpoint.every > 0 and self.state.step % checkpoint.every == 0) or self._save_pending
        # an overlapped exchange in flight cannot be saved: the save waits for the step that applies it
        self._save_pending = due and self.exchange.in_flight() and not final
        if due and not self._save_pending:
            began = time.perf_counter()
            save_checkpoint(checkpoint.dir, self.state, keep=checkpoint.keep, extra=self._save_outer)
            if self.log is not None:  # what a save stalls training: the figure failures are priced with
                self.log.write_record({"event": "saved", "step": self.state.step,
                                       "seconds": round(time.perf_counter() - began, 4), "time": time.time()})

    def _save_outer(self, folder: Path) -> None:
        (folder / OUTER_DIR).mkdir(exist_ok=True)
        torch.save(self.exchange.outer_state(), folder / OUTER_DIR / f"rank_{dist.get_rank():05d}.pt")

    def _resume(self) -> None:
        from plait.train.checkpoint import _broadcast_choice, load_checkpoint

        checkpoint = self.config.checkpoint
        if checkpoint.dir is None or not checkpoint.resume:
            return
        found = _broadcast_choice(Path(checkpoint.dir))
        if found.path is None:
            if checkpoint.start_over:
                return
            raise ConfigError(found.nothing_usable(checkpoint.dir))
        load_checkpoint(found.path, self.state)
        outer = torch.load(found.path / OUTER_DIR / f"rank_{dist.get_rank():05d}.pt", weights_only=True)
        self.exchange.load_outer_state(outer)
        if dist.get_rank() == 0:
            print(f"plait: island {self.island} resumed from {found.path} (step {self.state.step})",
                  file=sys.stderr, flush=True)

    def _finish(self, seconds: float) -> None:
        from plait.train.islands import write_link_report

        counter = self.exchange.counter
        self.exchange.close()
        totals = torch.tensor([counter.bytes_sent, counter.held_s], dtype=torch.float64)
        dist.all_reduce(totals)  # the island's ranks together: what the island sent over the link
        if dist.get_rank() == 0:
            counter.bytes_sent, counter.held_s = float(totals[0]), float(totals[1])
            write_link_report(Path(self.config.log.dir) / "link.json", counter, self.plan, self.state.step,
                              seconds)
