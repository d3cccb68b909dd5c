"""Pipeline memory bounded by what is in flight: receive buffers from a pool, sends let go once done.

torch.distributed.pipelining (2.13) allocates, at its first step, an input receive buffer and a gradient receive
buffer for every micro-batch of every stage, and keeps them for the life of the schedule; its multi-stage runtime
(interleaved, ZB-V, DualPipeV) also keeps every send it made until the step ends, and with it every stage output and
input gradient it sent. So a rank's pipeline memory grows with the number of micro-batches m (pytorch#136380; torch
PRs #193872 and #196463 allocate just in time, after 2.13). `PooledStage` keeps the schedule's receive-info records
but leaves their buffers empty: a buffer is taken from its rank's `BufferPool` when the schedule posts the receive
(``get_fwd_recv_ops`` / ``get_bwd_recv_ops``) and given back once the micro-batch's compute has consumed it: the
input after the backward (after its weight-gradient half where the backward is split: the first block's weight
gradient reads it), the gradient after the backward that takes it (after the weight half on the first stage, whose
split backward runs in full there). The pool's size is plait.cost.live_set's count over the schedule's own order,
the rule the cost model prices with. Under the multi-stage runtime the stage posts its own sends (the runtime would
post them alone, unbatched, the same way) and lets each go as soon as it is known to have arrived: gloo marks a
send complete only when waited on, and waiting on one the peer has not received yet could hang, so `SendLedger`
reads the peer's order in the schedule: once this rank holds a tensor the peer sent after it consumed ours (the
runtime has waited on that receive before computing with it), ours has arrived and its wait returns at once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from plait.torch_internals import RecvInfo

from plait.cost.live_set import LiveBuffers

_Key = tuple[tuple[int, ...], torch.dtype]


@dataclass
class BufferPool:
    """Receive buffers of one kind (stage inputs, or output gradients) for one pipeline rank's stages: at most
    `capacity` micro-batches' worth taken at once when the schedule runs as plait.cost.live_set counts it."""

    capacity: int
    free: dict[_Key, list[torch.Tensor]] = field(default_factory=dict)
    taken: int = 0
    high_water: int = 0
    """The most micro-batches' buffers taken at once (tests check it against `capacity`)."""
    overflow: int = 0
    """Takes beyond `capacity` (a schedule order the count did not foresee: served, counted, warned about once)."""

    def take(self, template: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A buffer on `device` shaped like `template` (a meta tensor): a free one, or a new one."""
        shelf = self.free.get(_key(template), [])
        tensor = shelf.pop() if shelf else torch.empty(template.shape, dtype=template.dtype, device=device)
        return tensor.requires_grad_(template.requires_grad)

    def count_taken(self) -> None:
        """One more micro-batch's buffers are out."""
        self.taken += 1
        self.high_water = max(self.high_water, self.taken)
        if self.taken > self.capacity:
            if not self.overflow:
                warnings.warn(f"pipeline receive pool: {self.taken} buffers in flight, sized for {self.capacity}",
                              stacklevel=3)
            self.overflow += 1

    def give(self, tensor: torch.Tensor) -> None:
        tensor.grad = None  # the input's gradient has been sent (or handed over); the next micro-batch starts afresh
        self.free.setdefault(_key(tensor), []).append(tensor)

    def keep(self, tensor: torch.Tensor) -> None:
        """Take in a buffer torch allocated at setup, where the pool has room for it (else it is let go)."""
        if len(self.tensors()) < self.capacity:
            self.give(tensor)

    def count_given(self) -> None:
        self.taken -= 1

    def tensors(self) -> list[torch.Tensor]:
        """The free buffers (between steps: every buffer the pool holds)."""
        return [t for shelf in self.free.values() for t in shelf]


def _key(tensor: torch.Tensor) -> _Key:
    return tuple(tensor.shape), tensor.dtype


def _template(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A meta twin of a receive buffer: its shape, dtype and requires_grad, no storage."""
    return None if tensor is None else torch.empty_like(tensor, device="meta").requires_grad_(tensor.requires_grad)


@dataclass
class RankBuffers:
    """The pools of one pipeline rank, shared by its stages."""

    inputs: BufferPool
    grads: BufferPool

    @classmethod
    def sized(cls, live: LiveBuffers) -> RankBuffers:
        return cls(inputs=BufferPool(live.inputs), grads=BufferPool(live.grads))

    def tensors(self) -> list[torch.Tensor]:
        return self.inputs.tensors() + self.grads.tensors()


_CONSUMER = {"SEND_F": ("F",), "SEND_B": ("B", "I")}
"""What consumes a send on the receiving stage: a forward its input, a backward (or its input half) its gradient."""


class SendLedger:
    """When a send of this rank is known to have arrived (module docstring): built from the schedule's whole order
    with its communication (torch's ``pipeline_order_with_comms``, every rank's), `done_by(peer, sent_index)` names
    the sends to `peer` the peer consumed before its action `sent_index` (a send to this rank)."""

    def __init__(self, orders: dict[int, list], rank_of_stage) -> None:
        self.rank_of_stage = rank_of_stage
        self.consumed_at: dict[int, dict[tuple[str, int, int], int]] = {}  # peer -> (kind, stage, mb) -> index
        self.sent_at: dict[int, dict[tuple[str, int, int], int]] = {}
        for rank, actions in orders.items():
            consumed, sent = {}, {}
            for index, action in enumerate(_flat(actions)):
                kind = action.computation_type.name
                key = (kind, action.stage_index, action.microbatch_index)
                if kind in ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT"):
                    consumed[({"FORWARD": "F", "FULL_BACKWARD": "B"}.get(kind, "I"),) + key[1:]] = index
                elif kind in ("SEND_F", "SEND_B"):
                    sent[key] = index
            self.consumed_at[rank], self.sent_at[rank] = consumed, sent

    def consumer_index(self, send_kind: str, stage: int, mb: int) -> tuple[int, int]:
        """(peer, index in its order of the compute that consumes this rank's send `send_kind` of `stage`, `mb`)."""
        target = stage + 1 if send_kind == "SEND_F" else stage - 1
        peer = self.rank_of_stage(target)
        return peer, min(self.consumed_at[peer].get((k, target, mb), 1 << 60) for k in _CONSUMER[send_kind])

    def sent_index(self, send_kind: str, stage: int, mb: int) -> tuple[int, int]:
        """(peer, index in its order of its send `send_kind` of its `stage`, `mb`)."""
        peer = self.rank_of_stage(stage)
        return peer, self.sent_at[peer].get((send_kind, stage, mb), -1)


def _flat(actions) -> list:
    out = []
    for action in actions:
        if action is None:
            continue
        out += _flat(action.sub_actions) if action.sub_actions else [action]
    return out


class PoolMixin:
    """Receive buffers from `self.pools` and sends let go when done, for a torch PipelineStage subclass (module
    docstring). Call `use_pools` once after construction."""

    def use_pools(self, pools: RankBuffers, own_sends: bool) -> None:
        """`own_sends`: post this stage's sends here and release them as they complete (the multi-stage runtime)."""
        self.pools = pools
        self.own_sends = own_sends
        self.pending_sends: list[tuple[int, int, list[dist.Work]]] = []  # (peer, its consumer's index, works)
        self.ledger: SendLedger | None = None
        self.most_pending = 0  # the most sends held at once (tests check it does not grow with the micro-batches)
        self.templates: dict[str, tuple[torch.Tensor | None, ...]] = {}
        self.lent: dict[tuple[str, int], list[torch.Tensor]] = {}

    # ---- setup: the records without their buffers --------------------------------------------------------------
    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        if self.is_first:
            return super()._setup_forward_recv_info(num_microbatches, has_backward)
        super()._setup_forward_recv_info(1, has_backward)  # one micro-batch's buffers: the templates, and the pool's first
        first = self.args_recv_info[0]
        self.templates["inputs"] = tuple(_template(info.buffer) for info in first)
        for info in first:
            if info.buffer is not None:
                self.pools.inputs.keep(info.buffer)
        for chunk in range(num_microbatches):
            self.args_recv_info[chunk] = tuple(RecvInfo(info.input_name, info.source, None, info.tensor_meta,
                                                         is_root_arg=info.is_root_arg) for info in first)

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple[RecvInfo, ...]:
        infos = super()._create_grad_recv_info(act_send_info)  # called once per micro-batch: keep the first buffers
        if "grads" not in self.templates:
            self.templates["grads"] = tuple(_template(info.buffer) for info in infos)
            for info in infos:
                if info.buffer is not None:
                    self.pools.grads.keep(info.buffer)
        for info in infos:
            info.buffer = None
        return infos

    # ---- receives: take from the pool, give back once consumed ---------------------------------------------------
    def _lend(self, kind: str, pool: BufferPool, infos: tuple[RecvInfo, ...], chunk: int) -> None:
        lent = []
        for info, template in zip(infos, self.templates.get(kind, ())):
            if template is not None and info.buffer is None and not info.is_root_arg:
                info.buffer = pool.take(template, self.device)
                lent.append(info.buffer)
        if lent:
            self.lent[(kind, chunk)] = lent
            pool.count_taken()

    def _return(self, kind: str, pool: BufferPool, infos: tuple[RecvInfo, ...], chunk: int) -> None:
        lent = self.lent.pop((kind, chunk), None)
        if lent is None:  # handed over by a stage of this rank (the turn of a V): let it go now, not next step
            for info in infos:
                if not info.is_root_arg:
                    info.buffer = None
            return
        for info in infos:
            if any(info.buffer is t for t in lent):
                info.buffer = None
        for tensor in lent:
            pool.give(tensor)
        pool.count_given()

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        self._lend("inputs", self.pools.inputs, self.args_recv_info[fwd_chunk_id], fwd_chunk_id)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.has_backward:
            self._lend("grads", self.pools.grads, self.grad_recv_info[bwd_chunk_id], bwd_chunk_id)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def _return_inputs(self, chunk: int) -> None:
        self._return("inputs", self.pools.inputs, self.args_recv_info.get(chunk, ()), chunk)

    def _return_grads(self, chunk: int) -> None:
        self._return("grads", self.pools.grads, self.grad_recv_info.get(chunk, ()), chunk)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        if not self.is_last and self.has_backward:
            self._received("SEND_B", self.stage_index + 1, bwd_chunk_id)
        result = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                            last_backward=last_backward)
        if full_backward or not self.is_first:  # the first stage's split backward reads the gradient again in W
            self._return_grads(bwd_chunk_id)
        if full_backward:
            self._return_inputs(bwd_chunk_id)
        return result

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        result = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._return_inputs(bwd_chunk_id)
        self._return_grads(bwd_chunk_id)
        return result

    # ---- sends: let go once done ----------------------------------------------------------------------------------
    def use_ledger(self, ledger: SendLedger) -> None:
        self.ledger = ledger

    def _post(self, kind: str, chunk: int, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        if not self.own_sends or not ops or self.ledger is None:
            return ops
        peer, consumer = self.ledger.consumer_index(kind, self.stage_index, chunk)
        works = [op.op(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer) for op in ops]
        self.pending_sends.append((peer, consumer, works))
        self.most_pending = max(self.most_pending, len(self.pending_sends))
        return []

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._post("SEND_F", fwd_chunk_id, super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._post("SEND_B", bwd_chunk_id, super().get_bwd_send_ops(bwd_chunk_id))

    def _received(self, send_kind: str, stage: int, chunk: int) -> None:
        """This rank holds what `stage` (on a peer) sent for `chunk`: wait on (and so let go) every send of this stage
        that peer consumed before sending it -- arrived, so the wait returns at once."""
        if not self.pending_sends or self.ledger is None:
            return
        peer, sent = self.ledger.sent_index(send_kind, stage, chunk)
        kept = []
        for pending in self.pending_sends:
            to, consumer, works = pending
            if to == peer and consumer < sent:
                for work in works:
                    work.wait()
            else:
                kept.append(pending)
        self.pending_sends = kept

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        if not self.is_first:
            self._received("SEND_F", self.stage_index - 1, fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def wait_sends(self) -> None:
        """Wait for every send this stage posted (the step's end)."""
        for _, _, works in self.pending_sends:
            for work in works:
                work.wait()
        self.pending_sends = []
