"""plait's optional extras: which package each one brings, and the one-line refusal when it is missing.

A feature that needs an optional package asks `require` before any rank starts (or before a solver runs), so a
user who turned it on without installing it reads what to install, not a traceback from inside a rank.
"""
from __future__ import annotations

import importlib.util

from plait.errors import ConfigError

# extra (as in `pip install 'plait[extra]'`) -> the module it installs
EXTRAS = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "datasets": "datasets",
    "auto": "scipy",  # per-operator sharding's integer program (scipy.optimize.milp, HiGHS)
    "lora": "peft",  # a LoRA run's adapter export in peft's form
    "islands": "torchft",  # training across islands (DiLoCo on torchft)
}


def installed(extra: str) -> bool:
    return importlib.util.find_spec(EXTRAS[extra]) is not None


def require(extra: str, what: str, otherwise: str = "") -> None:
    """Refuse `what` (a config key or feature, as the user wrote it) when `extra`'s package is not installed."""
    if installed(extra):
        return
    tail = f", or {otherwise}" if otherwise else ""
    raise ConfigError(f"{what} needs the {EXTRAS[extra]!r} package, which is not installed; "
                      f"pip install 'plait[{extra}]'{tail}")
