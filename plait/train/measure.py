"""The run measures itself: what every rank spent in each step, by part, against what the plan predicted.

Each rank times, cheaply (a few clock reads per stage and micro-batch), four things per step:

* **compute**: its pipeline stages' forward (the Stage module's forward, from a pre-hook to a post-hook) and
  backward (from the gradient's arrival at the stage's output to its arrival at the stage's first block's
  input, or at the stage input), over every micro-batch. The layers, the embedding and output layer,
  recompute, and the tensor-parallel collectives and fully_shard gathers that run inside the layers are in it
  (they cannot be told apart without a profiler); the throttle of an emulated slow rank too
  (plait/runtime/throttle.py). The zero-bubble schedules compute weight gradients apart, after this window: there
  compute reads low;
* **waiting**: the rest of the forward-backward call (ParallelModel.train_step): the pipeline's bubble and
  transfers, the data-parallel communication backward did not hide, the loss (forward and backward: it runs
  between the stage's forward and its backward) and its reduction;
* **optimizer**: gradient clipping and the optimizer step;
* **step**: all of it, from zeroing the gradients to the end of the optimizer step;

and beside them the step's CPU seconds of the rank's process and its training thread's wait for a core (Linux's
run-queue delay: in the step, before the optimizer, inside compute), which say how much of a wall-clock step other
work on the cores took (`Segment.queued_share`). What a run reports, and what `plait tune --from-run` and `plait
train --adapt` fit, is each part and the step less that wait (`Segment.measured`; `wall_clock=True` reads them as
the clock did): on a machine shared with other jobs the wall clock holds their load, which no cost model sees; on
an idle one the two are the same.

The cost model's parts map onto these: compute + recompute + tp_comm (+ cp_comm, ep_comm) onto compute, bubble +
pp_comm + dp_comm + loss onto waiting, optimizer (with the fixed host time of a step) onto optimizer. Its parts are
those of the bottleneck rank, so the measured ones are read on the rank that computed longest (the median over steps, after
WARMUP_STEPS). Per rank, predicted compute against measured says which rank runs slower than its hardware
should: the evidence `plait train --adapt` re-plans from (plait/train/adapt.py), and `plait tune --from-run`
fits the cost model's constants from (plait/profile/calibrate.py).

The records go to LOG_DIR/measured.json (every step of every rank, and the plan of each segment: a run that
switched plans has two), with, for a mixture-of-experts model, how evenly its routers spread the tokens
(`RouterLoad`: the ModelSpec.router_imbalance the cost model prices expert parallelism with). Pure but for
`StepClock` and `RouterLoad`, which import torch when they are built.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MEASURED_FILE = "measured.json"
WARMUP_STEPS = 2
"""Steps of each plan left out of the medians: the first ones build DDP's buckets, autograd's caches and gloo's
connections."""
FORMAT = 1


# ---- one rank's clock -----------------------------------------------------------------------

class StepClock:
    """Times this rank's compute (see the module docstring) with hooks on its Stage modules and their first block.

    Installed after the throttle's hooks (plait.execute.parallelize), so an emulated slow rank's sleeps count as
    its compute: the rank is slow, whatever makes it so."""

    def __init__(self, model_parts: list[Any]) -> None:
        self.compute_s = 0.0
        self.queued_s = 0.0
        """The run-queue delay (queued_seconds) inside the compute windows: how much of compute_s other work took."""
        self._forward_began: tuple[float, float | None] | None = None
        self._backward_began: tuple[float, float | None] | None = None
        self._handles: list[Any] = []
        for part in model_parts:
            stage = getattr(part, "module", part)  # a DistributedDataParallel wraps the Stage
            # a per-operator plan's module has no Stage's blocks: its backward ends at its received input
            blocks = list(stage.stage_blocks().values()) if hasattr(stage, "stage_blocks") else []
            self._handles.append(stage.register_forward_pre_hook(self._forward_start, prepend=True))
            self._handles.append(stage.register_forward_hook(self._forward_end))
            if blocks:  # the gradient reaching block 0's input: every layer of the stage is done
                self._handles.append(blocks[0].register_forward_hook(self._watch_input))
            elif not stage.first:
                self._handles.append(stage.register_forward_hook(self._watch_input))

    def take(self) -> tuple[float, float]:
        """(compute seconds, the run-queue delay within them) since the last call."""
        value, queued = self.compute_s, self.queued_s
        self.compute_s = self.queued_s = 0.0
        return value, queued

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _forward_start(self, module: Any, args: Any) -> None:
        self._forward_began = (time.perf_counter(), queued_seconds())

    def _forward_end(self, module: Any, args: Any, output: Any) -> None:
        if self._forward_began is not None:
            self._close(self._forward_began)
            self._forward_began = None
        out = output[0] if isinstance(output, tuple) else output
        if getattr(out, "requires_grad", False):
            out.register_hook(self._backward_start)

    def _watch_input(self, module: Any, args: Any, output: Any) -> None:
        # registered after the forward, so after the throttle's own hook on this input (which sleeps): this
        # one fires once that sleep is over
        x = args[0] if args else None
        if getattr(x, "requires_grad", False):
            x.register_hook(self._backward_end)

    def _backward_start(self, grad: Any) -> None:
        # CPU autograd runs the backward on the thread that called it: this thread's run-queue delay is the
        # backward's
        self._backward_began = (time.perf_counter(), queued_seconds())

    def _backward_end(self, grad: Any) -> None:
        if self._backward_began is not None:
            self._close(self._backward_began)
            self._backward_began = None

    def _close(self, began: tuple[float, float | None]) -> None:
        """Add the window opened at `began` (clock, run-queue delay) to the compute time and its delay."""
        self.compute_s += time.perf_counter() - began[0]
        queued = queued_seconds()
        if queued is not None and began[1] is not None:
            self.queued_s += queued - began[1]


SCHEDSTAT = Path("/proc/thread-self/schedstat")


def queued_seconds() -> float | None:
    """Seconds the calling thread has sat ready to run without a core since it started (the run-queue delay Linux
    keeps in /proc/thread-self/schedstat, second field, nanoseconds); None where the kernel does not report it."""
    try:
        return int(SCHEDSTAT.read_text().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return None


# ---- records ---------------------------------------------------------------------------------

@dataclass(kw_only=True)
class RankRecord:
    """One rank's timings of the steps of one plan."""

    rank: int
    pp_rank: int
    dp_rank: int = 0
    tp_rank: int = 0
    steps: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    """The forward-backward call (ParallelModel.train_step): compute + waiting."""
    compute_s: list[float] = field(default_factory=list)
    optimizer_s: list[float] = field(default_factory=list)
    router_load: dict[str, list[float]] = field(default_factory=dict)
    """Mixture-of-experts models: per ep (as a string: JSON keys), per step, this rank's RouterLoad reading."""
    cpu_s: list[float] = field(default_factory=list)
    """CPU seconds this rank's process (all its threads) spent in the step: its own work, which other work sharing
    the cores does not stretch, where the wall-clock step_s also holds the time it waited while descheduled or for a
    descheduled peer (empty in files written before it was recorded)."""
    queued_s: list[float] = field(default_factory=list)
    """Seconds this rank's training thread sat ready to run but without a core during the step (Linux's run-queue
    delay): time other work on the cores took from it (empty where the kernel does not report it)."""
    queued_train_s: list[float] = field(default_factory=list)
    """The part of queued_s before the optimizer (the forward-backward call and the gradients' zeroing); the rest
    is the optimizer's (empty in files written before it was recorded)."""
    queued_compute_s: list[float] = field(default_factory=list)
    """The part of queued_s inside the compute windows (StepClock): how much of compute_s other work took."""

    def add(self, step: int, step_s: float, train_s: float, compute_s: float, optimizer_s: float,
            router_load: dict[int, float] | None = None, cpu_s: float | None = None,
            queued_s: float | None = None, queued_train_s: float | None = None,
            queued_compute_s: float | None = None) -> None:
        self.steps.append(step)
        self.step_s.append(step_s)
        self.train_s.append(train_s)
        self.compute_s.append(compute_s)
        self.optimizer_s.append(optimizer_s)
        if cpu_s is not None:
            self.cpu_s.append(cpu_s)
        if queued_s is not None:
            self.queued_s.append(queued_s)
            if queued_train_s is not None and queued_compute_s is not None:
                self.queued_train_s.append(queued_train_s)
                self.queued_compute_s.append(queued_compute_s)
        for ep, value in (router_load or {}).items():
            self.router_load.setdefault(str(ep), []).append(value)

    def window(self, start: int = 0) -> "RankRecord":
        """The steps from index `start` on."""
        return _slice(self, start, len(self.steps))


