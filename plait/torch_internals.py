"""Every private name of torch that plait uses, in one place.

torch moves its private names between releases, and plait supports several (2.11 to 2.14). Each private module,
class, function or op plait needs is named here and nowhere else; the rest of plait imports it from this module
(`from plait.torch_internals import tree_map`). `tests/unit/test_torch_internals.py` resolves every entry against
the installed torch and checks that no other module of plait reaches into torch's private names, so a torch that
moved one fails there, naming it, rather than somewhere deep in a run.

Names are resolved on first use (PEP 562's module `__getattr__`), so importing this module costs nothing: the
planner's modules ask for the pytree helpers without importing torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import Any

PRIVATE: dict[str, tuple[str, ...]] = {
    # pytrees and dispatch modes: reading a module's operators on meta (plait.operators, plait.models.measure)
    "tree_flatten": ("torch.utils._pytree", "tree_flatten"),
    "tree_leaves": ("torch.utils._pytree", "tree_leaves"),
    "tree_map": ("torch.utils._pytree", "tree_map"),
    "tree_map_only": ("torch.utils._pytree", "tree_map_only"),
    "tree_unflatten": ("torch.utils._pytree", "tree_unflatten"),
    "TorchDispatchMode": ("torch.utils._python_dispatch", "TorchDispatchMode"),
    "OpOverload": ("torch._ops", "OpOverload"),
    "HigherOrderOperator": ("torch._ops", "HigherOrderOperator"),
    "DisableTorchFunction": ("torch._C", "DisableTorchFunction"),
    "fused_sdp_choice": ("torch", "_fused_sdp_choice"),
    "dispatch_has_kernel_for_dispatch_key": ("torch._C", "_dispatch_has_kernel_for_dispatch_key"),
    # DTensor's sharding rules (plait.operators.strategies) and their caches (plait.execute.mesh)
    "DTensorSpec": ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    "TensorMeta": ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    "OpSchema": ("torch.distributed.tensor._op_schema", "OpSchema"),
    "RuntimeSchemaInfo": ("torch.distributed.tensor._op_schema", "RuntimeSchemaInfo"),
    "redistribute_module": ("torch.distributed.tensor", "_redistribute"),
    "StridedShard": ("torch.distributed.tensor.placement_types", "_StridedShard"),  # a split of each packed part
    "clear_dtensor_dispatch_cache": ("torch._C", "_clear_DTensor_sharding_propagator_cache"),
    # fake process groups: meshes of any size in one process (the dry run, per-operator planning)
    "FakeStore": ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    # differentiable collectives (context and expert parallelism, the MoE router's load)
    "all_reduce": ("torch.distributed._functional_collectives", "all_reduce"),
    "all_to_all_single": ("torch.distributed._functional_collectives", "all_to_all_single"),
    "all_to_all_single_autograd": ("torch.distributed._functional_collectives", "all_to_all_single_autograd"),
    "all_gather_tensor": ("torch.distributed._functional_collectives", "all_gather_tensor"),
    "all_gather_single_autograd": ("torch.distributed._functional_collectives", "all_gather_single_autograd",
                                   "all_gather_tensor_autograd"),  # the second: its name before torch 2.13
    # one flat buffer for many gradients (one all-reduce across islands)
    "flatten_dense_tensors": ("torch._utils", "_flatten_dense_tensors"),
    "unflatten_dense_tensors": ("torch._utils", "_unflatten_dense_tensors"),
    # activation checkpointing's wrapper (torchtitan's and FSDP's too)
    "CheckpointImpl": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl"),
    "CheckpointWrapper": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointWrapper"),
    "checkpoint_wrapper": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"),
    # every BatchNorm's base class (their statistics are synchronised over a split batch)
    "BatchNormBase": ("torch.nn.modules.batchnorm", "_BatchNorm"),
    # the pipeline stage's receive buffers (plait.execute.buffers lends them from a pool)
    "RecvInfo": ("torch.distributed.pipelining.stage", "_RecvInfo"),
    # peak memory as PyTorch's trackers count it on CPU (plait.profile.peak_memory)
    "MemTracker": ("torch.distributed._tools.mem_tracker", "MemTracker"),
    "FSDPMemTracker": ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker"),
}
"""name here -> (torch module, its attribute[, the attribute's name in an older torch])."""

PRIVATE_OPS: dict[str, tuple[str, str, str]] = {
    "to_copy": ("aten", "_to_copy", "default"),
    "cpu_flash_attention": ("aten", "_scaled_dot_product_flash_attention_for_cpu", "default"),
    "efficient_attention": ("aten", "_scaled_dot_product_efficient_attention", "default"),
}
"""Private ATen ops plait recognises by identity: name here -> (namespace, op, overload)."""

C10D_FUNCTIONAL = "_c10d_functional"
"""The op namespace of torch's functional collectives (the selective recompute policy saves their outputs)."""

REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
"""The logger DTensor's redistribution warns through (quieted on CPU ranks)."""

PRIVATE_METHODS: dict[tuple[str, str], tuple[str, ...]] = {
    ("torch.distributed.pipelining.stage", "PipelineStage"): ("_setup_forward_recv_info", "_create_grad_recv_info"),
    # parameters DDP leaves to the fused tables, which update their own rows (plait.execute.operators)
    ("torch.nn.parallel", "DistributedDataParallel"): ("_set_params_and_buffers_to_ignore_for_model",),
}
"""Private methods of torch classes that plait overrides or calls (plait.execute.buffers' receive-buffer pool)."""

PRIVATE_ATTRIBUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("torch.distributed.tensor", "DTensor"): ("_op_dispatcher",),
    ("torch.distributed.pipelining.schedules", "PipelineScheduleSingle"): ("_stage",),
    ("torch.distributed.pipelining.schedules", "PipelineScheduleMulti"): ("_stages",),
    ("torch", "UntypedStorage"): ("_cdata",),
}
"""Private attributes of torch objects that plait reads (DTensor's sharding propagator, a schedule's stages). An
instance attribute is checked on a small instance by the test."""


def resolve(name: str) -> Any:
    """The object `PRIVATE[name]` names in the installed torch (an older name where torch had another)."""
    module_name, *attributes = PRIVATE[name]
    module = importlib.import_module(module_name)
    for attribute in attributes:
        if hasattr(module, attribute):
            return getattr(module, attribute)
    try:  # a submodule not imported by its package yet
        return importlib.import_module(f"{module_name}.{attributes[0]}")
    except ImportError:
        raise ImportError(f"torch {_torch_version()} has no {module_name}.{attributes[0]}, which plait uses "
                          f"(plait/torch_internals.py); plait supports torch 2.11-2.14") from None


def op(name: str) -> Any:
    """The private ATen op `PRIVATE_OPS[name]`."""
    import torch

    namespace, op_name, overload = PRIVATE_OPS[name]
    return getattr(getattr(getattr(torch.ops, namespace), op_name), overload)


def c10d_functional() -> Any:
    import torch

    return getattr(torch.ops, C10D_FUNCTIONAL)


def storage_id(tensor: Any) -> int:
    """One tensor's storage, however viewed, on any device (meta storages have no data pointer): what
    plait.models.saved_bytes counts a kept tensor by."""
    return tensor.untyped_storage()._cdata


def sharding_propagator() -> Any:
    """DTensor's sharding propagator: its per-operator rules and its cache."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def clear_sharding_caches() -> None:
    """Forget every sharding decision DTensor cached (they hold the meshes of process groups that are gone)."""
    sharding_propagator().propagate_op_sharding.cache_clear()
    resolve("clear_dtensor_dispatch_cache")()  # the C++ dispatch fast path's own copy
    redistribute = resolve("redistribute_module")
    redistribute._gen_transform_infos.cache_clear()
    redistribute.clear_redistribute_planner_cache()


def implicit_replication_on() -> bool:
    """Whether DTensor takes plain tensors as replicated now (inside `implicit_replication`, which does not nest: a
    caller already in one must not enter another)."""
    from torch.distributed.tensor import DTensor

    return bool(DTensor._op_dispatcher._allow_implicit_replication)


def ddp_ignore(model: Any, names: list[str]) -> None:
    """DDP leaves these parameters of `model` alone (no gradient bucket, no broadcast)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def schedule_stages(schedule: Any) -> list:
    """The stages a torch pipeline schedule runs on this rank (one, or several for the multi-stage schedules)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def _torch_version() -> str:
    import torch

    return torch.__version__


def __getattr__(name: str) -> Any:
    if name not in PRIVATE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = resolve(name)
    globals()[name] = value  # resolved once
    return value
