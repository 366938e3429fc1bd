"""Config checks that need the method registry: every ``methods:`` entry names a method or a preset
and takes its parameters. :func:`validate` and :func:`load_config` are :mod:`hetfl.config`'s plus
these checks; engines and the CLI use them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hetfl import config
from hetfl.config import ConfigError
from hetfl.fl.method import create_method
from hetfl.fl.params import ParamError


def check_methods(cfg: dict[str, Any]) -> None:
    """Build every method of ``cfg`` (validated by :func:`hetfl.config.validate`) once, so that an
    unknown method or parameter fails before any data loads, naming its label."""
    for label, params in cfg["methods"].items():
        try:
            create_method(label, params)
        except ParamError as err:
            raise ConfigError(str(err.under(f"methods.{label}"))) from err
        except (TypeError, ValueError) as err:
            raise ConfigError(f"methods.{label}: {err}") from err


def validate(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = config.validate(cfg)
    check_methods(cfg)
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    cfg = config.load_config(path, overrides)
    check_methods(cfg)
    return cfg