@dataclass(frozen=True, kw_only=True)
class Parts:
    """Seconds per step by part (measured: medians; predicted: the cost model's, grouped the same way)."""

    step: float
    compute: float
    waiting: float
    optimizer: float

    @classmethod
    def of_prediction(cls, step_time_s: float, parts: dict[str, float]) -> "Parts":
        return cls(step=step_time_s, compute=sum(parts.get(k, 0.0) for k in COMPUTE_PARTS),
                   waiting=sum(parts.get(k, 0.0) for k in WAITING_PARTS), optimizer=parts.get("optimizer", 0.0))


COMPUTE_PARTS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm")
"""The cost model's parts that run inside the stage's modules (the layers' collectives included)."""
WAITING_PARTS = ("bubble", "pp_comm", "dp_comm", "loss")
"""The rest of the forward-backward call: the loss runs in the step's own code, between a stage's forward and its
backward (plait.execute.parallelize, torch's pipeline schedules)."""
PART_LABELS = {
    "compute": "compute (layers, ends, recompute; TP collectives inside the layers)",
    "waiting": "waiting (pipeline bubble and transfers, exposed DP communication, the loss)",
    "optimizer": "optimizer (clipping, step, fixed host time)",
    "step": "step",
}


@dataclass(kw_only=True)
class Segment:
    """The steps run under one plan (a run that adapted has one per plan), every rank's timings, and what the
    cost model predicted for it."""

    plan: dict
    """Plan.to_dict()."""
    predicted: Parts
    predicted_rank_compute: list[float]
    """Per pipeline rank: the compute the cost model expects of it per step."""
    ranks: list[RankRecord]

    def measured_window(self, warmup: int = WARMUP_STEPS) -> list[RankRecord]:
        steps = min(len(r.steps) for r in self.ranks) if self.ranks else 0
        start = warmup if steps > warmup else 0
        return [r.window(start) for r in self.ranks]

    def measured(self, warmup: int = WARMUP_STEPS, *, wall_clock: bool = False) -> Parts | None:
        """What the run measured: medians on the rank that computed longest; step time: the median over steps of the
        slowest rank. Less the time the ranks sat ready to run without a core (other work on the cores, which no
        cost model sees: _parts_of), or as the wall clock read them (`wall_clock`)."""
        return _parts_of([r for r in self.measured_window(warmup) if r.steps], wall_clock)

    def measured_chunks(self, count: int, warmup: int = WARMUP_STEPS, *, wall_clock: bool = False) -> list[Parts]:
        """`measured` over `count` consecutive runs of the steps (fewer where there are fewer steps): repeated
        timings of one plan, which `plait tune --from-run` checks a fit with."""
        ranks = [r for r in self.measured_window(warmup) if r.steps]
        steps = min((len(r.steps) for r in ranks), default=0)
        count = max(1, min(count, steps))
        bounds = [round(i * steps / count) for i in range(count + 1)]
        chunks = [_parts_of([_slice(r, lo, hi) for r in ranks], wall_clock) for lo, hi in zip(bounds, bounds[1:])]
        return [c for c in chunks if c is not None]

    def queued_share(self, warmup: int = WARMUP_STEPS) -> float | None:
        """The share of the median step the ranks sat ready to run without a core (per step, the rank that waited
        longest; RankRecord.queued_s): how much of what was measured is other work on the cores, which no cost
        model sees. None where the run did not record it."""
        ranks = [r for r in self.measured_window(warmup) if r.steps]
        if not ranks or not all(r.queued_s for r in ranks):
            return None
        step = statistics.median(max(v) for v in zip(*(r.step_s for r in ranks)))
        queued = statistics.median(max(v) for v in zip(*(r.queued_s for r in ranks)))
        return queued / step if step > 0 else None

    def router_imbalance(self, warmup: int = WARMUP_STEPS) -> dict[int, float]:
        """Per ep: the busiest expert-parallel rank's slots over the mean (ModelSpec.router_imbalance), the median
        over steps of the mean over ranks of RouterLoad's readings; {} for a dense model."""
        ranks = [r for r in self.measured_window(warmup) if r.router_load]
        if not ranks:
            return {}
        out = {}
        for ep in ranks[0].router_load:
            per_step = list(zip(*(r.router_load.get(ep, []) for r in ranks)))
            if per_step:
                out[int(ep)] = statistics.median(statistics.fmean(step) for step in per_step)
        return dict(sorted(out.items()))

    def rank_compute(self, warmup: int = WARMUP_STEPS) -> list[tuple[RankRecord, float, float]]:
        """(rank, predicted compute, measured median compute, less the rank's wait for a core in it) per rank, in
        rank order."""
        ranks = [r for r in self.measured_window(warmup) if r.steps]
        return [(r, self.predicted_rank_compute[r.pp_rank], statistics.median(_less_wait(r, ranks).compute_s))
                for r in sorted(ranks, key=lambda r: r.rank)]

    def to_dict(self) -> dict:
        return {"plan": self.plan, "predicted": asdict(self.predicted),
                "predicted_rank_compute": self.predicted_rank_compute, "ranks": [asdict(r) for r in self.ranks]}

    @classmethod
    def from_dict(cls, data: dict) -> "Segment":
        return cls(plan=data["plan"], predicted=Parts(**data["predicted"]),
                   predicted_rank_compute=list(data["predicted_rank_compute"]),
                   ranks=[RankRecord(**r) for r in data["ranks"]])


