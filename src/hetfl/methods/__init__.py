"""Methods: importing this package registers every method and its client tasks."""

from hetfl.fl.method import METHODS, create_method
from hetfl.methods import (  # noqa: F401
    central,
    coboosting,
    dense,
    ensemble,
    fedavg,
    fedcvae,
    feddf,
    fedhydra,
    fedmho,
    ot,
)

__all__ = ["METHODS", "create_method"]
