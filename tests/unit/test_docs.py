"""The map stays true: every repository path the code, README, docs and benchmarks cite exists, every docs page is
reachable from the index, the presets, plan-file and config pages name every preset and key, the import rules of
docs/architecture.md hold, the benchmark tables are in step with their commands, and the changelog's newest release
is the package's version."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP_DIRS = ("plait", "tests", "benchmarks", "examples", "docs", ".ci")
TOP_FILES = ("README.md", "CHANGELOG.md", "Makefile", "pyproject.toml")
PLAIN_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./{},-]*\.(?:py|md|toml|yaml|json|txt|npz))" %
                        "|".join(re.escape(d) for d in TOP_DIRS))
BACKQUOTED = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _load_check_tables():
    spec = importlib.util.spec_from_file_location("check_tables", ROOT / "benchmarks" / "check_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", pattern], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def pages() -> list[Path]:
    """The markdown a user or contributor reads (the changelog is history and may name what is gone)."""
    return [p for p in tracked("*.md") if p.name != "CHANGELOG.md" and "results" not in p.parts]


def expand(path: str) -> list[str]:
    """`examples/operators/{mlp,vit}.py` -> both paths."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [p for option in match.group(1).split(",") for p in expand(path[:match.start()] + option +
                                                                     path[match.end():])]


def cited_paths(text: str, markdown: bool) -> set[str]:
    """Repository paths a text cites: plain paths with a file suffix, and (in markdown) any backquoted path under
    a top-level folder or naming a top-level file."""
    found = set(PLAIN_PATH.findall(text))
    if markdown:
        for quoted in BACKQUOTED.findall(text):
            head = quoted.split("/", 1)[0]
            if (head in TOP_DIRS and "/" in quoted) or quoted in TOP_FILES:
                found.add(quoted)
    out = set()
    for path in found:
        path = re.split(r"::|:|#", path)[0].rstrip(".,;)")
        if any(c in path for c in "<>*") or "..." in path:
            continue
        out.update(expand(path))
    return out


