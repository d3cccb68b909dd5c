"""The rules between plait's folders (docs/architecture.md): the planner never imports the executor, and the
executor never imports the search; the Plan is the door between them. Read from the source, imports inside
functions included, so a lazy import cannot slip past."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "plait"

# the rooms that plan: they read models on `meta` and price them, never run them
PLANNING = ("spec", "cost", "search", "plan", "legality", "axes", "models", "operators")
RUNNING = ("execute", "train", "launch", "commands", "profile", "cli")
FORBIDDEN = {**{room: RUNNING for room in PLANNING}, "execute": ("search",)}


def imported_rooms(path: Path) -> set[tuple[str, int]]:
    """(room, line) of every `plait.<room>` this file imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names if node.module == "plait"]
        else:
            continue
        found |= {(name.split(".")[1], node.lineno) for name in names if name.startswith("plait.")}
    return found


def room_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def test_every_room_in_the_rules_exists():
    rooms = {room_of(p) for p in PACKAGE.rglob("*.py")}
    assert set(FORBIDDEN) | set(RUNNING) <= rooms


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_only_what_it_may(room):
    files = sorted(p for p in PACKAGE.rglob("*.py") if room_of(p) == room)
    assert files, room
    broken = [f"{p.relative_to(PACKAGE.parent)}:{line} imports plait.{other}"
              for p in files for other, line in sorted(imported_rooms(p)) if other in FORBIDDEN[room]]
    assert not broken, "\n".join(broken)


def test_the_check_sees_a_lazy_import(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from plait.execute.parallelize import Runner\n    import plait.train.loop\n")
    assert imported_rooms(source) == {("execute", 2), ("train", 3)}
