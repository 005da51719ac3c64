"""Host helpers of every kernel's ``Tiles`` dataclass: int field checks and the tuning-hook override (imports nothing)."""

from __future__ import annotations

import dataclasses


def check_int_fields(obj) -> None:
    """Raise TypeError naming the first field of the dataclass ``obj`` that is not an int (a bool is not one:
    the object is part of a compile key, where ``4``, ``4.0`` and ``True`` differ)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{f.name} must be an int, got {v!r}")


def override_int_fields(tiles, items: dict[str, str]):
    """``tiles`` (a frozen dataclass of int fields) with the fields named in ``items`` (field name -> decimal
    text) replaced; ValueError naming the key for an unknown field or a value that is not an integer."""
    names = tuple(f.name for f in dataclasses.fields(tiles))
    new = {}
    for key, text in items.items():
        if key not in names:
            raise ValueError(f"{key!r} is not a field of {type(tiles).__module__}.Tiles (fields: {', '.join(names)})")
        try:
            new[key] = int(text)
        except (TypeError, ValueError):
            raise ValueError(f"{key} takes an integer, got {text!r}") from None
    return dataclasses.replace(tiles, **new)
