"""Shared fixtures: tiny synthetic data and configs that train in a second or two."""

from __future__ import annotations

import copy
import os
import signal
from pathlib import Path

import pytest
import torch

from hetfl.data.synthetic import load_synthetic

# Serially the suite gives torch both cores. Under pytest-xdist (`-n 2`) each worker gets one core, and
# so do the processes its tests start: two workers at two spinning threads each thrash 2 cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)

# A shell that starts the suite in the background (`make test &`, nohup, some CI runners) hands it
# SIGINT ignored, and an ignored signal stays ignored across exec: the subprocesses of the Ctrl-C tests
# would never see the SIGINT they are sent. Python's own handler is reset to the default at exec, so
# installing it here gives every child a normal Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[1]
DATA_ROOT = REPO / "data"


def has_real_data(name: str) -> bool:
    folder = {"mnist": "mnist", "fmnist": "fashion-mnist"}[name]
    return (DATA_ROOT / folder / "t10k-labels-idx1-ubyte.gz").is_file()


TINY_CONFIG = {
    "name": "tiny",
    "seed": 0,
    "dataset": "synthetic",
    "data": {"train_per_class": 40, "test_per_class": 20, "size": 16, "classes": 4, "noise": 0.2},
    "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5},
    "clients": 3,
    "client": {"model": "cnn2", "epochs": 3, "batch_size": 32, "lr": 0.1},
    "server": {"model": "cnn2"},
    "methods": {"fedavg": {}, "ensemble": {}},
}


@pytest.fixture
def tiny_config() -> dict:
    return copy.deepcopy(TINY_CONFIG)


@pytest.fixture
def synthetic_small():  # tiny (20 ms): a fresh copy per test, none shared
    return load_synthetic(classes=4, channels=1, size=16, train_per_class=60, test_per_class=30, seed=3)

