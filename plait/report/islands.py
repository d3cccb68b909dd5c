"""What `plait plan` prints for a cluster of islands: how the islands talk, beside the synchronous alternative,
and what failures cost each (no torch)."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from plait.report.tables import human_bytes

SHOWN_OPTIONS = 6


def options_table(choice: Any, cluster: Any) -> Table:
    """Every exchange priced (the chosen one, sync, and the fastest others), with tokens/s and the link's load."""
    islands = cluster.islands
    link = islands.link
    title = (f"how {islands.count} islands of {cluster.island_devices} devices talk over "
             f"{link.bandwidth * 8 / 1e9:.3g} Gb/s, {link.latency_s * 1e3:.3g} ms")
    table = Table(title=title)
    for column in ("", "exchange", "tokens/s", "vs sync", "exchange s", "exposed s", "link bytes/step",
                   "link busy"):
        table.add_column(column, justify="right" if column not in ("", "exchange") else "left")
    shown = [choice.chosen, choice.sync] + [o for o in choice.options
                                            if o.describe() not in (choice.chosen.describe(), choice.sync.describe())]
    for option in shown[:SHOWN_OPTIONS]:
        mark = "*" if option is choice.chosen else ""
        table.add_row(mark, option.describe(), f"{option.tokens_per_s:,.0f}",
                      f"{option.tokens_per_s / choice.sync.tokens_per_s:.2f}x", f"{option.exchange_s:.3g}",
                      f"{option.exposed_s:.3g}", human_bytes(option.link_bytes_per_step),
                      f"{option.link_busy_fraction:.0%}")
    return table


def failures_table(choice: Any) -> Table:
    """What one failure costs, and the goodput left, under synchronous training as one job and the island plans."""
    table = Table(title="failures priced (mean time between failures of the whole run: "
                        f"{next(iter(choice.failures.values())).mtbf_s / 3600:.3g} h)")
    for column in ("plan", "a failure costs", "checkpoint every", "lost", "goodput tokens/s"):
        table.add_column(column, justify="left" if column == "plan" else "right")
    for name, cost in choice.failures.items():
        how = "restart + half an interval" if cost.replica_groups == 1 else "one island's recovery + lost steps"
        table.add_row(name, f"{cost.per_failure_s:.3g} s ({how})", f"{cost.checkpoint_interval_s:.3g} s",
                      f"{cost.lost_fraction:.2%}", f"{cost.goodput_tokens_per_s:,.0f}")
    return table


def print_islands(choice: Any, cluster: Any) -> None:
    from plait.report.console import output_console

    console = output_console()
    console.print(options_table(choice, cluster))
    console.print(Text.assemble(("chosen: ", "bold"), f"{choice.chosen.describe()}: {choice.why}"))
    if choice.failures:
        console.print(failures_table(choice))


def print_replica_groups(rows: list) -> None:
    """The run as one job or as torchft replica groups, priced with failures; the best (first) starred."""
    from plait.report.console import output_console

    table = Table(title="with failures: one job, or replica groups that fail and recover alone "
                        f"(mean time between failures of the run: {rows[0].failure.mtbf_s / 3600:.3g} h)")
    for column in ("", "replica groups", "devices each", "tokens/s", "a failure costs", "checkpoint every", "lost",
                   "goodput tokens/s"):
        table.add_column(column, justify="left" if column in ("", "replica groups") else "right")
    for i, row in enumerate(rows):
        how = "restart" if row.count == 1 else "recovery"
        table.add_row("*" if i == 0 else "", "1 (one job)" if row.count == 1 else str(row.count),
                      str(row.group_devices), f"{row.tokens_per_s:,.0f}",
                      f"{row.failure.per_failure_s:.3g} s ({how})", f"{row.failure.checkpoint_interval_s:.3g} s",
                      f"{row.failure.lost_fraction:.2%}", f"{row.failure.goodput_tokens_per_s:,.0f}")
    output_console().print(table)
