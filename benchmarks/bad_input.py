"""Bad input, measured: run the property-based bad-input suite with many examples and print how
many malformed inputs each entry point refused cleanly (one-line PlaitError / exit code 2, no
traceback) with the checkpoint directory unchanged (SHA-256 of every file, checked per case).

    .venv/bin/python benchmarks/bad_input.py [--examples 300]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

SUITE = Path(__file__).resolve().parent.parent / "tests" / "unit" / "test_bad_input.py"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300, help="hypothesis examples per property")
    args = parser.parse_args()
    report = Path(tempfile.mkstemp(suffix=".json")[1])
    env = {**os.environ, "PLAIT_BAD_INPUT_EXAMPLES": str(args.examples), "PLAIT_BAD_INPUT_REPORT": str(report)}
    result = subprocess.run([sys.executable, "-m", "pytest", str(SUITE), "-q", "-p", "no:cacheprovider"], env=env)
    counts = json.loads(report.read_text() or "{}")
    report.unlink()
    table = Table(title=f"bad input: {args.examples} examples per property")
    table.add_column("entry point / input")
    table.add_column("cases refused cleanly", justify="right")
    for kind, count in sorted(counts.items()):
        table.add_row(kind, str(count))
    table.add_row("[bold]total", f"[bold]{sum(counts.values())}")
    console = Console()
    console.print(table)
    verdict = "nothing lost: the checkpoint directory was unchanged after every case" if result.returncode == 0 \
        else "FAILED: see the pytest output above"
    console.print(verdict)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
