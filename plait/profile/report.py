"""What a profile prints: compute rates, link fits and their quality, per-collective bandwidth, and the
host time fitted on the probe plans."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from plait.cost import predict
from plait.plan import Plan
from plait.profile.calibrate import Calibration, Measurements, host_time_text
from plait.profile.fit import evaluate_link, ring_terms
from plait.report.console import output_console


def print_report(m: Measurements, cal: Calibration, console: Console | None = None) -> None:
    console = console or output_console()
    console.print(compute_table(m, cal))
    console.print(links_table(cal))
    for level, samples in m.comm.items():
        console.print(collectives_table(level, samples, cal))
    if cal.host is not None:
        console.print(host_table(m, cal))
    c = cal.cluster
    console.print(f"memory per device {c.memory_bytes / 2**30:.2f} GiB; peak {c.peak_flops / 1e9:.1f} GFLOP/s; "
                  f"efficiency matmul={c.efficiency.matmul:g} half_dim={c.efficiency.matmul_half_dim:g} "
                  f"overhead={c.efficiency.overhead:g}; measured in {m.seconds:.0f} s")
    for note in cal.notes:
        console.print(f"[yellow]profile: note:[/] {note}", highlight=False)


def compute_table(m: Measurements, cal: Calibration) -> Table:
    table = Table(title=f"compute per rank, {m.world_size} ranks at once ({m.device_name}, {m.dtype}), "
                        f"fwd+bwd GFLOP/s (fraction of peak)")
    widths = sorted({s.hidden_size for s in m.compute})
    names = list(dict.fromkeys(s.name for s in m.compute))
    table.add_column("op")
    for h in widths:
        table.add_column(f"h={h}", justify="right")
    peak = cal.cluster.peak_flops
    for name in names:
        cells = []
        for h in widths:
            rate = next((s.flops_per_s for s in m.compute if s.name == name and s.hidden_size == h), None)
            cells.append("-" if rate is None else f"{rate / 1e9:.1f} ({rate / peak:.0%})")
        table.add_row(name, *cells)
    return table


def links_table(cal: Calibration) -> Table:
    table = Table(title="link fits: t = steps*latency + bus_volume/bandwidth (ring convention)")
    for column in ("level", "latency", "bandwidth", "R²", "max rel resid", "median rel resid", "samples"):
        table.add_column(column, justify="left" if column == "level" else "right")
    for level, fit in cal.links.items():
        table.add_row(level, f"{fit.latency_s * 1e6:.1f} us", f"{fit.bandwidth / 1e9:.3f} GB/s", f"{fit.r2:.3f}",
                      f"{fit.max_rel_residual:.0%}", f"{fit.median_rel_residual:.0%}", str(fit.num_samples))
    return table


def collectives_table(level: str, samples, cal: Calibration) -> Table:  # noqa: ANN001
    """Per collective: its own fit, and how far the level's single fit (the file's) is from it."""
    link = cal.cluster.intra_node if level == "intra_node" else cal.cluster.inter_node
    table = Table(title=f"{level}: each collective fitted alone; last column: the level's fit against it")
    for column in ("collective", "ranks", "latency", "bandwidth", "max rel resid", "bus GB/s at largest",
                   "level fit max rel err"):
        table.add_column(column, justify="left" if column == "collective" else "right")
    for name, own in cal.per_collective.get(level, {}).items():
        rows = [s for s in samples if s.collective == name]
        largest = max(rows, key=lambda s: (s.num_bytes, s.group_size))
        level_fit = evaluate_link(rows, link.latency_s, link.bandwidth)
        table.add_row(name, ",".join(str(p) for p in sorted({s.group_size for s in rows})),
                      f"{own.latency_s * 1e6:.1f} us", f"{own.bandwidth / 1e9:.3f} GB/s",
                      f"{own.max_rel_residual:.0%}", f"{_bus_bandwidth(largest) / 1e9:.3f}",
                      f"{level_fit.max_rel_residual:.0%}")
    return table


def host_table(m: Measurements, cal: Calibration) -> Table:
    """Each probe plan's measured step against the cost model's with the fitted host time."""
    table = Table(title=f"host time: {host_time_text(cal.cluster.host)} (fitted on these probe plans, "
                        f"{m.host_steps[0].plan['train']['seq_len']} tokens per sequence)")
    for column in ("probe plan", "measured", "predicted", "error"):
        table.add_column(column, justify="left" if column == "probe plan" else "right")
    for sample in m.host_steps:
        plan = Plan.from_dict(sample.plan).replace(cluster=cal.cluster, predicted=None)
        predicted = predict(plan).step_time_s
        table.add_row(plan.describe(), f"{sample.seconds * 1e3:.1f} ms", f"{predicted * 1e3:.1f} ms",
                      f"{(predicted - sample.seconds) / sample.seconds:+.0%}")
    return table


def _bus_bandwidth(sample) -> float:  # noqa: ANN001
    _steps, factor = ring_terms(sample.collective, sample.group_size)
    return factor * sample.num_bytes / sample.seconds


def _kib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:g} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:g} KiB"
