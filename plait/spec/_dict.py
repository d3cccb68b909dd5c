"""Build frozen spec dataclasses from plain dicts (JSON/YAML/TOML), with errors that name the key.

Every spec, the Plan and the run config round-trip through `to_dict` / `from_dict`, so a hand-written file and
a file written by plait are read by the same code. The conversion is cattrs' (generated per class, every error
of a value collected with its path); this module adds what plait's files need on top: strict scalars (a
string is not a number, 1.5 is not an integer, "yes" is not true), the readers some value types carry
(`from_plain`, `upgrade_dict`), and the first error as one line that names the key by its path and says what
would work.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any, Literal, TypeVar, get_args, get_origin

from plait.errors import ConfigError

T = TypeVar("T")


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain dict (tuples become lists), recursively."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # a field left at None where None is its default is an absent option: not written
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.default is None and getattr(obj, f.name) is None)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """Plain dict -> dataclass `cls`, converting nested dataclasses and tuples.

    Unknown keys, missing required keys and values of the wrong type raise ConfigError naming the key (with
    its path from `where`) and what would work.
    """
    try:
        return _converter().structure(data, cls)
    except Exception as error:  # noqa: BLE001 - every failure of a conversion becomes one line
        raise ConfigError(_first_error(error, where or cls.__name__)) from None


# ---- the converter ----------------------------------------------------------------------------------------
class _Unfit(ValueError):
    """A value of the wrong kind: its message says what would work."""


@cache
def _converter():
    import cattrs
    from cattrs.cols import homogenous_tuple_structure_factory, mapping_structure_factory
    from cattrs.gen import make_dict_structure_fn

    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    for tp, hook in _SCALARS.items():
        converter.register_structure_hook(tp, hook)
    converter.register_structure_hook_func(lambda tp: tp is Any, lambda value, _: value)
    converter.register_structure_hook_func(lambda tp: get_origin(tp) is Literal, _literal)
    converter.register_structure_hook_func(lambda tp: isinstance(tp, type) and hasattr(tp, "from_plain"),
                                           _from_plain)

    def sequence(tp):
        items = homogenous_tuple_structure_factory(tuple[(get_args(tp) or (Any,))[0], ...], converter)
        return _checked(items, (list, tuple), "a list")

    def mapping(tp):
        return _checked(mapping_structure_factory(tp, converter), dict, "a mapping")

    def dataclass(cls):
        fields = make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=True)

        def structure(value, _):
            if isinstance(value, cls):
                return value
            if hasattr(cls, "upgrade_dict"):  # keys an older plait wrote elsewhere (ClusterSpec's host times)
                value = cls.upgrade_dict(value)
            if not isinstance(value, dict):
                raise _Unfit(f"expected a mapping of fields, got {type(value).__name__} {value!r}")
            return fields(value, cls)

        return structure

    converter.register_structure_hook_factory(lambda tp: get_origin(tp) in (tuple, list), sequence)
    converter.register_structure_hook_factory(lambda tp: get_origin(tp) is dict, mapping)
    converter.register_structure_hook_factory(dataclasses.is_dataclass, dataclass)
    return converter


def _checked(hook, kinds, expected: str):
    def structure(value, tp):
        if not isinstance(value, kinds):
            raise _Unfit(f"expected {expected}, got {value!r}")
        return hook(value, tp)

    return structure


def _int(value: Any, _) -> int:
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        raise _Unfit(f"expected an integer, got {value!r}")
    return int(value)


def _float(value: Any, _) -> float:
    if isinstance(value, bool):
        raise _Unfit(f"expected a number, got {value!r}")
    try:
        return float(value)  # YAML reads 1e9 without a dot as a string
    except (TypeError, ValueError):
        raise _Unfit(f"expected a number, got {value!r}") from None


def _bool(value: Any, _) -> bool:
    if not isinstance(value, bool):
        raise _Unfit(f"expected true or false, got {value!r}")
    return value


def _str(value: Any, _) -> str:
    if not isinstance(value, str):
        raise _Unfit(f"expected a string, got {value!r}")
    return value


_SCALARS = {int: _int, float: _float, bool: _bool, str: _str}


def _literal(value: Any, tp: Any) -> Any:
    if value not in get_args(tp):
        raise _Unfit(f"{value!r} is not one of {', '.join(map(repr, get_args(tp)))}")
    return value


def _from_plain(value: Any, tp: Any) -> Any:
    """A value type with its own reader (Degrees)."""
    return tp.from_plain(value)


# ---- the first error, as one line -------------------------------------------------------------------------
def _first_error(error: BaseException, where: str) -> str:
    """The one line a user reads: unknown keys first (a misspelt key explains the rest), then the first failing
    value in field order, named by its path."""
    leaves = list(_leaves(error, where))
    unknown = [(path, leaf) for path, leaf in leaves if _is_unknown_keys(leaf)]
    path, leaf = (unknown or leaves)[0]
    if _is_unknown_keys(leaf):
        known = sorted(f.name for f in dataclasses.fields(leaf.cl) if f.init)
        return f"{path}: unknown key {sorted(leaf.extra_fields)[0]!r}; known keys: {', '.join(known)}"
    if isinstance(leaf, ConfigError):  # a spec's own check says it whole
        return str(leaf)
    parent, _, name = path.rpartition(".")
    if isinstance(leaf, KeyError) and parent:
        return f"{parent}: missing required key {name!r}"
    return f"{path}: {leaf}"


def _leaves(error: BaseException, path: str) -> typing.Iterator[tuple[str, BaseException]]:
    from cattrs.errors import AttributeValidationNote, IterableValidationNote

    if not isinstance(error, BaseExceptionGroup) or _is_unknown_keys(error):
        yield path, error
        return
    for inner in error.exceptions:
        here = path
        for note in getattr(inner, "__notes__", ()):
            if isinstance(note, AttributeValidationNote):
                here = f"{path}.{note.name}"
            elif isinstance(note, IterableValidationNote):
                here = f"{path}[{note.index!r}]" if isinstance(note.index, int) else f"{path}.{note.index}"
        yield from _leaves(inner, here)


def _is_unknown_keys(error: BaseException) -> bool:
    from cattrs.errors import ForbiddenExtraKeysError

    return isinstance(error, ForbiddenExtraKeysError)