def _slice(record: RankRecord, start: int, stop: int) -> RankRecord:
    return RankRecord(rank=record.rank, pp_rank=record.pp_rank, dp_rank=record.dp_rank, tp_rank=record.tp_rank,
                      steps=record.steps[start:stop], step_s=record.step_s[start:stop],
                      train_s=record.train_s[start:stop], compute_s=record.compute_s[start:stop],
                      optimizer_s=record.optimizer_s[start:stop],
                      router_load={ep: values[start:stop] for ep, values in record.router_load.items()},
                      cpu_s=record.cpu_s[start:stop], queued_s=record.queued_s[start:stop],
                      queued_train_s=record.queued_train_s[start:stop],
                      queued_compute_s=record.queued_compute_s[start:stop])


def _parts_of(ranks: list[RankRecord], wall_clock: bool = False) -> Parts | None:
    """Medians on the rank that computed longest (the cost model's parts are its); the step: the slowest rank's.

    Less the time the ranks sat ready to run without a core (`wall_clock` False, where the run recorded it): per
    step, the step less the longest run-queue delay any rank had in it (a rank that waits for a core delays its
    peers at their next collective by as much); compute less the rank's own delay inside it; the forward-backward
    call less the longest delay any rank had in theirs (so waiting, the call less compute, loses what the rank
    waited for peers that waited for a core); the optimizer less the rank's own delay in it. On an otherwise idle
    machine the delays are about 0 and these are the wall-clock figures."""
    if not ranks or not ranks[0].steps:
        return None
    timed = [_less_wait(r, ranks) if not wall_clock else r for r in ranks]
    slowest = max(timed, key=lambda r: statistics.median(r.compute_s))
    steps = [max(values) for values in zip(*(r.step_s for r in ranks))]
    if not wall_clock and all(r.queued_s for r in ranks):
        steps = [s - max(q) for s, q in zip(steps, zip(*(r.queued_s for r in ranks)))]
    return Parts(step=statistics.median(steps), compute=statistics.median(slowest.compute_s),
                 waiting=statistics.median([max(0.0, t - c) for t, c in zip(slowest.train_s, slowest.compute_s)]),
                 optimizer=statistics.median(slowest.optimizer_s))


