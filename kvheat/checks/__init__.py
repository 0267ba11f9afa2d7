"""The one type check of every config dataclass (the tiers', the engine's, the server's
and the router's), driven by the fields' type hints, so a new field is checked as soon as
it is declared.

JSON, YAML and TOML give any type for any key: a string where a list belongs iterates as
characters, "false" is a true string, 64.5 blocks or an integer token fail far from the
config. So each value must be exactly its declared type, and the error names the key and
the value's type, never the value (it may be a secret).
"""

from __future__ import annotations

import math
import re
import types
import typing
from dataclasses import fields
from typing import Any


def check_fields(obj: Any, what: str = "", error: type[Exception] = ValueError,
                 skip: tuple[str, ...] = ()) -> None:
    """Raise `error` naming the first field of dataclass `obj` not of its declared type.

    See `type_ok`; the message is prefixed by `what` (e.g. "tenant 'acme'")."""
    hints = _hints(type(obj))
    for f in fields(obj):
        if f.name not in skip:
            check_value(getattr(obj, f.name), hints[f.name], f.name, what, error)


def check_value(value: Any, tp: Any, name: str, what: str = "",
                error: type[Exception] = ValueError) -> None:
    """Raise `error` unless `value` is of type `tp`.

    The message reads "[what: ]name must be <tp>, not <value's type>": it names the value's type,
    never the value (it may be a secret)."""
    if not type_ok(value, tp):
        raise error(f"{what + ': ' if what else ''}{name} must be {describe_type(tp)}, "
                    f"not {_what_is(value, tp)}")


def type_ok(value: Any, tp: Any) -> bool:
    """Whether `value` is of type hint `tp`.

    int: an int, never a bool; float: a finite int or float, never a bool; bool: True or
    False only; str; None; X | Y; list[X]; tuple[X, ...]; dict[K, V]; Any; any other
    class: an instance of it."""
    if tp is Any or tp is object:
        return True
    if tp is None or tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        return any(type_ok(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if origin is list:
        return isinstance(value, list) and all(type_ok(x, args[0]) for x in value)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(type_ok(x, args[0]) for x in value)
        return len(args) == len(value) and all(type_ok(x, a) for x, a in zip(value, args))
    if origin is dict:
        return isinstance(value, dict) and all(type_ok(k, args[0]) and type_ok(v, args[1])
                                               for k, v in value.items())
    if origin is not None:  # e.g. Callable[...]: the origin class only
        return isinstance(value, origin)
    return isinstance(value, tp)


def describe_type(tp: Any) -> str:
    """`tp` in words, for error messages: "an integer", "a list of strings", ..."""
    if tp is None or tp is type(None):
        return "null (unset)"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        parts = [describe_type(a) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return text + " (or unset)" if type(None) in args else text
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin is list or origin is tuple:
        return f"a list of {_plural(args[0])}"
    if origin is dict:
        return f"a table of {_plural(args[0])} to {_plural(args[1])}"
    return _NAMES.get(tp, (f"a {getattr(tp, '__name__', tp)}",))[0]


_NAMES: dict[Any, tuple[str, str]] = {
    int: ("an integer", "integers"), float: ("a finite number", "finite numbers"),
    bool: ("true or false", "booleans"), str: ("a string", "strings"),
}


def _plural(tp: Any) -> str:
    if tp in _NAMES:
        return _NAMES[tp][1]
    if isinstance(tp, type) and hasattr(tp, "__dataclass_fields__"):
        return f"{tp.__name__} tables"
    return describe_type(tp)


def _what_is(value: Any, tp: Any = None) -> str:
    """`value`'s type in words; for a container of the type `tp` wants, the first wrong
    item's too (its type, never the value)."""
    if isinstance(value, (list, tuple, dict)) and tp is not None:
        wanted = [a for a in (typing.get_args(tp) if typing.get_origin(tp) in
                              (typing.Union, types.UnionType) else (tp,))
                  if typing.get_origin(a) in (list, tuple, dict)]
        for a in wanted:
            if not isinstance(value, typing.get_origin(a)):
                continue
            args = typing.get_args(a)
            text = "a table" if isinstance(value, dict) else "a list"
            if isinstance(value, dict):
                for k, v in value.items():
                    if not type_ok(k, args[0]):
                        return f"{text} with {_what_is(k, args[0])} as a key"
                    if not type_ok(v, args[1]):
                        return f"{text} with {_what_is(v, args[1])} as a value"
            else:
                for x in value:
                    if not type_ok(x, args[0]):
                        return f"{text} holding {_what_is(x, args[0])}"
    if value is None:
        return "null (unset)"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value!r}"  # nan or inf: no secret, and the point of the message
    names = {int: "an integer", float: "a decimal number", str: "a string",
             list: "a list", tuple: "a list", dict: "a table"}
    for t, text in names.items():
        if isinstance(value, t):
            return text
    return f"a {type(value).__name__}"


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """`cls`'s evaluated field annotations (they are strings under `from __future__
    import annotations`), once per class."""
    h = _HINTS.get(cls)
    if h is None:
        h = _HINTS[cls] = typing.get_type_hints(cls)
    return h


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_size(value: int | str, name: str, error: type[Exception] = ValueError) -> int:
    """Bytes from an int or a string such as "64GiB", "500 MB", "1.5g"."""
    if not isinstance(value, (int, str)) or isinstance(value, bool):
        kind = "a boolean" if isinstance(value, bool) else f"a {type(value).__name__}"
        raise error(f"{name} must be a size: a whole number of bytes or a string such "
                    f"as \"64GiB\", not {kind}")
    if isinstance(value, int):
        if value < 0:
            raise error(f"{name} must be >= 0")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise error(f"{name}: cannot read {value!r} as a size (e.g. 64GiB, 500MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
