"""Training across islands, one rank's side: each island is a torchft replica group running its own plan inside.

An island's ranks form their own torch.distributed world (the plan's degrees: FSDP, TP, PP inside); each rank also
holds a torchft Manager (its group rank = its rank in the island), which pairs it with the same rank of every other
island over a process group torchft reconfigures whenever an island leaves or joins (the lighthouse decides who
takes part). Two exchanges across islands (IslandPlan.method):

* "sync": after each step's backward, every rank all-reduces its gradients (its shards of them) with its peers in
  the other islands, then steps the optimizer if every island committed (torchft's fault-tolerant HSDP).
* "diloco": torchft's DiLoCo over this rank's parameters split into `fragments` runs of blocks; every
  H / fragments inner steps one fragment's pseudo-gradient is averaged across islands and an outer Nesterov SGD
  steps it (torchft.local_sgd.DiLoCo, with the exchange overlapped `overlap` steps).

What works of torchft 0.2.0 for an island of several ranks (its issue 171 says a DiLoCo worker made of several
data-parallel ranks is not native): the Manager's replica group of N ranks is native (group_rank / world_size;
group rank 0 hosts the ManagerServer, every group rank has its own cross-island process group and recovers its own
shards from the same rank of a peer), and DiLoCo over FSDP's DTensor shards works, since each rank averages only its
local shards with the same shards of the other islands. What it needs is that every island runs the same plan
(equal shards on equal ranks), which plait checks before any rank starts. So plait uses torchft as it is.

Pseudo-gradients in bf16 travel as bf16 (cast before the all-reduce, back after); int8 needs torchft's quantized
all-reduce (triton, CUDA) and is refused elsewhere before ranks start. With the cluster's islands.emulate, every
exchange is held for the time the islands' link gives it (_LinkWork below), so one machine
shows what a slow link costs.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.cost.islands import exchange_time, island_sends
from plait.errors import PlaitError
from plait.plan import Plan
from plait.torch_internals import flatten_dense_tensors, unflatten_dense_tensors

STORE_ENV = "PLAIT_ISLANDS_STORE"
"""host:port of the TCPStore plait's local launcher holds: islands wait there for each other before their first
step, so that none takes a step alone (a multi-node run has none: an island that comes late heals from a peer)."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
QUIET_ENV = {"RUST_LOG": "error", "RUST_BACKTRACE": "0"}
"""torchft's Rust side logs every quorum and commit at info level; plait reports what matters itself."""

MIX_LOCAL = 0.5
"""With an overlapped exchange, the weights after it: this much of the island's own progress during the exchange,
the rest the outer step's result (streaming DiLoCo's mixing, arXiv 2501.18512; 0 would throw the overlapped inner
steps away)."""
BUCKET_MB = 1 << 20
"""One bucket for a whole fragment: one all-reduce per exchange, as the cost model prices it."""


@dataclass(frozen=True, kw_only=True)
class OuterSettings:
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclass
class LinkCounter:
    """What crossed the islands' link from this rank: bytes (as a ring all-reduce sends them) and exchanges, and
    the seconds this rank waited for the link beyond the all-reduce itself (emulation)."""

    bytes_sent: float = 0.0
    exchanges: int = 0
    held_s: float = 0.0
    commits: list[int] = field(default_factory=list)


def quiet_torchft() -> None:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    import logging

    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.ERROR)


def lighthouse_url(address: str) -> str:
    """torchft's form of a lighthouse address: http://host:port."""
    return address if "://" in address else f"http://{address}"


def lighthouse_reachable(address: str, timeout_s: float = 5.0) -> str | None:
    """None when something listens at `address` (http://host:port or host:port), else why not."""
    target = re.sub(r"^\w+://", "", address).rstrip("/")
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=timeout_s).close()
    except ValueError:
        return f"{address!r} is not host:port"
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


