"""Where a run's metrics go: metrics.jsonl always, and TensorBoard and Weights & Biases when [log] asks.

Every sink gets the same fields: each training step's StepMetrics (under ``train/`` in TensorBoard and W&B)
and each evaluation's values (``val/loss``; eval.jsonl on disk), and the TensorBoard / W&B ones also get the
plan and the config as run metadata. Rank 0 alone writes; the other ranks hold `RunSinks(enabled=False)`.

* TensorBoard: torch's `SummaryWriter`, event files under ``<log.dir>/tensorboard`` (``tensorboard --logdir``);
* W&B: the `wandb` library, ``mode = "offline"`` by default (a run folder under ``<log.dir>/wandb``, uploaded
  later with ``wandb sync``), or ``"online"``.

Both libraries are optional extras (``pip install 'plait[tensorboard]'`` / ``'plait[wandb]'``): a config that
names a sink whose library is missing is refused before any rank starts (`check_sinks`).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from plait.train.metrics import MetricsLog, StepMetrics

TENSORBOARD_DIR = "tensorboard"
EVAL_FILE = "eval.jsonl"
_KEYS = {"tensorboard": "log.tensorboard = true", "wandb": "log.wandb"}


def wanted_sinks(log: Any) -> list[str]:
    """The optional sinks a [log] section turns on."""
    return [name for name, on in (("tensorboard", log.tensorboard), ("wandb", log.wandb != "off")) if on]


def check_sinks(log: Any) -> None:
    """Refuse, in one line, a sink whose library is not installed (before ranks start, not at step 0)."""
    from plait.extras import require

    for name in wanted_sinks(log):
        require(name, _KEYS[name], "turn the sink off")


class Sink(Protocol):
    def step(self, metrics: StepMetrics) -> None: ...

    def evaluation(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def train_fields(metrics: StepMetrics) -> dict[str, float]:
    """A step's metrics.jsonl fields as scalars named for dashboards (train/loss, train/lr, ...)."""
    return {f"train/{k}": float(v) for k, v in asdict(metrics).items()
            if k != "step" and isinstance(v, (int, float))}  # precision is run metadata (the plan's), not a scalar


def eval_fields(values: dict[str, float]) -> dict[str, float]:
    return {f"val/{k.removeprefix('val_')}": float(v) for k, v in values.items()}


class TensorBoardSink:
    def __init__(self, log_dir: Path, metadata: dict[str, Any], resumed_at: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if resumed_at:  # the steps after the checkpoint are trained again: each step is logged once
            keep_events_up_to(log_dir / TENSORBOARD_DIR, resumed_at)
        self.writer = SummaryWriter(log_dir=str(log_dir / TENSORBOARD_DIR))
        if not resumed_at:
            for name, value in metadata.items():
                self.writer.add_text(name, "```\n" + json.dumps(value, indent=1) + "\n```", global_step=0)

    def step(self, metrics: StepMetrics) -> None:
        for tag, value in train_fields(metrics).items():
            self.writer.add_scalar(tag, value, global_step=metrics.step)

    def evaluation(self, step: int, values: dict[str, float]) -> None:
        for tag, value in eval_fields(values).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def keep_events_up_to(folder: Path, step: int) -> list[Path]:
    """Rewrite the TensorBoard event files in `folder` without their events past `step` (what an interrupted run
    logged after its last checkpoint), as metrics.jsonl drops those lines: any reader -- TensorBoard, its data
    server, a script over the raw files -- then sees each step once. purge_step would only ask TensorBoard to hide
    them. Each file is replaced whole (written aside, then renamed); returns the files rewritten."""
    import os

    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    rewritten = []
    for file in sorted(folder.glob("events.out.tfevents.*")) if folder.is_dir() else []:
        records = list(RawEventFileLoader(str(file)).Load())
        kept = [record for record in records if Event.FromString(record).step <= step]
        if len(kept) == len(records):
            continue
        aside = file.with_name(f".rewrite-{os.getpid()}.tmp")  # no "tfevents" in it: no reader takes it for a log
        with aside.open("wb") as f:
            writer = RecordWriter(f)
            for record in kept:
                writer.write(record)
            f.flush()
            os.fsync(f.fileno())
        os.replace(aside, file)
        rewritten.append(file)
    return rewritten


class WandbSink:
    def __init__(self, log_dir: Path, metadata: dict[str, Any], mode: str, project: str) -> None:
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        # console="off": the run's own output stays the terminal's; the metrics are what W&B is for
        self.run = wandb.init(project=project, dir=str(log_dir), mode=mode, config=metadata,
                              settings=wandb.Settings(silent=True, console="off"))

    def step(self, metrics: StepMetrics) -> None:
        self.run.log(train_fields(metrics), step=metrics.step)

    def evaluation(self, step: int, values: dict[str, float]) -> None:
        self.run.log(eval_fields(values), step=step)

    def close(self) -> None:
        self.run.finish()


class RunSinks:
    """metrics.jsonl (and eval.jsonl) plus the optional sinks, as one object the loop writes to."""

    def __init__(self, config: Any, plan: Any, *, enabled: bool, resumed_at: int = 0) -> None:
        log_dir = Path(config.log.dir)
        self.metrics = MetricsLog(log_dir / "metrics.jsonl", enabled=enabled, resumed_at=resumed_at)
        self.path = self.metrics.path
        self._evals = MetricsLog(log_dir / EVAL_FILE, enabled=enabled and config.eval.every > 0,
                                 resumed_at=resumed_at)
        self.extra: list[Sink] = []
        if not enabled:
            return
        metadata = {"plan": json.loads(plan.to_json()), "config": config.to_dict()}
        if config.log.tensorboard:
            self.extra.append(TensorBoardSink(log_dir, metadata, resumed_at))
        if config.log.wandb != "off":
            self.extra.append(WandbSink(log_dir, metadata, config.log.wandb, config.log.wandb_project))

    def write(self, metrics: StepMetrics) -> None:
        self.metrics.write(metrics)
        for sink in self.extra:
            sink.step(metrics)

    def evaluation(self, step: int, values: dict[str, float]) -> None:
        self._evals.write_record({"step": step, **{k: round(v, 6) for k, v in values.items()}})
        for sink in self.extra:
            sink.evaluation(step, values)

    def close(self) -> None:
        self.metrics.close()
        self._evals.close()
        for sink in self.extra:
            sink.close()
