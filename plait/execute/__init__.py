"""The executor: apply a Plan to the plan's model (through its adapter, plait.models) on torch.distributed,
with PyTorch's own parts.

    from plait.runtime.launch import init_distributed
    from plait.execute import parallelize

    init_distributed()                       # under torchrun, or plait.runtime.launch.run_local
    pm = parallelize(plan, seed=0)           # ParallelModel: this rank's stage(s), sharded
    opt = pm.make_optimizer(lr=1e-3)
    loss = pm.train_step(tokens, targets)    # this dp rank's share of the global batch
    pm.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

Composition order and the reasons for it: plait/execute/parallelize.py.
"""

from plait.execute.batches import batch_for_step, dp_shard
from plait.execute.parallelize import ParallelModel, parallelize
from plait.execute.reference import single_process_reference

__all__ = ["ParallelModel", "batch_for_step", "dp_shard", "parallelize", "single_process_reference"]
