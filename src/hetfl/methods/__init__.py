"""Methods: importing this package registers every method and its client tasks."""

from hetfl.fl.method import METHODS, create_method
from hetfl.methods import central, coboosting, dense, ensemble, fedavg, feddf, fedhydra, ot  # noqa: F401

__all__ = ["METHODS", "create_method"]