class _LinkWork:
    """An all-reduce on its way over the islands' link: wait() lands it no earlier than the link allows, and
    copies a lower-precision copy back into the tensor the caller gave."""

    def __init__(self, work: Any, tensor: torch.Tensor, wire: torch.Tensor, due: float, counter: LinkCounter):
        self.work, self.tensor, self.wire, self.due, self.counter = work, tensor, wire, due, counter
        self._future = None

    def _copy_back(self, _future: Any = None) -> torch.Tensor:
        if self.wire is not self.tensor:
            self.tensor.copy_(self.wire)
        return self.tensor

    def get_future(self) -> Any:
        if self._future is None:
            self._future = self.work.get_future().then(self._copy_back)
        return self._future

    def wait(self, timeout: Any = None) -> bool:
        held = self.due - time.perf_counter()
        if held > 0:
            time.sleep(held)
            self.counter.held_s += held
        done = self.work.wait()  # torchft's work runs its callbacks' chain (ours among them) here
        if self._future is None:
            self._copy_back()
        return done


def make_manager(plan: Plan, island: int, model_state: Callable[[], dict], load_state: Callable[[dict], None],
                 counter: LinkCounter, timeout_s: float) -> Any:
    """This rank's torchft Manager, its all-reduce sending `plan.islands.precision` over the (emulated) link."""
    from plait.extras import require

    require("islands", f"a plan across {plan.islands.count} islands", "plan for one island")
    quiet_torchft()
    from torchft import Manager, ProcessGroupGloo
    from torchft.process_group import ProcessGroupNCCL

    islands, cluster = plan.islands, plan.cluster
    emulate = cluster.islands.emulate
    wire_dtype = torch.bfloat16 if islands.precision == "bf16" else None
    ranks = dist.get_world_size()
    link_free = [0.0]

    class IslandManager(Manager):
        def allreduce(self, tensor, should_quantize=False, reduce_op=None):
            from torch.distributed import ReduceOp

            wire = tensor.to(wire_dtype) if wire_dtype is not None and tensor.is_floating_point() else tensor
            work = super().allreduce(wire, reduce_op=reduce_op or ReduceOp.AVG)
            nbytes = wire.numel() * wire.element_size()
            counter.bytes_sent += island_sends(nbytes, max(1, self.num_participants()))
            counter.exchanges += 1
            due = 0.0
            if emulate:  # this rank's share of the island's exchange, queued behind its earlier ones on the link
                start = max(time.perf_counter(), link_free[0])
                link_free[0] = start + exchange_time(nbytes * ranks, cluster)
                due = link_free[0]
            return _LinkWork(work, tensor, wire, due, counter)

    backend = ProcessGroupNCCL if plan.cluster.backend == "nccl" and torch.cuda.is_available() else ProcessGroupGloo
    timeout = timedelta(seconds=timeout_s)
    host, port = _round_store(timeout)
    return IslandManager(pg=backend(timeout=timeout), load_state_dict=load_state, state_dict=model_state,
                         min_replica_size=1, use_async_quorum=False, replica_id=f"island{island}",
                         rank=dist.get_rank(), world_size=ranks, init_sync=False, timeout=timeout,
                         quorum_timeout=timeout, connect_timeout=timedelta(seconds=min(timeout_s, 30)),
                         store_addr=host, store_port=port)


_STORES: list = []  # this round's manager store, held for the life of the process


def _round_store(timeout: timedelta) -> tuple[str, int]:
    """A store of this round of the island's ranks alone, hosted by its rank 0, for torchft's Manager: the agent's
    store (MASTER_ADDR) outlives a round, and after a restart the Manager's other ranks would read the dead round's
    manager address there and wait for it (measured: 'failed to connect ... within timeout of 30s')."""
    from plait.runtime.launch import _host_name

    box: list = [None]
    if dist.get_rank() == 0:
        store = dist.TCPStore(_host_name(), 0, is_master=True, wait_for_workers=False, timeout=timeout)
        _STORES.append(store)
        box = [(_host_name(), store.port)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wait_for_islands(count: int, island: int) -> None:
    """Before the first step: every island's Manager is up (local launches only; see STORE_ENV)."""
    address = os.environ.get(STORE_ENV)
    if not address:
        return
    if dist.get_rank() == 0:
        host, _, port = address.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=300))
        store.add("islands_up", 1)
        deadline = time.monotonic() + 300
        while int(store.add("islands_up", 0)) < count:
            if time.monotonic() > deadline:
                raise PlaitError(f"island {island}: the other islands did not start within 300 s")
            time.sleep(0.05)
    dist.barrier()


