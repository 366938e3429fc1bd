"""hetfl: federated learning under data and model heterogeneity."""

__version__ = "0.1.0"
