"""Type checks of a dataclass's fields against their annotations, with errors naming the field.

Engine arguments and sampling parameters come from users (Python calls, CLI flags, JSON bodies):
`seed="x"` must fail with "EngineArgs.seed must be an integer, got 'x'", not with a bare
`int()` error deep in the engine. Only the outer type is checked here (an int, a list, a
dict...); the owners' own checks look at values and elements. Plain Python: no imports from the
package, nothing heavy.
"""

from __future__ import annotations

import dataclasses
import numbers

_NAMES = {
    "int": ("an integer", lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)),
    "bool": ("True or False", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "None": ("None", lambda v: v is None),
    "list": ("a list", lambda v: isinstance(v, (list, tuple))),
    "dict": ("a map", lambda v: isinstance(v, dict)),
    "set": ("a set", lambda v: isinstance(v, (set, frozenset))),
}


def _alternatives(annotation: str) -> list[str] | None:
    """The outer type names of an annotation such as 'list[str] | str | None', or None when one
    of them is not a plain type checked here (a class of the package: its owner checks it)."""
    names = []
    depth, start = 0, 0
    parts = []
    for i, ch in enumerate(annotation):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "|" and depth == 0:
            parts.append(annotation[start:i])
            start = i + 1
    parts.append(annotation[start:])
    for part in parts:
        name = part.strip().split("[", 1)[0].strip()
        if name not in _NAMES:
            return None
        names.append(name)
    return names


def check_field_types(obj: object, owner: str | None = None) -> None:
    """Raise `ValueError` naming the first field of dataclass `obj` whose value is not of its
    annotated type ('<owner>.<field> must be an integer or None, got 'x'.')."""
    owner = owner or type(obj).__name__
    for f in dataclasses.fields(obj):
        names = _alternatives(str(f.type))
        if names is None:
            continue
        value = getattr(obj, f.name)
        if not any(_NAMES[name][1](value) for name in names):
            expected = " or ".join(_NAMES[name][0] for name in names)
            raise ValueError(f"{owner}.{f.name} must be {expected}, got {value!r} ({type(value).__name__}).")


def json_object(value, name: str) -> dict:
    """A config given as a dict or as its JSON text (a CLI flag's value, as vLLM takes
    `--speculative-config` and `--pooler-config`), as a dict; a ValueError naming `name` else."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON ({exc}): {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (or its JSON text), got {type(value).__name__}.")
    return value