def _less_wait(record: RankRecord, ranks: list[RankRecord]) -> RankRecord:
    """`record`'s forward-backward, compute and optimizer seconds less the run-queue delays in them (see _parts_of);
    `record` itself where some rank did not record them by part."""
    if not all(r.queued_compute_s for r in ranks):
        return record
    longest = [max(q) for q in zip(*(r.queued_train_s for r in ranks))]
    return dataclasses.replace(
        record, train_s=[max(0.0, t - q) for t, q in zip(record.train_s, longest)],
        compute_s=[max(0.0, c - q) for c, q in zip(record.compute_s, record.queued_compute_s)],
        optimizer_s=[max(0.0, o - (q - t)) for o, q, t in zip(record.optimizer_s, record.queued_s,
                                                                record.queued_train_s)])


def predicted_segment(plan: Any) -> Segment:
    """A segment for `plan` with the cost model's prediction and no timings yet."""
    if plan.operators is not None:  # priced per operator (plait.operators.search.step_parts: compute, tp_comm,
        step = plan.predicted.step_time_s if plan.predicted else 0.0  # dp_comm, bubble), or one figure (older plans)
        parts = dict(plan.predicted.step_time_parts) if plan.predicted else {}
        predicted = Parts.of_prediction(step, parts) if parts else Parts(step=step, compute=step, waiting=0.0,
                                                                            optimizer=0.0)
        return Segment(plan=plan.to_dict(), predicted=predicted, predicted_rank_compute=[predicted.compute] * plan.pp,
                       ranks=[])
    from plait.cost import predict

    prediction = predict(plan.replace(predicted=None))
    return Segment(plan=plan.to_dict(), predicted=Parts.of_prediction(prediction.step_time_s,
                                                                        prediction.step_time_parts),
                   predicted_rank_compute=rank_compute(plan, prediction.step_time_parts), ranks=[])


