"""Every private torch name plait uses is named in plait/torch_internals.py, resolves in the installed torch, and is
reached from nowhere else: a torch that moved one fails here, naming it."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from plait import torch_internals
from plait.torch_internals import PRIVATE, PRIVATE_ATTRIBUTES, PRIVATE_METHODS, PRIVATE_OPS

PACKAGE = Path(__file__).resolve().parents[2] / "plait"


@pytest.mark.parametrize("name", sorted(PRIVATE))
def test_each_private_name_resolves_in_the_installed_torch(name):
    assert torch_internals.resolve(name) is not None
    assert getattr(torch_internals, name) is torch_internals.resolve(name)


@pytest.mark.parametrize("name", sorted(PRIVATE_OPS))
def test_each_private_op_resolves(name):
    assert callable(torch_internals.op(name))


@pytest.mark.parametrize("owner", sorted({**PRIVATE_METHODS, **PRIVATE_ATTRIBUTES}))
def test_each_private_member_is_where_plait_reaches_for_it(owner):
    cls = getattr(importlib.import_module(owner[0]), owner[1])
    members = PRIVATE_METHODS.get(owner, ()) + PRIVATE_ATTRIBUTES.get(owner, ())
    missing = [m for m in members if not hasattr(cls, m) and not _sets(cls, m)]
    assert not missing, f"{owner[0]}.{owner[1]} has no {missing}"


def _sets(cls, member: str) -> bool:
    """An instance attribute: the class's own code sets it."""
    source = inspect.getsource(cls)
    return any(f"self.{member}{tail}" in source for tail in (" =", ": ", "="))


def test_the_functional_collectives_and_caches_work():
    assert callable(torch_internals.c10d_functional().all_reduce)
    torch_internals.clear_sharding_caches()  # every cache it clears exists


def test_a_name_torch_moved_is_refused_naming_it(monkeypatch):
    monkeypatch.setitem(PRIVATE, "gone", ("torch.utils._pytree", "no_such_function"))
    with pytest.raises(ImportError, match=r"torch .* has no torch\.utils\._pytree\.no_such_function"):
        torch_internals.resolve("gone")


def private_uses(path: Path) -> list[str]:
    """What `path` reaches in torch's private names: imports of private modules or names, and attribute chains
    from `torch` (or a name imported from torch) through a private member."""
    tree = ast.parse(path.read_text(), str(path))
    from_torch, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            private = [a.name for a in node.names if a.name.startswith("_")]
            if any(part.startswith("_") for part in node.module.split(".")) or private:
                found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
            from_torch |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and any(p.startswith("_") for p in a.name.split("."))]
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:  # each whole chain once
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and (base.id == "torch" or base.id in from_torch):
                if any(part.startswith("_") and not part.startswith("__") for part in chain):
                    found.append(f"{path.name}:{node.lineno} {base.id}.{'.'.join(reversed(chain))}")
    return sorted(set(found))


def test_no_other_module_reaches_into_torchs_private_names():
    broken = [f"{path.relative_to(PACKAGE.parent)}: {use}" for path in sorted(PACKAGE.rglob("*.py"))
              if path.name != "torch_internals.py" for use in private_uses(path)]
    assert not broken, "\n".join(broken) + "\n(name them in plait/torch_internals.py and import them from there)"


def test_the_check_sees_each_kind_of_private_use(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nfrom torch.utils._pytree import tree_map\nfrom torch.distributed.tensor import DTensor\n"
                     "def f():\n    import torch._dynamo\n    DTensor._op_dispatcher\n    torch.ops.aten._to_copy.default\n")
    uses = private_uses(probe)
    assert [u.split(" ", 1)[1] for u in uses] == ["from torch.utils._pytree import ...", "import torch._dynamo",
                                                  "DTensor._op_dispatcher", "torch.ops.aten._to_copy.default"]
