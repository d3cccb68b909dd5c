"""A per-operator plan's batches: what the batch factory returns, how the module's forward takes it, and how it is
split over data-parallel ranks and micro-batches. One owner for the planner (capture on meta) and the executor (the
run, `plait check`'s reference), so both call the forward the same way.

The factory is `package.module:function`, called as function(batch_size, generator). It returns the forward's
arguments: a tuple (or list) of them -> forward(*batch); a dict -> forward(**batch); a single tensor ->
forward(batch). Arguments may nest (a tuple holding a dict of tensors): every tensor in it is an input, and every
one has `batch_size` rows (dim 0), which is how data parallelism and micro-batches split it.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.errors import ConfigError
from plait.torch_internals import tree_flatten, tree_map_only, tree_unflatten


def draw(source: str, batch_size: int, generator: torch.Generator) -> Any:
    """The factory's batch of `batch_size` rows; ConfigError in one line for a factory that does not take
    (batch_size, generator), or returns no tensor, or a tensor without `batch_size` rows."""
    from plait.models.factory import load_factory

    factory = load_factory(source)
    try:
        batch = factory(batch_size, generator)
    except TypeError as e:
        if not _takes_two_arguments(factory):
            raise ConfigError(f"batch factory {source!r} must take (batch_size, generator) and return the forward's "
                              f"tensors; calling it so failed: {e}") from None
        raise
    leaves, _ = tree_flatten(batch)
    tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ConfigError(f"batch factory {source!r} returned {type(batch).__name__} without a tensor; it must "
                          f"return the forward's tensors (a tuple, a dict, or one tensor)")
    for i, t in tensors:
        if t.dim() == 0 or t.shape[0] != batch_size:
            raise ConfigError(f"batch factory {source!r}: tensor {i} of its batch has shape {list(t.shape)}, not "
                              f"{batch_size} rows (dim 0 = batch_size, how data parallelism splits the batch)")
    return batch


def _takes_two_arguments(factory) -> bool:
    import inspect

    try:
        inspect.signature(factory).bind(1, None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): leave the error as it came
        return True
    return True


def step_batch(source: str, batch_size: int, seed: int, step: int, dtype: torch.dtype | None = None) -> Any:
    """The global batch of `step` (the same on every rank and in one process): the factory's, drawn from a
    generator seeded by (seed, step), floating tensors cast to `dtype`. Held-out batches (validation) are drawn from
    negative steps, which training never reaches."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    batch = draw(source, batch_size, generator)
    if dtype is None:
        return batch
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, batch)


def held_out_step(index: int) -> int:
    """The `step` of held-out batch `index` (0, 1, ...): negative, so never a training step's."""
    return -1 - index


def split(batch: Any, parts: int, index: int) -> Any:
    """Rows index·n:(index+1)·n of every tensor of `batch` (n = rows / parts): a data-parallel rank's share, or a
    micro-batch."""
    if parts == 1:
        return batch
    return tree_map_only(torch.Tensor, lambda t: t.chunk(parts, dim=0)[index], batch)


def concat(parts: list[Any]) -> Any:
    """Batches of the same structure joined row-wise (every tensor concatenated along dim 0)."""
    leaves = [tree_flatten(part)[0] for part in parts]
    spec = tree_flatten(parts[0])[1]
    joined = [torch.cat(column) if isinstance(column[0], torch.Tensor) else column[0] for column in zip(*leaves)]
    return tree_unflatten(joined, spec)


def to_device(batch: Any, device: torch.device | str) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(device), batch)


def positional(batch: Any) -> tuple | None:
    """The batch as the positional arguments a pipeline stage takes (torch.distributed.pipelining hands stages
    positional and numbered keyword arguments): a tuple or list as a tuple, one tensor as a 1-tuple; None for a dict
    or another structure, which pipeline stages do not take."""
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, (tuple, list)):
        return tuple(batch)
    return None


def rows(batch: Any) -> int:
    return next(t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)).shape[0]


def call(module: torch.nn.Module, batch: Any) -> Any:
    """The module's forward on `batch`, called as the factory's shape says (module docstring)."""
    if isinstance(batch, dict):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)


def flat(batch: Any) -> tuple[list[Any], Any]:
    """(leaves, spec) of `batch`, as torch's pytree flattens it (tensors and other leaves, in order)."""
    return tree_flatten(batch)


def unflat(leaves: list[Any], spec: Any) -> Any:
    return tree_unflatten(leaves, spec)