def rank_compute(plan: Any, parts: dict[str, float]) -> list[float]:
    """Per pipeline rank, the compute the cost model expects of it per step: its stages' work over the
    micro-batches, scaled as the model scales the bottleneck's (cores lent by idle stages, plait.cost.model)."""
    from plait.cost.layout import Setting
    from plait.cost.model import pipeline_stage_times

    layout = plan.layout
    st, _ = pipeline_stage_times(Setting(plan.model, plan.cluster, plan.train), layout, plan.layers_per_stage,
                                 plan.recompute)
    per_stage = [sum(kinds) for kinds in zip(st.compute, st.recompute, st.tp_comm, st.cp_comm, st.ep_comm)]
    raw = [plan.num_micro_batches * sum(per_stage[k] for k in layout.stages_of(r)) for r in range(plan.pp)]
    bottleneck = max(raw)
    scale = sum(parts.get(k, 0.0) for k in COMPUTE_PARTS) / bottleneck if bottleneck > 0 else 1.0
    return [value * scale for value in raw]


# ---- the file -------------------------------------------------------------------------------

def write_measured(log_dir: str | Path, segments: list[Segment]) -> Path:
    path = Path(log_dir) / MEASURED_FILE
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps({"format": FORMAT, "warmup_steps": WARMUP_STEPS,
                                     "segments": [s.to_dict() for s in segments]}, indent=1))
    temporary.replace(path)
    return path


