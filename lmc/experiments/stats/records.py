"""Typed records of the statistics over pairs, as ``summary.json`` holds them.

Each record's fields are the keys of its JSON object, in order: :func:`to_json` writes a record
as that object (a field that is ``None`` is left out: it was not measured) and
:meth:`Record.from_json` reads one back, so a run's files keep their layout and the report reads
records rather than nested string-keyed dicts.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

R = TypeVar("R", bound="Record")


def to_json(value: Any) -> Any:
    """A record (or a dict or list of them) as JSON data: each record an object of its fields in
    order, without those that are ``None``."""
    if dataclasses.is_dataclass(value):
        fields = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
        return {name: to_json(item) for name, item in fields if item is not None}
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [to_json(item) for item in value]
    return value


def _parsed(hint: Any, data: Any) -> Any:
    """``data`` read as the type ``hint`` names: a record, a dict or list of them, or a plain value."""
    if data is None:
        return None
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return _parsed(next(a for a in arguments if a is not type(None)), data)
    if origin is dict:
        return {key: _parsed(arguments[1], item) for key, item in data.items()}
    if origin is list:
        return [_parsed(arguments[0], item) for item in data]
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_json(data)
    return data


class Record:
    """A record of :func:`to_json`'s layout; subclasses are frozen dataclasses."""

    @classmethod
    def from_json(cls: type[R], data: dict[str, Any]) -> R:
        """The record of a JSON object (keys it lacks are ``None``: not measured)."""
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: _parsed(hints[f.name], data.get(f.name)) for f in dataclasses.fields(cls)})