def test_every_cited_repository_path_exists():
    missing = []
    for source in [*tracked("*.py"), *pages()]:
        text = source.read_text(errors="replace")
        for path in cited_paths(text, markdown=True):
            if not (ROOT / path).exists():
                missing.append(f"{source.relative_to(ROOT)} cites {path}")
    assert not missing, "\n".join(missing)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def links(page: Path) -> list[tuple[str, str]]:
    """(target path, anchor) of each relative markdown link of a page, code blocks left out."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        out.append((path, anchor))
    return out


def test_every_markdown_link_and_anchor_resolves():
    broken = []
    for page in pages():
        for path, anchor in links(page):
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)} links {path}, which does not exist")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                broken.append(f"{page.relative_to(ROOT)} links {path}#{anchor}: no such heading")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_index():
    index = ROOT / "docs" / "README.md"
    seen, todo = {index}, [index]
    while todo:
        page = todo.pop()
        for path, _ in links(page):
            target = (page.parent / path).resolve() if path else page
            if target.suffix == ".md" and target.is_relative_to(ROOT / "docs") and target not in seen:
                seen.add(target)
                todo.append(target)
    unreachable = [p.relative_to(ROOT) for p in (ROOT / "docs").glob("**/*.md") if p.resolve() not in seen]
    assert not unreachable, f"docs pages no link from docs/README.md reaches: {unreachable}"


def names_in_first_column(markdown: str) -> set[str]:
    return set(re.findall(r"^\| `([\w.-]+)` \|", markdown, flags=re.M))


def test_the_presets_page_names_every_preset_and_no_other():
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.spec.models import MODEL_PRESETS

    text = (ROOT / "docs" / "presets.md").read_text()
    model_part, cluster_part = text.split("## Cluster presets")
    assert names_in_first_column(model_part) == set(MODEL_PRESETS)
    assert names_in_first_column(cluster_part) == set(CLUSTER_PRESETS)


def test_the_plan_file_page_names_every_key_of_a_plan():
    import dataclasses

    from plait.plan import LAYOUT_FIELDS, Plan, Prediction

    rows = re.findall(r"^\| (`[^|]+) \|", (ROOT / "docs" / "plan-file.md").read_text(), flags=re.M)
    keys = {key for row in rows for key in re.findall(r"`([\w.]+)`", row)}
    # a plan file spells its layout's fields at the top level, beside the plan's own
    file_keys = set(LAYOUT_FIELDS) | {f.name for f in dataclasses.fields(Plan)} - {"layout"}
    assert {k for k in keys if "." not in k} == file_keys
    assert {k.removeprefix("predicted.") for k in keys if k.startswith("predicted.")} == {
        f.name for f in dataclasses.fields(Prediction)}


def test_the_config_page_names_every_key_of_every_section():
    import dataclasses

    from plait.train.config import Config

    rows = re.findall(r"^\| `\[(\w+)\]` \| ([^|]+) \|", (ROOT / "docs" / "config.md").read_text(), flags=re.M)
    on_page = {section: set(re.findall(r"`(\w+)`", keys)) for section, keys in rows}
    in_code = {f.name: {g.name for g in dataclasses.fields(f.default_factory)} for f in dataclasses.fields(Config)}
    assert on_page == in_code


def test_the_errors_page_names_every_environment_variable():
    """Every PLAIT_* name the code reads as a string ("PLAIT_X") or sets (PLAIT_X=...) is in the page's table."""
    in_code = {name for path in (ROOT / "plait").glob("**/*.py")
               for name in re.findall(r"[\"\s](PLAIT_[A-Z_]*[A-Z])(?:\"|=)", path.read_text())}
    on_page = set(re.findall(r"^\| `(PLAIT_\w+)", (ROOT / "docs" / "errors.md").read_text(), flags=re.M))
    assert in_code and on_page == in_code


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def never_imports() -> dict[str, set[str]]:
    """docs/architecture.md's table of who never imports whom (the page owns the rule; tests hold the code to it)."""
    rows = re.findall(r"^\s*\| `(\w+)` \| ((?:`\w+`(?:, )?)+) \|$", ARCHITECTURE.read_text(), flags=re.M)
    return {folder: set(re.findall(r"`(\w+)`", forbidden)) for folder, forbidden in rows}


def torch_free() -> list[str]:
    """The paths docs/architecture.md says import no torch at module level."""
    line = re.search(r"\*\*The planner is pure Python\.\*\*(.*?)import no torch", ARCHITECTURE.read_text(), flags=re.S)
    return re.findall(r"`(plait/[\w./]+)`", line.group(1))


def test_the_architecture_page_states_the_rules_the_tests_hold():
    assert set(never_imports()) == {"spec", "cost", "search", "models", "hf", "execute", "runtime", "report"}
    assert "execute" in never_imports()["cost"] and "search" in never_imports()["execute"]
    assert "train" in never_imports()["hf"] and "execute" in never_imports()["runtime"]
    assert {"plait/spec", "plait/cost", "plait/search", "plait/plan.py"} <= set(torch_free())


def plait_imports(path: Path, rel: Path | None = None) -> list[tuple[str, bool]]:
    """(imported module, whether at module level) of every import in a file; relative imports resolved from the
    file's place in the repository (`rel`, default its own)."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    package = (rel or path.relative_to(ROOT)).with_suffix("").parts[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            names = [".".join(base + ([node.module] if node.module else []))]
        else:
            continue
        out += [(name, id(node) in top_level) for name in names]
    return out


def forbidden_imports(folder: str, path: Path, rel: Path | None = None) -> list[str]:
    found = []
    for name, _ in plait_imports(path, rel):
        parts = name.split(".")
        if parts[0] == "plait" and len(parts) > 1 and parts[1] in never_imports()[folder]:
            found.append(f"{rel or path.relative_to(ROOT)} imports {name}")
    return found


def test_the_folders_import_only_what_the_map_allows():
    broken = [line for folder in never_imports() for path in (ROOT / "plait" / folder).glob("*.py")
              for line in forbidden_imports(folder, path)]
    assert not broken, "\n".join(broken)


def test_the_planner_imports_no_torch_at_module_level():
    heavy = []
    for entry in torch_free():
        target = ROOT / entry
        for path in ([target] if target.is_file() else target.glob("*.py")):
            heavy += [f"{path.relative_to(ROOT)} imports {name}" for name, top in plait_imports(path)
                      if top and name.split(".")[0] in ("torch", "transformers")]
    assert not heavy, "\n".join(heavy)


def test_a_lazy_relative_import_of_the_executor_is_found(tmp_path):
    """The rule's reader sees imports inside functions and relative ones: a check that could not fail is none."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..execute import parallelize\n    import plait.train.loop\n")
    rel = Path("plait", "cost", "probe.py")  # as if it lived in the cost model
    assert forbidden_imports("cost", probe, rel) == [f"{rel} imports plait.execute", f"{rel} imports plait.train.loop"]


