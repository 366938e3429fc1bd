"""Declared parameters: one mechanism that checks every setting of a config before any data loads.

A parameter set is declared by its defaults (the type of each default is the key's type: an int key
takes integers, a float key any number, a bool key true or false, a string key text) and by ranges
and choices per key (:data:`COMMON_RANGES` for the keys many methods share, a method's own
``ranges`` for the rest). :func:`check` validates values against the declaration with pydantic and
raises :class:`ParamError`, one line naming the key path, the value and what is allowed.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

# Ranges of keys with one meaning wherever they appear: pydantic's gt / ge / lt / le, or ``choices``.
COMMON_RANGES: dict[str, dict[str, Any]] = {
    "epochs": {"ge": 1}, "steps": {"ge": 1}, "rounds": {"ge": 1}, "generator_steps": {"ge": 1},
    "batch_size": {"ge": 1}, "lr": {"gt": 0}, "generator_lr": {"gt": 0}, "momentum": {"ge": 0, "lt": 1},
    "weight_decay": {"ge": 0}, "temperature": {"gt": 0}, "grad_clip": {"ge": 0}, "generator_grad_clip": {"ge": 0},
    "sample_ratio": {"gt": 0, "le": 1}, "eval_every": {"ge": 1}, "checkpoint_every": {"ge": 1},
    "checkpoint_every_s": {"ge": 0}, "nz": {"ge": 1}, "strat_batch_size": {"ge": 1},
    "precision": {"choices": ("fp32", "bf16")}, "distill_precision": {"choices": ("fp32", "bf16")},
    "strat_precision": {"choices": ("fp32", "bf16")},
}


class ParamError(ValueError):
    """A value outside its declaration; ``path`` is the full key path, e.g. ``methods.dense.epochs``."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path, self.detail = path, detail

    def under(self, prefix: str) -> ParamError:
        """The same error with ``prefix.`` in front of its path."""
        return ParamError(f"{prefix}.{self.path}" if self.path else prefix, self.detail)


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _field(key: str, default: Any, ranges: dict[str, Any]) -> tuple[Any, Any]:
    spec = dict(COMMON_RANGES.get(key, {}), **ranges.get(key, {}))
    choices = spec.pop("choices", None)
    declared = spec.pop("type", None)  # for a key whose default (None) does not tell its type
    if choices is not None:
        kind: Any = Literal[tuple(choices)]
        return (kind | None if default is None else kind), Field(default=default)
    if declared == "any":
        return Any, Field(default=default)
    if declared is not None:
        kind = _TYPES[declared]
    elif isinstance(default, bool):
        kind = bool
    elif isinstance(default, int):
        kind = int
    elif isinstance(default, float):
        kind = float
    elif isinstance(default, str):
        kind = str
    else:  # None, lists and mappings: checked by the method itself
        return Any, Field(default=default)
    if default is None:
        kind = kind | None
    return kind, Field(default=default, strict=True, **spec)


@cache
def _schema(name: str, declared: tuple[tuple[str, Any], ...], ranges: tuple[tuple[str, Any], ...]) -> type[BaseModel]:
    spec = {k: dict(v) for k, v in ranges}
    fields = {key: _field(key, default, spec) for key, default in declared}
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields)


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def _allowed(error: dict[str, Any]) -> str:
    ctx = error.get("ctx") or {}
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        sign = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[kind]
        return f"must be {sign} {next(iter(ctx.values()))}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    return error["msg"][0].lower() + error["msg"][1:]


def check(name: str, defaults: dict[str, Any], values: dict[str, Any], ranges: dict[str, Any] | None = None,
          where: str = "") -> dict[str, Any]:
    """``values`` over ``defaults``, checked against the declaration; raises :class:`ParamError` naming
    ``where.<key>``, the value and what is allowed (unknown keys list the valid ones)."""
    declared = tuple((k, _frozen(v) if isinstance(v, (dict, list)) else v) for k, v in defaults.items())
    schema = _schema(name, declared, tuple(sorted((k, tuple(sorted(v.items()))) for k, v in (ranges or {}).items())))
    try:
        schema.model_validate(values)
    except ValidationError as err:
        error = err.errors()[0]
        key = ".".join(str(x) for x in error["loc"])
        path = f"{where}.{key}" if where else key
        if error["type"] == "extra_forbidden":
            raise ParamError(path, f"unknown key; valid: {', '.join(sorted(defaults))}") from None
        raise ParamError(path, f"{error.get('input')!r}: {_allowed(error)}") from None
    return {**defaults, **values}
