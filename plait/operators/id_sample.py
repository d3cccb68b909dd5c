"""What a batch's ids touch of each embedding table, from a sample of the module's own batches: a few micro-batches
drawn from its batch factory on CPU before planning, the module's forward run on meta with the ids kept real, each
lookup's ids recorded (nn.Embedding and F.embedding; the rest of the forward moves to meta as it meets the model).

The planner prices by it what moves rows, as the executor moves them (plait.execute.embedding_tables): a table-wise
lookup broadcasts the distinct rows its ids read (each rank expands them by its ids), and the data-parallel
exchange of a fused table's gradients gathers each rank's distinct touched rows, their gradients summed. Skewed ids
(a few hot rows, as real traffic is) touch fewer distinct rows than they read, and the plan says which sample it
priced by (`TableSample.describe`). Without a sample (ids made from what is meta in the capture), every id is a
row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from plait.torch_internals import tree_flatten, tree_unflatten

SAMPLE_BATCHES = 4
"""Micro-batches drawn for the sample (seeds 0..3 of a generator of its own: not the training batches)."""


@dataclass(frozen=True)
class TableSample:
    source: str
    """The batch factory the ids came from."""
    batches: int
    rows: int
    """Samples per micro-batch drawn."""
    distinct: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Table weight name -> per lookup call (in forward order), the mean distinct ids a micro-batch reads."""
    touched: dict[str, float] = field(default_factory=dict)
    """Table weight name -> the mean distinct rows all its lookups of a micro-batch touch."""
    ids: dict[str, float] = field(default_factory=dict)
    """Table weight name -> ids its lookups of a micro-batch read."""
    hottest: dict[str, float] = field(default_factory=dict)
    """Table weight name -> the share of its ids that read its most read row (skew)."""

    def describe(self) -> str:
        tables = ", ".join(f"{name.removesuffix('.weight')} {self.touched[name]:.0f} of {self.ids[name]:.0f} ids "
                           f"(hottest row {self.hottest[name]:.0%})" for name in self.touched)
        return (f"rows touched per micro-batch from {self.batches} sample batches of {self.source} at "
                f"{self.rows} rows: {tables}")


class _Lookups(TorchFunctionMode):
    """Records each embedding lookup's ids (real, on CPU) by its table, answers it on meta, and moves the CPU
    tensors of any other call that meets a meta one to meta."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names
        self.calls: list[tuple[str, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and id(args[1]) in self.names and args[0].device.type != "meta":
            ids, weight = args[0], args[1]
            self.calls.append((self.names[id(weight)], ids.detach().reshape(-1).clone()))
            return torch.empty(*ids.shape, weight.shape[-1], dtype=weight.dtype, device="meta")
        flat, spec = tree_flatten((args, kwargs))
        if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in flat):
            flat = [a.to("meta") if isinstance(a, torch.Tensor) and a.device.type != "meta" else a for a in flat]
            args, kwargs = tree_unflatten(flat, spec)
        return func(*args, **kwargs)


def sample_ids(model: nn.Module, batch_source: str, rows: int, tables: set[str] | dict[str, str],
               batches: int = SAMPLE_BATCHES) -> TableSample | None:
    """The sample of `tables` (weight names) in `model` (on meta) at micro-batches of `rows`; None where no lookup of
    them read real ids (the forward stopped before, or made its ids from the model)."""
    from plait.operators import batch as batch_tools

    names = {id(p): n for n, p in model.named_parameters() if n in tables}
    if not names or rows <= 0:
        return None
    per_batch: list[list[tuple[str, torch.Tensor]]] = []
    for seed in range(batches):
        batch = batch_tools.draw(batch_source, rows, torch.Generator().manual_seed(seed))
        recorder = _Lookups(names)
        try:
            with torch.no_grad(), recorder:
                batch_tools.call(model, batch)
        except Exception:  # noqa: BLE001, S110 - a forward that cannot run half on meta: what was recorded stands
            pass
        per_batch.append(recorder.calls)
    return _summarise(per_batch, batch_source, rows) if any(per_batch) else None


def _mean(values: list) -> float:
    return sum(values) / len(values)


def _summarise(per_batch: list[list[tuple[str, torch.Tensor]]], source: str, rows: int) -> TableSample:
    distinct: dict[str, list[list[int]]] = {}
    touched: dict[str, list[int]] = {}
    ids: dict[str, list[int]] = {}
    hottest: dict[str, list[float]] = {}
    for calls in per_batch:
        by_table: dict[str, list[torch.Tensor]] = {}
        for name, read in calls:
            by_table.setdefault(name, []).append(read)
        for name, reads in by_table.items():
            distinct.setdefault(name, []).append([len(torch.unique(r)) for r in reads])
            every = torch.cat(reads)
            counts = torch.unique(every, return_counts=True)[1]
            touched.setdefault(name, []).append(len(counts))
            ids.setdefault(name, []).append(len(every))
            hottest.setdefault(name, []).append(counts.max().item() / max(1, len(every)))
    return TableSample(source=source, batches=len(per_batch), rows=rows,
                       distinct={n: tuple(_mean(col) for col in zip(*calls)) for n, calls in distinct.items()},
                       touched={n: _mean(v) for n, v in touched.items()}, ids={n: _mean(v) for n, v in ids.items()},
                       hottest={n: _mean(v) for n, v in hottest.items()})


def rows_by_call(sample: TableSample | None, graph) -> dict[int, float]:
    """Captured lookup call index -> the distinct ids the sample's same lookup read (a table's k-th lookup in the
    forward's order is the sample's k-th of that table)."""
    if sample is None:
        return {}
    tables = {ref.value: name for name, ref in graph.params.items() if name in sample.distinct}
    found: dict[int, float] = {}
    seen: dict[str, int] = {}
    for call in graph.calls:
        if call.op.__name__ != "embedding.default" or call.inputs[0].value not in tables:
            continue
        name = tables[call.inputs[0].value]
        k = seen[name] = seen.get(name, -1) + 1
        if k < len(sample.distinct[name]):
            found[call.index] = sample.distinct[name][k]
    return found


def cached_sample(model: nn.Module, batch, batch_source: str, fused: dict[str, str], graphs: dict | None
                ) -> TableSample | None:
    """`sample_ids` of the fused tables at the micro-batch `batch`'s size, kept in `graphs` (a search's) by size."""
    from plait.operators import batch as batches

    if not fused:
        return None
    key = ("ids sample", batch_source, batches.rows(batch))
    if graphs is not None and key in graphs:
        return graphs[key]
    sample = sample_ids(model, batch_source, batches.rows(batch), fused)
    if graphs is not None:
        graphs[key] = sample
    return sample
