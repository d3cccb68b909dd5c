"""The `plait` command: parse, call, print. Each subcommand lives in plait/commands/<name>.py
with `add_arguments(parser)` (cheap: no torch import) and `main(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

from plait.errors import Interrupted, PlaitError
from plait.runtime.launch import is_local_worker, note_failure, quiet_worker_interrupts

COMMANDS: dict[str, str] = {
    "plan": "rank parallel plans for a model on a cluster (cost model + search)",
    "train": "train a model from a TOML config with a plan (local processes or torchrun)",
    "check": "prove a plan computes what one process computes (losses and parameters)",
    "demo": "plan for this machine and train a small GPT on a shipped text",
    "profile": "measure this machine's devices and links and write a cluster file",
    "tune": "run the top plans, compare predicted and measured step time, correct the cost model",
    "solver": "train the learned solver offline against the cost model",
    "export": "write a checkpoint of a Hugging Face model as a folder from_pretrained loads",
    "generate": "sample text from a checkpoint or a Hugging Face folder (greedy, temperature, top-p)",
}


class OneLineParser(argparse.ArgumentParser):
    """Argument mistakes print the one line that matters and where the usage is, not the usage block first."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version() -> str:
    """The package's version: the pyproject.toml of the source tree plait runs from (a checkout on PYTHONPATH may
    be another version than the one installed), else the installed distribution's metadata."""
    import tomllib
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (OSError, ValueError):  # an installed package: no pyproject.toml beside it
        project = {}
    if project.get("name") == "plait" and project.get("version"):
        return project["version"]
    try:
        return installed("plait")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="plait",
        description="Plan and run hybrid-parallel (DP/ZeRO/FSDP x TP/SP x PP x recompute) training for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"plait {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"plait.commands.{name}")
        sub_parser = sub.add_parser(name, help=help_text, description=module.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    quiet_worker_interrupts()  # a rank of `run_local`: its launcher owns Ctrl-C
    args = build_parser().parse_args(argv)
    try:
        return int(args._module.main(args) or 0)
    except PlaitError as e:
        note_failure(e)  # under run_local, tells the launcher this rank failed first
        print(f"plait {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        if not is_local_worker():  # the launcher prints the one line
            detail = f"; {e}" if isinstance(e, Interrupted) and str(e) else ""
            print(f"plait {args.command}: interrupted{detail}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
