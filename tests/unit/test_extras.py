"""Optional extras: one table (plait.extras) agrees with pyproject.toml, and a missing package is refused in one
line that names the extra to install."""
import re
import tomllib
from pathlib import Path

import pytest

from plait import extras
from plait.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_every_extra_plait_names_is_declared_in_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, module in extras.EXTRAS.items():
        assert extra in declared, extra
        assert any(re.match(rf"{module}\b", req) for req in declared[extra]), (extra, declared[extra])
    named = set()
    for path in (ROOT / "plait").rglob("*.py"):  # every `pip install 'plait[X]'` a message or docstring names
        if path.name == "extras.py":
            continue
        named |= set(re.findall(r"plait\[(\w+)\]", path.read_text()))
    assert named <= set(declared), named - set(declared)
    # the test suite runs every feature: dev installs every extra's packages
    dev = " ".join(declared["dev"])
    for extra in extras.EXTRAS:
        for req in declared[extra]:
            assert req in dev, (extra, req)


def test_a_missing_package_is_refused_with_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(extras.EXTRAS, "lora", "plait_no_such_package")
    with pytest.raises(ConfigError) as e:
        extras.require("lora", "checkpoint.export_adapter", "export the merged model instead")
    message = str(e.value)
    assert "checkpoint.export_adapter" in message and "pip install 'plait[lora]'" in message
    assert message.endswith("or export the merged model instead") and "\n" not in message


def test_an_installed_package_passes():
    extras.require("auto", "per-operator sharding")  # scipy is a dev dependency
