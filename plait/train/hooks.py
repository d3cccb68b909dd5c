"""Where checkpoints plug into the training loop.

The loop calls `resume(state)` once before the first step and `after_step(state, final)` after
every optimizer step. `TrainState` carries everything a checkpoint must hold: the parallel
model, the optimizer, the data loader (its `state_dict()` is its position), the step, the
plan and the config. The checkpoint module (plait/train/checkpoint.py, with
`torch.distributed.checkpoint`) provides a `Checkpointer` with these two methods; until it
exists, or when `[checkpoint] dir` is unset, `NoCheckpoints` keeps the loop unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from plait.errors import ConfigError
from plait.plan import Plan
from plait.train.config import Config


@dataclass(kw_only=True)
class TrainState:
    """The live objects of a run (mutable on purpose: `step` advances, a resume loads into them)."""

    config: Config
    plan: Plan
    model: Any
    """plait.execute.ParallelModel."""
    optimizer: Any
    loader: Any
    """plait.train.data.BatchLoader."""
    step: int = 0
    """Optimizer steps done."""
    tokens: int = 0
    """Tokens trained on so far."""
    best_val_loss: float | None = None
    """The lowest validation loss so far (None: no evaluation yet); saved with every checkpoint, so a resumed run
    keeps a better best checkpoint rather than overwriting it (plait.train.evaluate)."""
    schedule_steps: int | None = None
    """Steps the learning-rate schedule spans as the checkpoint resumed from says (plait.train.checkpoint.
    schedule_span); None: a new run's, optimizer.schedule_steps or train.steps."""

    def schedule_span(self) -> int:
        return self.schedule_steps or self.config.optimizer.schedule_steps or self.config.train.steps


class CheckpointHooks(Protocol):
    def resume(self, state: TrainState) -> None:
        """Load the latest complete checkpoint into `state` (model, optimizer, loader, step), if any."""

    def after_step(self, state: TrainState, final: bool) -> None:
        """Save a checkpoint if one is due (every N steps, and at the end when `final`)."""


class NoCheckpoints:
    def resume(self, state: TrainState) -> None:
        pass

    def after_step(self, state: TrainState, final: bool) -> None:
        pass


def make_checkpoint_hooks(config: Config) -> CheckpointHooks:
    checkpointer = checkpointer_class(config)
    return NoCheckpoints() if checkpointer is None else checkpointer(config)


def checkpointer_class(config: Config) -> type | None:
    """The class that saves this run's checkpoints, None without [checkpoint] dir; refuses what cannot work.

    Cheap (no torch unless the checkpoint module needs it): the launcher calls it to refuse a bad
    [checkpoint] section before starting ranks."""
    if config.checkpoint.dir is None:
        if config.checkpoint.resume:
            raise ConfigError("checkpoint.resume=true needs checkpoint.dir (where the checkpoints are)")
        return None
    try:
        from plait.train.checkpoint import Checkpointer  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError(
            "checkpoint.dir is set but this plait has no checkpoint support yet; unset [checkpoint] dir"
        ) from None
    return Checkpointer
