"""Options given by name to a constructor (routers, registered or ``module:Class``): checked against its
signature before it runs, so a wrong name or a value of the wrong type is one ValueError naming the owner,
the option, the value and the expected type, not a failure deep inside (or silent acceptance:
``expert_bias="abc"`` is truthy).

The expected type is the parameter's annotation (unions, Literal, containers by their origin), or where it
has none, its default's type (a bool, a number, a string); anything else is not checked.
"""
from __future__ import annotations

import inspect
import numbers
import types
import typing


def check_options(owner: str, fn, options: dict, skip: tuple[str, ...] = ("self",)) -> None:
    """Raise ValueError when ``options`` names a parameter ``fn`` lacks (unless it takes ``**kwargs``) or
    gives one a value its annotation / default contradicts. ``owner`` starts every message."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        accepted = [p for p in params if p not in skip]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ValueError(f"{owner} has no option(s) {unknown}; its options are {accepted}")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not evaluate here: fall back to the defaults' types
        hints = {}
    for key, value in options.items():
        p = params.get(key)
        if p is None:  # taken by **kwargs: nothing to check against
            continue
        expected = hints.get(key, _default_type(p.default))
        if expected is not None and not accepts(expected, value):
            raise ValueError(f"{owner}: option {key}={value!r} ({kind_of(value)}) has the wrong type; it "
                             f"must be {describe_type(expected)}")


def error_text(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _default_type(default):
    """The type an unannotated parameter's default implies (bool, a number, str), else None (unchecked)."""
    if isinstance(default, bool):
        return bool
    if isinstance(default, (int, float)):
        return float  # an unannotated number: int or float
    return str if isinstance(default, str) else None


def accepts(tp, value) -> bool:
    """Whether ``value`` fits annotation ``tp``; True for annotations this does not understand."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(accepts(a, value) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if tp is type(None) or tp is None:
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if origin is not None and isinstance(origin, type):  # list[int], dict[str, float]: the container only
        return isinstance(value, origin)
    if isinstance(tp, type) and tp is not object:
        return isinstance(value, tp)
    return True  # Any, TypeVars, callables, strings that did not resolve


def describe_type(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(tp))}"
    names = {bool: "a boolean (true / false)", int: "an integer", float: "a number", str: "a string",
             type(None): "none"}
    if tp in names:
        return names[tp]
    tp = origin or tp
    return f"a {getattr(tp, '__name__', tp)}"


def kind_of(value) -> str:
    for tp, kind in ((bool, "a boolean"), (numbers.Integral, "an integer"), (numbers.Real, "a number"),
                     (str, "a string"), (type(None), "none")):
        if isinstance(value, tp):
            return kind
    return f"a {type(value).__name__}"
