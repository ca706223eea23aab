"""A config value as an operator types it (`key=value`) or a program passes it, read by its field's own type:
`off` stays a string for a Literal field, `true` is a bool and never an int, a number is finite.

Contract: `parse_value(dotted, text)` reads text by the field's annotation (YAML only for the free-form
fields: spec_args, tuples, mappings, and keys the models do not know, which Config.with_overrides then names);
`typed_value(dotted, value)` checks a Python value against it (a str is read as text). Both raise ConfigError
naming the field and why. Ranges stay the config models' (Config.with_overrides); what they return is JSON
that round-trips exactly: no inf, no nan, anywhere.
"""

from __future__ import annotations

import math
import re
import types
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from diloco.configs.schema import Config, ConfigError

_INT_RE = re.compile(r"[+-]?[0-9](_?[0-9])*")
_BOOLS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}
_NULLS = ("null", "none", "~", "")


def annotation(dotted: str) -> Any:
    """The type of the config field `dotted` (e.g. `merger.quorum` -> int), or None when free-form or unknown.
    """
    section, _, leaf = dotted.partition(".")
    field = Config.model_fields.get(section)
    if field is None:
        return None
    if not leaf:
        return field.annotation
    model = field.annotation
    inner = getattr(model, "model_fields", {}).get(leaf) if isinstance(model, type) else None
    return None if inner is None or "." in leaf else inner.annotation


def nonfinite(value: Any, where: str = "") -> str | None:
    """Where in `value` (nested lists and mappings) a float is inf or nan — what JSON cannot carry — or None.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return where or "the value"
    if isinstance(value, dict):
        inner = ((v, f"{where}.{k}" if where else str(k)) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        inner = ((v, f"{where}[{i}]") for i, v in enumerate(value))
    else:
        return None
    return next((w for v, at in inner if (w := nonfinite(v, at))), None)


def _typed(tp: Any) -> bool:
    """Whether a field's type is read here (scalars, Literals, their unions), not by YAML and the models."""
    return tp in (bool, int, float, str) or get_origin(tp) in (Literal, Union, types.UnionType)


def _describe(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a finite number"
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(str(c) for c in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _from_text(tp: Any, text: str) -> Any:
    """`text` read as a `tp`; ValueError when it is not one."""
    if tp is bool and text.lower() in _BOOLS:
        return _BOOLS[text.lower()]
    if tp is int and _INT_RE.fullmatch(text):
        return int(text)
    if tp is float:
        try:
            number = float(text)  # "inf", "nan" and "1e400" parse, and are refused here
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            return number
    if tp is str:
        return text
    if tp is type(None) and text.lower() in _NULLS:
        return None
    origin = get_origin(tp)
    if origin is Literal and text in [str(c) for c in get_args(tp)]:
        return next(c for c in get_args(tp) if str(c) == text)
    if origin in (Union, types.UnionType):
        arms = sorted(get_args(tp), key=lambda a: a is str)  # a plain str takes anything: tried last
        for arm in arms:
            try:
                return _from_text(arm, text)
            except ValueError:
                continue
    raise ValueError(_describe(tp))


def parse_value(dotted: str, text: str) -> Any:
    """The value of `dotted=text` by the field's type; ConfigError naming the field and what it must be."""
    tp = annotation(dotted)
    if not _typed(tp):
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"{dotted}={text!r}: the value is not valid YAML: {err}") from None
        where = nonfinite(value)
        if where is not None:
            raise ConfigError(f"{dotted}={text!r}: must be finite (no inf or nan)")
        return value
    try:
        return _from_text(tp, text.strip())
    except ValueError as err:
        raise ConfigError(f"{dotted}={text!r}: must be {err}") from None


def _check(tp: Any, value: Any) -> Any:
    """`value` as a `tp`, no coercion but int -> float; ValueError when it is not one."""
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is float and number and math.isfinite(value):
        return float(value)
    if tp is type(None) and value is None:
        return None
    origin = get_origin(tp)
    if origin is Literal and any(type(value) is type(c) and value == c for c in get_args(tp)):
        return value
    if origin in (Union, types.UnionType):
        for arm in get_args(tp):
            try:
                return _check(arm, value)
            except ValueError:
                continue
    raise ValueError(_describe(tp))


def typed_value(dotted: str, value: Any) -> Any:
    """A Python value for the field `dotted`, checked against its type (a str is read as text: parse_value);
    ConfigError naming the field and what it must be."""
    if isinstance(value, str):
        return parse_value(dotted, value)
    where = nonfinite(value)
    if where is not None:
        raise ConfigError(f"{dotted}={value!r}: must be finite (no inf or nan)")
    tp = annotation(dotted)
    if not _typed(tp) or tp is str:
        return value
    try:
        return _check(tp, value)
    except ValueError as err:
        raise ConfigError(f"{dotted}={value!r}: must be {err}") from None


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`-o key=value` pairs (dotted keys, values read by their field's type) -> {dotted: value}; ConfigError
    naming a bad one."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key or any(not part.isidentifier() for part in key.split(".")):
            raise ConfigError(f"override {pair!r} must be key=value with a dotted key, "
                              "e.g. inner.steps_per_phase=20")
        out[key] = parse_value(key, raw)
    return out