def fragment_modules(named: list[tuple[str, nn.Parameter]], fragments: int) -> list[nn.Module]:
    """This rank's parameters in `fragments` runs of whole blocks (what comes before the first block joins the
    first run, what comes after a block the last): streaming DiLoCo's fragments."""
    blocks = [_block_of(name) for name, _ in named]
    ids = sorted({b for b in blocks if b is not None})
    if len(ids) < fragments:
        raise PlaitError(f"fragments={fragments} is more than the {len(ids)} blocks this rank holds")
    run_of = {block: i * fragments // len(ids) for i, block in enumerate(ids)}
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(fragments)]
    seen_block = False
    for (name, param), block in zip(named, blocks):
        seen_block = seen_block or block is not None
        run = run_of[block] if block is not None else (fragments - 1 if seen_block else 0)
        groups[run].append((name, param))
    return [_holder(group) for group in groups]


def _block_of(name: str) -> int | None:
    found = re.search(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.", name)
    return int(found.group(1)) if found else None


def _holder(group: list[tuple[str, nn.Parameter]]) -> nn.Module:
    module = nn.Module()
    for name, param in group:
        module.register_parameter(name.replace(".", "__"), param)
    return module


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class IslandExchange:
    """The exchange across islands for one rank: wraps each inner step (see the module docstring)."""

    def __init__(self, plan: Plan, island: int, model: Any, optimizer: Any, outer: OuterSettings, *,
                 extra_state: Callable[[], dict] | None = None, load_extra: Callable[[dict], None] | None = None,
                 timeout_s: float = 120.0) -> None:
        self.plan, self.island, self.model, self.optimizer = plan, island, model, optimizer
        self.islands = plan.islands
        self.counter = LinkCounter()
        self.named = list(model.named_parameters())
        self._extra_state, self._load_extra = extra_state or dict, load_extra or (lambda state: None)
        self.manager = make_manager(plan, island, self._state_dict, self._load_state_dict, self.counter, timeout_s)
        self.diloco = None
        self.outer_optimizers: list[torch.optim.Optimizer] = []
        if self.islands.method == "diloco":
            from torchft.local_sgd import DiLoCo

            fragments = fragment_modules(self.named, self.islands.fragments)
            self.outer_optimizers = [torch.optim.SGD(f.parameters(), lr=outer.lr, momentum=outer.momentum,
                                                     nesterov=outer.nesterov and outer.momentum > 0)
                                     for f in fragments]
            self.diloco = DiLoCo(self.manager, fragments, optimizer, self.outer_optimizers,
                                 sync_every=self.islands.inner_steps, fragment_sync_delay=self.islands.overlap,
                                 use_bucketization=True, bucket_cap_mb=BUCKET_MB, pin_memory=False,
                                 fragment_update_alpha=MIX_LOCAL if self.islands.overlap else 0.0)
            self.diloco.__enter__()
        wait_for_islands(self.islands.count, island)

    # ---- one inner step -------------------------------------------------------------------------
    def step(self, train_step: Callable[[], float], clip: Callable[[], Any] | None = None) -> tuple[float, bool]:
        """Run `train_step` (forward and backward) and the optimizer step with the exchange; returns the loss and
        whether the step counted (False: a failure across islands made every island skip it). `clip` clips the
        gradients the optimizer steps on: under sync the islands' average (as one cluster would), under DiLoCo each
        island's own (its inner step)."""
        if self.diloco is not None:
            before = self.manager.current_step()
            loss = train_step()
            if clip is not None:
                clip()
            self.optimizer.step()  # DiLoCo's hooks exchange a fragment when one is due
            if self.manager.current_step() != before:
                self.counter.commits.append(self.manager.current_step())
            return loss, True
        self.manager.start_quorum()
        loss = train_step()
        grads = [local(p.grad) for _, p in self.named if p.grad is not None]
        flat = flatten_dense_tensors(grads)
        self.manager.allreduce(flat).wait()
        for grad, reduced in zip(grads, unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)
        if not self.manager.should_commit():
            return loss, False
        if clip is not None:
            clip()
        self.optimizer.step()
        self.counter.commits.append(self.manager.current_step())
        return loss, True

    @property
    def alone(self) -> bool:
        """A quorum was formed and this island is its only member."""
        return self.manager._quorum_id >= 0 and self.manager.num_participants() <= 1

    def in_flight(self) -> bool:
        """An overlapped exchange was started and not yet applied (a checkpoint now could not hold it)."""
        return self.diloco is not None and any(f._allreduce_work for f in self.diloco._fragments)

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)

    # ---- what a rejoining island takes from a peer, and what a checkpoint holds ------------------
    def _state_dict(self) -> dict:
        optimizer = _plain_optimizer(self.optimizer)
        by_param = {id(p): n for n, p in self.named}
        inner = {by_param[id(p)]: {k: local(v).detach().clone() if torch.is_tensor(v) else v for k, v in s.items()}
                 for p, s in optimizer.state.items() if id(p) in by_param}
        return {"model": {n: local(p).detach().clone() for n, p in self.named}, "inner": inner,
                "extra": self._extra_state()}

    def _load_state_dict(self, state: dict) -> None:
        optimizer = _plain_optimizer(self.optimizer)
        with torch.no_grad():
            for name, param in self.named:
                local(param).copy_(state["model"][name])
            for name, param in self.named:
                saved = state["inner"].get(name)
                if saved is not None:
                    optimizer.state[param] = {k: _like(param, v) for k, v in saved.items()}
        self._load_extra(state["extra"])

    def outer_state(self) -> dict:
        """Everything beyond the model and the inner optimizer that resumes the exchange exactly: the manager's
        step, and per fragment the weights of the last outer step and the outer optimizer's momentum."""
        out: dict[str, Any] = {"manager": self.manager.state_dict()}
        if self.diloco is not None:
            out["fragments"] = [{"original": {k: v.clone() for k, v in f.original_parameters.items()},
                                 "outer": o.state_dict()}
                                for f, o in zip(self.diloco._fragments, self.outer_optimizers)]
            out["local_step"] = self.diloco._local_step
        return out

    def load_outer_state(self, state: dict) -> None:
        self.manager.load_state_dict(state["manager"])
        if self.diloco is not None:
            for f, o, saved in zip(self.diloco._fragments, self.outer_optimizers, state["fragments"]):
                for k, v in saved["original"].items():
                    f.original_parameters[k].copy_(v)
                o.load_state_dict(saved["outer"])
            self.diloco._local_step = int(state["local_step"])


def _plain_optimizer(optimizer: Any) -> Any:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _like(param: Any, value: Any) -> Any:
    """An optimizer state entry saved as a local tensor, back in the parameter's layout (a DTensor under FSDP/TP)."""
    if not torch.is_tensor(value) or value.dim() == 0 or not hasattr(param, "device_mesh"):
        return value.clone() if torch.is_tensor(value) else value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value.clone(), param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride())


def write_link_report(path: Path, counter: LinkCounter, plan: Plan, steps: int, seconds: float) -> None:
    """Rank's link figures, summed by the launcher: bytes over the link, exchanges, time held, commits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"bytes_sent": counter.bytes_sent, "exchanges": counter.exchanges,
                                "held_s": counter.held_s, "commits": counter.commits, "steps": steps,
                                "seconds": seconds, "plan": plan.describe()}))
