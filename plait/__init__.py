"""plait: plan and run hybrid-parallel training for PyTorch.

    import plait
    plans = plait.plan("gpt3-175b", "a100-80g", plait.TrainSpec(global_batch=1536, seq_len=2048),
                       num_devices=1024, tp=8)
    print(plans[0].describe(), plans[0].predicted.step_time_s)

The planner (plait.spec, plait.cost, plait.search) never imports torch; the executor
(plait.execute, plait.train) takes only a Plan from it.
"""

from plait.errors import ConfigError, NoFeasiblePlan, PlaitError
from plait.plan import Plan, Prediction
from plait.spec import ClusterSpec, Efficiency, HostOverheads, LinkSpec, ModelSpec, TrainSpec

__all__ = [
    "ClusterSpec", "ConfigError", "Efficiency", "HostOverheads", "LinkSpec", "ModelSpec", "NoFeasiblePlan", "Plan",
    "PlaitError", "Prediction", "TrainSpec", "plan",
]


def plan(model, cluster, train, **pins):
    """Ranked feasible plans, best first. See plait.search.plan for the pins it accepts."""
    from plait.search import plan as _plan

    return _plan(model, cluster, train, **pins)
