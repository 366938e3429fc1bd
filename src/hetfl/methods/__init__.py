"""Methods: importing this package registers every method, its client tasks and the presets."""

from pathlib import Path

import yaml

from hetfl.fl.method import METHODS, PRESETS, create_method, register_preset, resolve_method
from hetfl.methods import (  # noqa: F401
    central,
    coboosting,
    dense,
    dynafed,
    ensemble,
    fedavg,
    fedavgm,
    fedcog,
    fedcvae,
    feddf,
    feddisco,
    fedgen,
    fedgkd,
    fedhydra,
    fedmho,
    fedprox,
    fedseq,
    hfldd,
    kdia,
    moon,
    ot,
)

for _name, _spec in yaml.safe_load((Path(__file__).with_name("presets.yaml")).read_text()).items():
    register_preset(_name, _spec)

__all__ = ["METHODS", "PRESETS", "create_method", "resolve_method"]
