"""The run configs the multi-process tests train from: a model file, maybe a fixed plan, and the TOML naming them
(written by plait's own `toml_text`, the writer of `plait demo`'s config)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plait.train.config import toml_text


def local_plan(model: dict[str, Any], global_batch: int, seq_len: int, **degrees: Any):
    """A plan of `model` (a model file's fields) for plait's local CPU cluster, in fp32."""
    from plait.plan import Plan
    from plait.spec import ModelSpec, TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS

    return Plan.of(model=ModelSpec(**model), train=TrainSpec(global_batch=global_batch, seq_len=seq_len,
                                                             precision="fp32"),
                   cluster=CLUSTER_PRESETS["local-cpu"], **degrees)


def write_run_config(root: Path, name: str, model: dict[str, Any], sections: dict[str, dict[str, Any]],
                     plan=None) -> Path:
    """root/model.json, root/plan.json (when `plan` is given: the config trains with it, else plan.file is "auto")
    and root/<name>.toml: `sections` over a base that names them, logs to root/<name>/log without a progress bar."""
    (root / "model.json").write_text(json.dumps(model))
    if plan is not None:
        (root / "plan.json").write_text(plan.to_json())
    base = {"model": {"file": str(root / "model.json")},
            "plan": {"file": str(root / "plan.json") if plan is not None else "auto"},
            "log": {"dir": str(root / name / "log"), "progress": False}}
    tables = {section: {**base.get(section, {}), **sections.get(section, {})} for section in {**base, **sections}}
    config = root / f"{name}.toml"
    config.write_text(toml_text(tables))
    return config