# ---- the benchmark tables ----------------------------------------------------------------------------------

def test_every_benchmark_table_is_in_step_with_its_command():
    problems = _load_check_tables().check()
    assert not problems, "\n".join(problems) + "\n(python benchmarks/check_tables.py --write re-renders them)"


def test_a_table_out_of_step_is_found():
    """Tamper with one cell of the H200 grid as the page has it: the check names the row."""
    ct = _load_check_tables()
    lines = (ROOT / "benchmarks" / "README.md").read_text().split("\n")
    first, end = next((a, b) for a, b in ct.tables(lines) if (ct.marker_before(lines, a) or {}).get("id") ==
                      "gpu-h200-grid")
    table = lines[first:end]
    values = ct.cells(table[2])
    values[3] = str(int(values[3]) + 1)  # one predicted millisecond more
    tampered = [table[0], table[1], ct.row_text(values), *table[3:]]
    fn, whole, key = ct.RENDERERS["gpu-h200-grid"]
    problems, fixed = ct._compare("gpu-h200-grid", Path("page"), tampered, fn(), whole, key)
    assert len(problems) == 1 and " / ".join(values[:3]) in problems[0]
    assert fixed == table  # --write puts the rendered row back


def test_an_unmarked_benchmark_table_is_refused(tmp_path):
    ct = _load_check_tables()
    (tmp_path / "benchmarks").mkdir()
    page = ("# B\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
            '<!-- table id="x" command="python benchmarks/' 'nowhere.py" results="benchmarks/results/nothing" -->\n\n'
            "| c |\n|---|\n| 3 |\n")
    (tmp_path / "benchmarks" / "README.md").write_text(page)
    problems = ct.check(root=tmp_path, render=False)
    assert any("line 3 has no marker" in p for p in problems)
    assert any("nowhere.py, which does not exist" in p for p in problems)
    assert any("benchmarks/results/nothing does not exist" in p for p in problems)


# ---- the version ----------------------------------------------------------------------------------------

def newest_release(changelog: str) -> str:
    """The first `## [X.Y.Z]` heading of a Keep a Changelog file (Unreleased is not a release)."""
    for match in re.finditer(r"^## \[([^\]]+)\]", changelog, flags=re.M):
        if match.group(1).lower() != "unreleased":
            return match.group(1)
    raise AssertionError("CHANGELOG.md has no released version")


def test_the_changelog_newest_release_is_the_package_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert newest_release((ROOT / "CHANGELOG.md").read_text()) == project
    from plait.cli import version

    assert version() == project
    result = subprocess.run([sys.executable, "-m", "plait", "--version"], cwd=ROOT, capture_output=True, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": ""}, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"plait {project}"


def test_the_changelog_keeps_a_changelog():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(r"^## \[Unreleased\]", text, flags=re.M)
    kinds = set(re.findall(r"^### (\w+)", text, flags=re.M))
    assert kinds and kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    for word in (r"[Ss]top \d+", r"helpers?", r"sessions?", r"lent"):
        found = re.search(rf"\b{word}\b", text)
        assert not found, f"CHANGELOG.md speaks of how the work was organised: {found.group(0)!r}"
