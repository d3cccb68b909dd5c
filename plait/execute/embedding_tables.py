"""Embedding tables trained by a fused row-wise optimizer (TorchRec's manner): the lookup's backward updates the
rows it touched in place and leaves the table no gradient, so a table costs its weights alone (no dense gradient,
no optimizer state but row-wise Adagrad's one accumulator per row), split over the tensor-parallel axis as the plan
placed it. The planner prices it so (plait.cost.operators.fused_table_copies) when a plan names the table in
`operators.fused_tables`.

* "sgd": SGD without momentum or weight decay: a linear update, exact under any split (rows, columns or whole) and
  equal to one process's dense SGD on the same table.
* "rowwise_adagrad": TorchRec's and FBGEMM's EXACT_ROWWISE_ADAGRAD: the gradients of each touched row summed
  first (duplicate ids in a batch are one row's update), the row's accumulator grows by the mean square of its
  summed gradient, and the row moves by lr x gradient / (sqrt(accumulator) + eps). Under a column split each rank
  holds some columns: the row's sum of squares is all-reduced over the tensor-parallel ranks (one float a row), so
  every split updates as one process does.

A table placed table-wise ("T<rank>", plait.operators.table_wise) lives whole on one rank of the tensor-parallel
axis, its owner, as a plain tensor (the others hold no copy and no parameter: a checkpoint holds it as the owner
saves it, whole, and any plan reads it back); every rank makes the lookup's call, the owner on the table, the others on
meta, and the owner broadcasts the rows to the axis, where the ranks hold the same ids; the backward updates the
owner's rows alone (`gather_table_wise` brings the table to every rank where a whole copy is needed).

Over data-parallel ranks each rank's distinct touched rows and their summed gradients are all-gathered (the row-wise
exchange, kilobytes), padded to the most distinct rows a rank touched (one all-reduce of the counts a step, for the
tables the plan names in `distinct_exchange`, where ids repeat enough to pay for it) or to every id's row (the same
count on every rank), each scaled by 1 / dp (each rank's loss is its share's mean), so every rank applies the same
update; the table is left out of fully_shard. The accumulators are kept beside the table on each rank, placed as its rows (split
with a row split, whole otherwise), and saved in checkpoints (`state_dict`), so a resumed run, under any plan, goes on
with them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from plait.operators.solution import FUSED_OPTIMIZERS as OPTIMIZERS
from plait.torch_internals import DisableTorchFunction

ADAGRAD_EPS = 1e-8
"""Row-wise Adagrad's epsilon (FBGEMM's default)."""


class FusedTables:
    """The fused tables of one model: their learning rate (set by the training loop each step) and the
    data-parallel group whose ranks exchange their rows."""

    def __init__(self, lr: float, dp_group=None, eps: float = ADAGRAD_EPS) -> None:
        self.lr = lr
        self.dp_group = dp_group
        self.eps = eps
        self.modules: list[str] = []
        self.distinct: set[int] = set()
        """id(table module) of the tables whose data-parallel exchange sends distinct rows."""
        self.table_wise: dict[str, tuple[int, object]] = {}
        """Table module name -> (its owner's rank on the tensor-parallel axis, that axis's mesh), for tables placed
        table-wise."""
        self.optimizers: dict[int, str] = {}
        """id(table module) -> its optimizer."""
        self.accumulators: dict[int, torch.Tensor] = {}
        """id(table module) -> row-wise Adagrad's accumulator of this rank's rows (made at the first update)."""
        self.pending: dict[int, tuple] | None = None
        """While a step defers (`defer` .. `flush`): id(table module) -> (weight, module, this rank's local ids and
        gradient rows of each lookup's backward so far)."""

    def defer(self) -> None:
        """Hold the row updates of the lookups' backwards until `flush`: a step of several micro-batches (a pipeline
        schedule interleaves their forwards and backwards) then updates the rows once, from the gradients of every
        micro-batch, as one process's step over the same calls does (every forward before the backward); without
        it, a later micro-batch's forward read rows an earlier one's backward had moved."""
        self.pending = {}

    def flush(self, scale: float = 1.0) -> None:
        """Apply the held updates: per table (in the order the tables were routed), every lookup's rows at once, their
        gradients times `scale` (a pipeline schedule scales the other gradients by 1 / micro-batches after the
        backward: scale_grads)."""
        pending, self.pending = self.pending, None
        order = list(self.optimizers)
        keys = [k for k in sorted(pending or {}, key=order.index) if not _on_meta(pending[k][2])]
        ids = [torch.cat(pending[k][4]) for k in keys]
        rows = [_distinct(i, torch.cat(pending[k][5]) * scale) for i, k in zip(ids, keys)]
        slots = [len(i) for i in ids]  # every id's row: the same count on every data-parallel rank
        counted = [i for i, k in enumerate(keys) if k in self.distinct]
        if self._exchanges() and counted:  # the most distinct rows a rank touched, every such table at once
            for i, most in zip(counted, _most_rows([len(rows[i][0]) for i in counted], self.dp_group)):
                slots[i] = most
        for i, key in enumerate(keys):
            weight, module, local, placement = pending[key][:4]
            _apply_rows(weight, local, placement, *rows[i], self, module, slots[i])

    def _exchanges(self) -> bool:
        return self.dp_group is not None and dist.get_world_size(self.dp_group) > 1

    def apply(self, model: nn.Module, fused: dict[str, str], table_wise: dict[str, int] | None = None,
              mesh=None, distinct: tuple[str, ...] = ()) -> None:
        """Route every nn.Embedding whose weight `fused` names through the fused lookup; those `table_wise` names
        (weight -> owner rank on the tensor-parallel `mesh`) through the table-wise one, kept on their owner.
        `distinct`: the tables whose data-parallel exchange sends distinct rows (OperatorSharding.distinct_exchange);
        the others send every id's row."""
        table_wise = table_wise or {}
        for name, module in list(model.named_modules()):
            weight = f"{name}.weight" if name else "weight"
            if weight not in fused:
                continue
            if not isinstance(module, nn.Embedding) or fused[weight] not in OPTIMIZERS:
                raise ValueError(f"fused table {weight!r}: only nn.Embedding with {', '.join(OPTIMIZERS)} runs fused "
                                 f"(got {type(module).__name__}, {fused[weight]!r})")
            # a pooled bag (plait.models.embedding_bags) keeps its pooling: its lookup is what runs fused
            slot = "lookup" if hasattr(module, "lookup") else "forward"
            if weight in table_wise:
                self._place_table_wise(name, module, table_wise[weight], mesh, slot)
            else:
                setattr(module, slot, _fused_forward(module, self))
            self.modules.append(name)
            self.optimizers[id(module)] = fused[weight]
            if weight in distinct:
                self.distinct.add(id(module))

    def parameters(self, model: nn.Module) -> set[nn.Parameter]:
        return {w for name in self.modules if (w := model.get_submodule(name).weight) is not None}

    def _place_table_wise(self, name: str, module: nn.Embedding, owner: int, mesh, slot: str = "forward") -> None:
        self.table_wise[name] = (owner, mesh)
        setattr(module, slot, _table_wise_forward(module, self, owner, mesh))
        if mesh.get_local_rank() != owner:  # no copy here: not a parameter of this rank's module
            module.register_parameter("weight", None)

    def accumulator(self, key: int, local: torch.Tensor) -> torch.Tensor:
        """Row-wise Adagrad's accumulator of the table module `key` (id), one float a row of this rank's `local`
        rows (float32 at least: 16-bit tables; float64 in a check), zeros until its first update."""
        if key not in self.accumulators:
            dtype = torch.promote_types(local.dtype, torch.float32)
            self.accumulators[key] = torch.zeros(local.shape[0], dtype=dtype, device=local.device)
        return self.accumulators[key]

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{table weight name: row-wise Adagrad's accumulator} of the tables this rank holds, placed as their rows
        (a DTensor split by rows where the table is; whole, as the same tensor on every rank holding it, otherwise):
        a checkpoint saves and loads them in place, under any plan, as it does the weights."""
        found = {}
        for name in self.modules:
            module = model.get_submodule(name)
            weight = module.weight
            if self.optimizers[id(module)] != "rowwise_adagrad" or weight is None:
                continue
            local = weight._local_tensor if isinstance(weight, DTensor) else weight.data
            state = self.accumulator(id(module), local)
            if isinstance(weight, DTensor) and weight.placements[0] == Shard(0):
                state = DTensor.from_local(state, weight.device_mesh, [Shard(0)], run_check=False,
                                           shape=(weight.shape[0],), stride=(1,))
            found[f"{name}.weight" if name else "weight"] = state
        return found

    def gather_table_wise(self, model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
        """Collective over each table's tensor-parallel ranks: {weight name: the whole table} of every table-wise
        table, on every rank (from its owner), for what needs the whole model in one place (a check, an export)."""
        found = {}
        for name, (owner, mesh) in self.table_wise.items():
            module = model.get_submodule(name)
            held = module.weight
            table = held.detach().clone() if held is not None else torch.empty(
                module.num_embeddings, module.embedding_dim, dtype=module.anchor.dtype)
            dist.broadcast(table, group=mesh.get_group(), group_src=owner)
            found[f"{prefix}{name}.weight"] = table
        return found


def _fused_forward(module: nn.Embedding, tables: FusedTables):
    def forward(ids: torch.Tensor) -> torch.Tensor:
        return _FusedLookup.apply(ids, module.weight, module, tables)
    return forward


def _table_wise_forward(module: nn.Embedding, tables: FusedTables, owner: int, mesh):
    # a leaf every rank's lookup takes, so each rank's backward runs (its collectives are every rank's)
    weight = module.weight
    module.anchor = torch.zeros(0, dtype=weight.dtype, requires_grad=True)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        held = module.weight if module.weight is not None else module.anchor
        return _TableWiseLookup.apply(ids, held, module, tables, owner, mesh)
    return forward


class _TableWiseLookup(torch.autograd.Function):
    """The owner's lookup, its rows broadcast over the tensor-parallel axis (a replicated DTensor); backward: the
    rows' gradients made whole (a pending sum reduced) and the owner's table updated as a whole fused table's."""

    @staticmethod
    def forward(ctx, ids, held, module, tables, owner, mesh):
        if isinstance(ids, DTensor):
            ids = ids.redistribute(ids.device_mesh, [Replicate()] * ids.device_mesh.ndim).to_local()
        mine = mesh.get_local_rank() == owner
        shape = (module.num_embeddings, module.embedding_dim)
        # every rank makes the lookup's call (the plan's calls are counted by name and shapes); only the owner's
        # reads a table
        meta = torch.empty(shape, dtype=held.dtype, device="meta")
        F.embedding(ids.to("meta"), meta, module.padding_idx)  # the plan's call as capture numbered it (on meta)
        # the distinct rows the ids read, broadcast once each; every rank holds the ids and expands them
        distinct, inverse = torch.unique(ids, return_inverse=True) if ids.device.type != "meta" else (
            ids.reshape(-1), torch.arange(ids.numel(), device="meta").reshape(ids.shape))  # a dry run: shapes only
        if mine:
            with DisableTorchFunction():  # the owner's table is a plain tensor: no plan call of its own
                rows = F.embedding(distinct, held, module.padding_idx, module.max_norm, module.norm_type)
        else:
            rows = torch.empty(len(distinct), shape[1], dtype=held.dtype, device=ids.device)
        dist.broadcast(rows, group=mesh.get_group(), group_src=owner)
        ctx.save_for_backward(ids)
        ctx.module, ctx.tables, ctx.mine, ctx.held = module, tables, mine, held
        return DTensor.from_local(rows[inverse], mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        if isinstance(grad_out, DTensor):
            grad_out = grad_out.redistribute(grad_out.device_mesh, [Replicate()]).to_local()
        if ctx.mine:
            _update_rows(ctx.held, ids, grad_out, ctx.tables, ctx.module)
        return None, None, None, None, None, None


class _FusedLookup(torch.autograd.Function):
    """F.embedding forward; backward applies the table's optimizer to the touched rows of this rank's shard in
    place and returns no gradient for the table."""

    @staticmethod
    def forward(ctx, ids, weight, module, tables):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.tables, ctx.module = weight, tables, module
        return F.embedding(ids, weight, module.padding_idx, module.max_norm, module.norm_type,
                           module.scale_grad_by_freq, module.sparse)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        _update_rows(ctx.weight, ids, grad_out, ctx.tables, ctx.module)
        return None, None, None, None


def _update_rows(weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, tables: FusedTables,
                 module: nn.Module) -> None:
    """The table's optimizer on this rank's shard: all rows of its columns (split by columns), its rows (split by
    rows), or the whole table; held for FusedTables.flush while the step defers."""
    local, placement, ids, grad = _local_view(weight, ids, grad)
    ids, grad = ids.reshape(-1), grad.reshape(-1, local.shape[1])
    if tables.pending is not None:
        held = tables.pending.setdefault(id(module), (weight, module, local, placement, [], []))
        held[4].append(ids)
        held[5].append(grad)
        return
    _apply_rows(weight, local, placement, ids, grad, tables, module)


def _apply_rows(weight: torch.Tensor, local: torch.Tensor, placement, ids: torch.Tensor, grad: torch.Tensor,
                tables: FusedTables, module: nn.Module, most: int | None = None) -> None:
    """`most`: the rows each data-parallel rank sends for this table, padded (found here when not given: the most
    distinct rows a rank touched, or every id's)."""
    if _on_meta(local):
        return
    if tables._exchanges():
        if most is None and id(module) not in tables.distinct:
            most = len(ids)
        ids, grad = _exchange_rows(ids, grad, tables.dp_group, most)
        grad = grad / dist.get_world_size(tables.dp_group)  # each rank's loss is its share's mean: average
    if isinstance(placement, Shard) and placement.dim == 0:  # this rank holds rows [first, first + len)
        first = _first_row(weight)
        mine = (ids >= first) & (ids < first + local.shape[0])
        ids, grad = ids[mine] - first, grad[mine]
    with torch.no_grad():
        if tables.optimizers.get(id(module), "sgd") == "rowwise_adagrad":
            columns = weight.device_mesh.get_group(0) if isinstance(placement, Shard) and placement.dim == 1 else None
            _rowwise_adagrad(local, ids, grad, tables, id(module), columns)
        else:
            local.index_add_(0, ids, grad.to(local.dtype), alpha=-tables.lr)


def _rowwise_adagrad(local: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, tables: FusedTables, key: int,
                     columns_group) -> None:
    """Row-wise Adagrad on this rank's rows `local` (see the module docstring); `columns_group`: the ranks holding
    the row's other columns, whose sums of squares complete the row's (None: this rank holds whole rows)."""
    rows, inverse = torch.unique(ids, return_inverse=True)
    dtype = torch.promote_types(local.dtype, torch.float32)  # float32 at least (16-bit tables), float64 in a check
    summed = torch.zeros(len(rows), grad.shape[1], dtype=dtype).index_add_(0, inverse, grad.to(dtype))
    squares = summed.square().sum(dim=1)
    width = grad.shape[1]
    if columns_group is not None:
        dist.all_reduce(squares, group=columns_group)
        width *= dist.get_world_size(columns_group)
    accumulator = tables.accumulator(key, local)
    accumulator.index_add_(0, rows, squares / width)
    step = summed / (accumulator[rows].sqrt() + tables.eps)[:, None]
    local.index_add_(0, rows, step.to(local.dtype), alpha=-tables.lr)


def _local_view(weight, ids, grad):
    """(this rank's table shard, its placement, the ids in full, the gradient of this shard's columns)."""
    if not isinstance(weight, DTensor):
        return weight.data, Replicate(), ids, grad
    placement = weight.placements[0]
    mesh = weight.device_mesh
    wanted = Shard(grad.ndim - 1) if isinstance(placement, Shard) and placement.dim == 1 else Replicate()
    if isinstance(grad, DTensor):
        grad = grad.redistribute(mesh, [wanted]).to_local()
    if isinstance(ids, DTensor):
        ids = ids.redistribute(mesh, [Replicate()]).to_local()
    return weight._local_tensor, placement, ids, grad


def _first_row(weight: DTensor) -> int:
    """This rank's first row: Shard(0) splits as torch.chunk does, ceil(rows / ranks) rows a rank (the last ranks
    fewer, or none, where the rows do not divide)."""
    rows = weight.shape[0]
    ranks = weight.device_mesh.size(0)
    return min(rows, weight.device_mesh.get_local_rank(0) * -(-rows // ranks))


def _on_meta(table: torch.Tensor) -> bool:
    """A table on meta (the dry run of a module too large to build, plait.execute.module_dryrun): its rows hold no
    values to update, and torch has no meta kernel for the distinct ids an update needs."""
    return table.device.type == "meta"


def _distinct(ids: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distinct ids, each one's gradients summed)."""
    rows, inverse = torch.unique(ids, return_inverse=True)
    return rows, grad.new_zeros(len(rows), grad.shape[1]).index_add_(0, inverse, grad)


def _most_rows(counts: list[int], group) -> list[int]:
    most = torch.tensor(counts, dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return most.tolist()


def _exchange_rows(ids: torch.Tensor, grad: torch.Tensor, group, most: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every data-parallel rank's touched rows and their gradients: each rank's distinct rows, a row's gradients
    summed first (what the planner prices from the ids sample, plait.operators.id_sample), all-gathered, padded to
    `most` rows a rank (the most distinct rows a rank touched, found by an all-reduce where not given, or every
    id's; id -1, dropped after)."""
    rows, summed = _distinct(ids, grad)
    most = _most_rows([len(rows)], group)[0] if most is None else most
    pad = most - len(rows)
    rows = torch.cat([rows, rows.new_full((pad,), -1)])
    summed = torch.cat([summed, summed.new_zeros(pad, summed.shape[1])])
    rows, summed = _gather(rows, group), _gather(summed, group)
    kept = rows >= 0
    return rows[kept], summed[kept]


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    out = t.new_empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out
