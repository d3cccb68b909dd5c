"""The console every command prints tables to: a terminal's own width, or a wide one when piped.

Off a terminal (CI logs, tests, `| less`, a file) rich would assume 80 columns and cut table cells
("intra_no…", "19.…"); nobody will resize that output, so it gets PIPED_WIDTH columns instead and every
table prints whole. On a terminal, tables that would not fit fold themselves (plait.report.tables).
"""

from __future__ import annotations

from rich.console import Console

PIPED_WIDTH = 200


def output_console(stderr: bool = False) -> Console:
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=PIPED_WIDTH)
