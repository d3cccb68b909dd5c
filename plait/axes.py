"""The parallel axes of a plan, in one place: their names, their order on the device mesh, and the
degrees a plan gives them.

    Degrees(dp=2, tp=4, pp=8)            # any axis left out has degree 1
    degrees["tp"], degrees.world_size    # 4, 64
    degrees.replace(cp=2)                # a new mapping

A new dimension is one entry of `AXES` (with what it means below); the Plan, the cost model's
layout, the search's pins and the executor's mesh all read the degrees through this mapping.

Mesh order, outermost first (``rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank``):

* ``pp``: pipeline stages. Outermost: point-to-point traffic is the lightest and tolerates the slow
  links between nodes.
* ``dp``: data-parallel replicas (or shards under ZeRO / FSDP).
* ``cp``: context parallelism: each rank of a group holds a slice of every sequence.
* ``tp``: tensor parallelism. Innermost: its per-layer collectives need the fastest links, so its
  groups are adjacent ranks, inside a node.

``ep`` (expert parallelism) is not a factor of the world size: it splits each data-parallel group
(``ep`` divides ``dp``), whose ranks then hold different experts of every mixture-of-experts layer
and exchange tokens with all-to-alls (DeepSpeed-MoE's and Megatron's layout).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
"""The axes whose degrees multiply to the world size, outermost first on the mesh."""
SUB_AXES: dict[str, str] = {"ep": "dp"}
"""Axes that split another axis (ep's degree divides dp's)."""
ALL_AXES: tuple[str, ...] = AXES + tuple(SUB_AXES)
AXIS_MEANING: dict[str, str] = {
    "pp": "pipeline-parallel degree (stages per pipeline)",
    "dp": "data-parallel degree (replicas, or shards under ZeRO)",
    "cp": "context-parallel degree (slices of each sequence)",
    "tp": "tensor-parallel degree (Megatron-style, inside a node unless allowed otherwise)",
    "ep": "expert-parallel degree (ranks of a data-parallel group holding different experts; divides dp)",
}


class OnAxes:
    """`x.pp`, `x.dp`, `x.cp`, `x.tp`, `x.ep`: the degree of each axis, read through `x.axis(name)` (by default
    `x.degrees[name]`). The one place these accessors are written: Degrees, the Layout, the Plan and the
    search's Pins all take them from here."""

    __slots__ = ()

    def axis(self, name: str) -> Any:
        return self.degrees[name]  # type: ignore[attr-defined]


def _axis_reader(axis: str) -> property:
    return property(lambda self: self.axis(axis), doc=AXIS_MEANING[axis])


for _axis in ALL_AXES:
    setattr(OnAxes, _axis, _axis_reader(_axis))


class Degrees(OnAxes, Mapping[str, int]):
    """Degree of every parallel axis (1 where not given); immutable, hashable, ordered as `ALL_AXES`."""

    __slots__ = ("_values",)

    def axis(self, name: str) -> int:
        return self._values[name]

    def __init__(self, values: Mapping[str, int] | None = None, /, **degrees: int) -> None:
        merged = dict(values or {})
        merged.update(degrees)
        unknown = sorted(set(merged) - set(ALL_AXES))
        if unknown:
            raise ValueError(f"unknown parallel axis {unknown[0]!r}; axes: {', '.join(ALL_AXES)}")
        out = {}
        for axis in ALL_AXES:
            value = merged.get(axis, 1)
            if value is None:
                value = 1
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{axis}={value!r} must be a positive integer")
            out[axis] = value
        for sub, parent in SUB_AXES.items():
            if out[parent] % out[sub]:
                raise ValueError(f"{sub}={out[sub]} must divide {parent}={out[parent]}")
        object.__setattr__(self, "_values", out)

    # ---- mapping -------------------------------------------------------------------------
    def __getitem__(self, axis: str) -> int:
        return self._values[axis]

    def __iter__(self) -> Iterator[str]:
        return iter(ALL_AXES)

    def __len__(self) -> int:
        return len(ALL_AXES)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Degrees is immutable; use .replace(...)")

    def __hash__(self) -> int:
        return hash(tuple(self._values.values()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Degrees):
            return self._values == other._values
        if isinstance(other, Mapping):
            try:
                return self._values == Degrees(other)._values
            except ValueError:
                return False
        return NotImplemented

    def __repr__(self) -> str:
        shown = ", ".join(f"{a}={v}" for a, v in self._values.items() if v != 1) or "1"
        return f"Degrees({shown})"

    # ---- derived -----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        size = 1
        for axis in AXES:
            size *= self._values[axis]
        return size

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes of `AXES` in mesh order."""
        return tuple(self._values[a] for a in AXES)

    def stride(self, axis: str) -> int:
        """Distance in rank between neighbours along `axis` (1 for the innermost)."""
        inner = AXES[AXES.index(axis) + 1:]
        stride = 1
        for a in inner:
            stride *= self._values[a]
        return stride

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits on each mesh axis."""
        out = {}
        for axis in reversed(AXES):
            out[axis] = rank % self._values[axis]
            rank //= self._values[axis]
        return {a: out[a] for a in AXES}

    def replace(self, **changes: int) -> "Degrees":
        return Degrees(self._values, **changes)

    def to_dict(self) -> dict[str, int]:
        """Every axis, in order (what a plan file holds)."""
        return dict(self._values)

    def describe(self) -> str:
        """'dp2 tp4 pp8' plus any other axis above 1 ('cp2', 'ep4')."""
        always = ("dp", "tp", "pp")
        parts = [f"{a}{self._values[a]}" for a in always]
        parts += [f"{a}{v}" for a, v in self._values.items() if a not in always and v > 1]
        return " ".join(parts)

    def product_label(self) -> str:
        """'2×4×8' over dp×tp×pp, with ×cp / ×ep appended where above 1 (for table cells)."""
        label = "×".join(str(self._values[a]) for a in ("dp", "tp", "pp"))
        extra = [f"{a}{v}" for a, v in self._values.items() if a in ("cp", "ep") and v > 1]
        return label + (" " + " ".join(extra) if extra else "")

    @classmethod
    def from_plain(cls, value: Any) -> "Degrees":
        """From a plan file's mapping {"dp": 2, "tp": 4, ...}."""
        if isinstance(value, Degrees):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"expected a mapping of axis -> degree such as {{\"dp\": 2, \"tp\": 4}}, got {value!r}")
        return cls(value)
