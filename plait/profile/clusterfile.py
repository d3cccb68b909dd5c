"""Write and read the cluster file `plait profile` produces, and check it fits the run in hand.

The file is plain YAML with exactly the `ClusterSpec` fields (so `plait plan --cluster FILE` and
`ClusterSpec.from_dict(yaml.safe_load(...))` read it), preceded by comment lines that say what was
measured, where and when. It is written atomically: a temporary file in the same folder, fsynced,
then renamed over the target, so a profile that fails or is killed part-way leaves either the old
file or none, never half of one.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml

from plait.errors import ConfigError
from plait.spec.cluster import ClusterSpec


def render_cluster_yaml(cluster: ClusterSpec, comments: Iterable[str] = ()) -> str:
    """The file's text: '# ' comment lines, then the ClusterSpec fields in declaration order."""
    header = "".join(f"# {line}".rstrip() + "\n" for line in comments)
    return header + yaml.safe_dump(cluster.to_dict(), sort_keys=False, default_flow_style=False)


def write_cluster_file(path: str | os.PathLike, cluster: ClusterSpec, comments: Iterable[str] = ()) -> Path:
    """Atomically write `cluster` to `path` (missing parent folders are created)."""
    target = Path(path)
    text = render_cluster_yaml(cluster, comments)
    # Never publish a file plait itself could not read back.
    if parse_cluster_text(text, str(target)) != cluster:
        raise ConfigError(f"{target}: the cluster file did not read back equal to what was measured: {cluster}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp_name, target)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    return target


def read_cluster_file(path: str | os.PathLike, *, require_all_fields: bool = True) -> ClusterSpec:
    """Read a cluster file, refusing (ConfigError naming the problem) a missing, malformed or incomplete one.

    With `require_all_fields` every ClusterSpec field, nested ones included, must be written out, as
    `plait profile` writes them: a file that silently falls back to a default for a measured figure
    would make the planner's predictions wrong without saying so.
    """
    source = Path(path)
    if not source.is_file():
        raise ConfigError(f"cluster file {str(source)!r} does not exist; write one with `plait profile --out {source}`")
    from plait.inputs import read_text

    return parse_cluster_text(read_text(source, "cluster file"), str(source), require_all_fields=require_all_fields)


def parse_cluster_text(text: str, source: str, *, require_all_fields: bool = True) -> ClusterSpec:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"cluster file {source}: malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"cluster file {source}: expected a mapping of ClusterSpec fields, got {type(data).__name__}")
    try:
        data = ClusterSpec.upgrade_dict(data)  # host-time keys an older plait wrote under `efficiency`
    except ConfigError as e:
        raise ConfigError(f"cluster file {source}: {e}") from None
    if require_all_fields:
        missing = missing_fields(ClusterSpec, data)
        if missing:
            raise ConfigError(f"cluster file {source}: missing field {missing[0]!r}; "
                              f"re-run `plait profile` or add it (fields: {', '.join(_field_names(ClusterSpec))})")
    try:
        return ClusterSpec.from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"cluster file {source}: {e}") from None


def missing_fields(cls: type, data: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the dataclass fields (recursively) that `data` does not set."""
    hints = typing.get_type_hints(cls)
    missing = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if f.name not in data and f.default is None:
            continue  # an optional refinement (a collective's own line): absent means none
        if f.name not in data:
            missing.append(name)
        elif dataclasses.is_dataclass(hints[f.name]) and isinstance(data[f.name], dict):
            missing += missing_fields(hints[f.name], data[f.name], f"{name}.")
    return missing


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def validate_cluster_for_world(cluster: ClusterSpec | str | os.PathLike, world_size: int, *,
                               device_type: str | None = None) -> ClusterSpec:
    """Refuse a cluster description that was not made for a run of `world_size` ranks.

    `cluster` is a ClusterSpec or the path of a cluster file (read strictly). `device_type`
    ("cuda" or "cpu"), when given, must match too: CPU figures say nothing about a GPU run.
    Returns the ClusterSpec so callers can write `cluster = validate_cluster_for_world(path, n)`.
    """
    source = "cluster"
    if not isinstance(cluster, ClusterSpec):
        source = f"cluster file {os.fspath(cluster)}"
        cluster = read_cluster_file(cluster)
    if cluster.num_devices != world_size:
        raise ConfigError(f"{source} describes num_devices={cluster.num_devices} but this run has "
                          f"{world_size} ranks; profile this world with `plait profile --nproc {world_size}`")
    if cluster.devices_per_node > cluster.num_devices:
        raise ConfigError(f"{source}: devices_per_node={cluster.devices_per_node} exceeds "
                          f"num_devices={cluster.num_devices}")
    if cluster.num_devices % cluster.devices_per_node:
        raise ConfigError(f"{source}: num_devices={cluster.num_devices} is not a whole number of nodes of "
                          f"devices_per_node={cluster.devices_per_node}")
    if device_type is not None and cluster.device_type != device_type:
        raise ConfigError(f"{source} was measured on device_type={cluster.device_type!r} but this run uses "
                          f"{device_type!r}; profile the devices in hand with `plait profile`")
    return cluster