def read_measured(log_dir: str | Path) -> list[Segment]:
    """The segments of a run's LOG_DIR/measured.json; ConfigError naming the file when it is missing or not one."""
    from plait.errors import ConfigError
    from plait.inputs import read_text

    folder = Path(log_dir)
    path = folder / MEASURED_FILE if folder.is_dir() or not folder.suffix else folder
    if not path.is_file():
        raise ConfigError(f"{str(log_dir)!r} holds no {MEASURED_FILE}; give the log.dir of a `plait train` run "
                          f"(every run writes it at the end)")
    try:
        data = json.loads(read_text(path, MEASURED_FILE))
        return [Segment.from_dict(s) for s in data["segments"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} is not a measurement file of `plait train` ({type(e).__name__}: {e})") from None


# ---- the table at the end of a run ------------------------------------------------------------

def print_comparison(segments: list[Segment], console: Any = None) -> None:
    """Predicted against measured by part (and compute per rank), one table per plan the run used."""
    from rich.table import Table

    from plait.plan import Plan
    from plait.report.console import output_console

    console = console or output_console()
    for index, segment in enumerate(segments):
        measured = segment.measured()
        if measured is None:
            continue
        plan = Plan.from_dict(segment.plan)
        steps = len(segment.measured_window()[0].steps)
        wall = segment.measured(wall_clock=True)
        both = wall_clock_differs(measured, wall)
        title = (f"predicted vs measured per step{f' (plan {index + 1} of {len(segments)})' if len(segments) > 1 else ''}: "
                 f"{plan.describe()}; median of {steps} steps, rank that computed longest"
                 + ("; measured: less the time the ranks sat ready to run without a core (other work's), beside "
                    "the wall clock's" if both else ""))
        table = Table(title=title, title_justify="left")
        for name in ("part", "predicted s", "measured s", "measured / predicted", *(["wall clock s"] if both else [])):
            table.add_column(name, justify="left" if name == "part" else "right")
        for key, label in PART_LABELS.items():
            p, m = getattr(segment.predicted, key), getattr(measured, key)
            table.add_row(label, f"{p:.4f}", f"{m:.4f}", f"{m / p:.2f}" if p > 0 else "-",
                          *([f"{getattr(wall, key):.4f}"] if both else []))
        console.print(table)
        ranks = Table(title="compute per rank (a rank far above the others is a straggler)"
                      + ("; less each rank's wait for a core in it" if both else ""), title_justify="left")
        for name in ("rank", "pipeline rank", "layers", "predicted s", "measured s", "measured / predicted"):
            ranks.add_column(name, justify="right")
        for record, p, m in segment.rank_compute():
            layers = sum(plan.layers_per_stage[k] for k in plan.stages_of_rank(record.pp_rank))
            ranks.add_row(str(record.rank), str(record.pp_rank), str(layers), f"{p:.4f}", f"{m:.4f}",
                          f"{m / p:.2f}" if p > 0 else "-")
        console.print(ranks)
        imbalance = segment.router_imbalance()
        if imbalance:
            console.print(router_line(imbalance, plan))
        queued = segment.queued_share()
        if queued is not None and queued >= SHARED_CORES_SHARE:
            console.print(shared_cores_line(queued))


def wall_clock_differs(measured: Parts, wall: Parts, share: float = 0.1) -> bool:
    """Whether any part measured less the wait for a core differs from the wall clock's by `share` or more (the
    report then gives both)."""
    return any(abs(getattr(wall, k) - getattr(measured, k)) >= share * max(getattr(measured, k), 1e-12)
               for k in PART_LABELS)


SHARED_CORES_SHARE = 0.1
"""A run whose ranks waited for a core this share of their median step or more says the timings are partly other
work's (on an otherwise idle machine the share is about 0)."""


def shared_cores_line(share: float) -> str:
    return (f"other work shared the cores: the ranks sat ready to run without a core for {share:.0%} of the median "
            f"step (Linux's run-queue delay, the rank that waited longest); the measured times are read less that "
            f"wait, which no prediction holds (what it leaves, a peer's slowed collectives or caches, remains)")


CALIBRATION_RATIO = 1.5
"""A run whose median step is this far from its prediction (either way) says how to calibrate the cost model."""


def calibration_advice(segments: list[Segment], log_dir: Any, nproc: int) -> str | None:
    """What to run when the measured step is more than CALIBRATION_RATIO away from the prediction, else None: measure
    this machine (`plait profile`), fit the cost model to this run (`plait tune --from-run`), plan with the result."""
    worst = None
    for segment in segments:
        measured = segment.measured()
        if measured is None or segment.predicted.step <= 0:
            continue
        ratio = measured.step / segment.predicted.step
        if max(ratio, 1 / ratio) > CALIBRATION_RATIO and (worst is None or abs(ratio - 1) > abs(worst[0] - 1)):
            worst = (ratio, segment)
    if worst is None:
        return None
    ratio, segment = worst
    cluster = segment.plan.get("cluster", {}).get("name", "the cluster")
    direction = "slower" if ratio > 1 else "faster"
    queued = segment.queued_share()
    wall = segment.measured(wall_clock=True)
    loaded = queued is not None and queued >= SHARED_CORES_SHARE
    load = (f" This run's ranks waited for a core held by other work for {queued:.0%} of the step (the wall clock "
            f"read {wall.step:.4g} s a step, {wall.step / segment.predicted.step:.1f}x the prediction); the step above "
            f"and what plait tune --from-run fits are read less that wait, but a machine otherwise idle gives the "
            f"cleanest fit." if loaded else "")
    return (f"the measured step{' (less the wait for a core)' if loaded else ''} is {max(ratio, 1 / ratio):.1f}x "
            f"{direction} than the plan predicted for {cluster!r}: "
            f"the cost model is not calibrated for this machine. Calibrate it with `plait profile --nproc {nproc} "
            f"--out cluster.yaml`, then `plait tune --from-run {log_dir} --cluster cluster.yaml --out "
            f"cluster.tuned.yaml` (with `--from-run DIR` once more for every other run of this config: on a machine "
            f"shared with other work each run is one sample of its load), and plan with plan.cluster = "
            f"\"cluster.tuned.yaml\" (a fit from one plan knows that plan: `plait tune --model M --cluster cluster.yaml` "
            f"times several)" + load)


# ---- the router's balance ------------------------------------------------------------------------

class RouterLoad:
    """How evenly this rank's routers spread the token slots: what the cost model prices expert parallelism with
    (ModelSpec.router_imbalance: the slots the busiest expert-parallel rank receives in a pass, over the mean).

    Every MoE layer (plait.models.moe.MoE) hands it the slots per expert it counted (training passes only); for
    every ep that divides the experts, the experts split as the executor splits them (ep ranks of E/ep consecutive
    experts, plait/execute/expert.py), the busiest rank's slots over the mean. `take` returns the mean over the
    passes since the last call. Read from one rank's tokens whatever the plan (so a run without expert parallelism
    measures it too): a group of ep ranks pools ep times as many tokens per pass, so where a pass routes few tokens
    this reads a little above what the group sees."""

    def __init__(self, model_parts: list[Any]) -> None:
        from plait.models.moe import MoE

        self._sums: dict[int, float] = {}
        self._passes = 0
        self._layers = [m for part in model_parts for m in part.modules() if isinstance(m, MoE)]
        for moe in self._layers:
            moe.on_counts = self._counter(moe)
        # transformers' experts (their classes carry `_is_expert_parallel`): each call gets the routed top-k ids
        self._hooks = [m.register_forward_pre_hook(self._routed(m), with_kwargs=True) for part in model_parts
                       for m in part.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]

    def _routed(self, experts: Any):
        """Counts per expert of a Hugging Face experts module, from the top_k_index its block passes it."""
        import torch

        count = self._counter(experts)

        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            if isinstance(index, torch.Tensor) and not index.is_meta:
                ids = index.flatten()
                count(torch.bincount(ids[ids < experts.num_experts], minlength=experts.num_experts))

        return hook

    def _counter(self, moe: Any):
        import torch

        splits = [ep for ep in range(2, moe.num_experts + 1) if moe.num_experts % ep == 0]

        def count(counts: Any) -> None:
            if not moe.training or not torch.is_grad_enabled():
                return
            counts = counts.detach().double().cpu()
            total = float(counts.sum())
            if total <= 0:
                return
            for ep in splits:
                self._sums[ep] = self._sums.get(ep, 0.0) + float(counts.reshape(ep, -1).sum(1).max()) * ep / total
            self._passes += 1

        return count

    def take(self) -> dict[int, float]:
        """Per ep, the mean busiest-over-mean of the passes since the last call ({} where no MoE layer ran)."""
        out = {ep: value / self._passes for ep, value in self._sums.items()} if self._passes else {}
        self._sums, self._passes = {}, 0
        return out

    def remove(self) -> None:
        for moe in self._layers:
            moe.on_counts = None
        self._layers.clear()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def router_figure(imbalance: dict[int, float]) -> tuple[float, str]:
    """The one figure ModelSpec.router_imbalance takes, from a run's readings per ep (Segment.router_imbalance):
    that of the largest ep measured -- the busiest share grows with the split, so it is the cautious one (the cost
    model caps it at ep for smaller splits) -- and a line saying which it is."""
    ep = max(imbalance)
    value = round(max(1.0, imbalance[ep]), 3)
    measured = ", ".join(f"ep{e} {v:.3f}" for e, v in imbalance.items())
    return value, f"{value:g} (ep{ep}, the largest expert split measured; measured {measured})"


def measured_router_imbalance(segments: list[Segment]) -> tuple[float, str] | None:
    """The router balance the latest plan of a run with readings measured (router_figure), or None (a dense
    model, or no step past the warm-up)."""
    for segment in reversed(segments):
        if imbalance := segment.router_imbalance():
            return router_figure(imbalance)
    return None


def run_router_imbalance(log_dir: str | Path) -> tuple[float, str, str]:
    """(figure, how chosen, the run's model name) from LOG_DIR/measured.json; ConfigError naming the file where
    it holds no router readings."""
    from plait.errors import ConfigError

    segments = read_measured(log_dir)
    found = measured_router_imbalance(segments)
    if found is None:
        raise ConfigError(f"{str(log_dir)!r}: its {MEASURED_FILE} holds no router balance (a dense model, or no step "
                          f"past the {WARMUP_STEPS} warm-up steps); give the log.dir of a mixture-of-experts run")
    model = segments[-1].plan.get("model", {})
    return found[0], found[1], model if isinstance(model, str) else model.get("name", "?")


def router_line(imbalance: dict[int, float], plan: Any) -> str:
    """The router's measured balance against what the plan was priced with, and how to plan with it."""
    measured = ", ".join(f"ep{ep} {value:.3f}" for ep, value in imbalance.items())
    return (f"router: the busiest expert-parallel rank's slots over the mean, per MoE pass: {measured} (priced with "
            f"{plan.model.router_imbalance:g}; plan with yours: `plait plan --router-imbalance R` or the model "
            f"file's router_imbalance)")


# ---- a run's measurements, on every rank --------------------------------------------------------

class RunMeasurements:
    """This rank's clock and timings, and the segments of the run so far (collective where it says so)."""

    def __init__(self, plan: Any, model: Any) -> None:
        self.segments: list[Segment] = []
        self.clock: StepClock | None = None
        self.router: RouterLoad | None = None
        self.record: RankRecord | None = None
        self.start(plan, model)

    def start(self, plan: Any, model: Any) -> None:
        """Begin a segment: `plan` now runs as `model` (this rank's ParallelModel)."""
        import torch.distributed as dist

        if self.clock is not None:
            self.clock.remove()
            self.router.remove()
        self.segments.append(predicted_segment(plan))
        self.clock = StepClock(model.model_parts)
        self.router = RouterLoad(model.model_parts)
        self.record = RankRecord(rank=dist.get_rank(), pp_rank=model.pp_rank, dp_rank=model.dp_rank,
                                 tp_rank=model.tp_rank)

    def add(self, step: int, step_s: float, train_s: float, optimizer_s: float, cpu_s: float | None = None,
            queued_s: float | None = None, queued_train_s: float | None = None) -> None:
        """One step's timings; `queued_s` the step's run-queue delay, `queued_train_s` its part before the
        optimizer (the clock has the part inside compute)."""
        compute_s, queued_compute_s = self.clock.take()
        self.record.add(step, step_s, train_s, compute_s, optimizer_s, self.router.take(), cpu_s, queued_s,
                        queued_train_s, queued_compute_s)

    def gathered(self) -> Segment:
        """The current segment with every rank's timings so far (collective)."""
        import torch.distributed as dist

        records: list = [None] * dist.get_world_size()
        dist.all_gather_object(records, self.record)
        segment = self.segments[-1]
        segment.ranks = sorted(records, key=lambda r: r.rank)
        return segment

    def finish(self) -> list[Segment]:
        """Every segment with every rank's timings (collective); the clock's hooks are removed."""
        self.gathered()
        if self.clock is not None:
            self.clock.remove()
            self.router.remove()
        return [s for s in self.segments if s.ranks and s.ranks[0].steps]
