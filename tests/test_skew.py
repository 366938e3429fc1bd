"""Every multi-round and hybrid method learns under label skew: real MNIST, 20 clients of 2 classes each.

A method that ends at chance here fails, whatever the cause: a bad default (client momentum nobody asked
for froze FedSeq at 11.35 % on MNIST C = 2), a server step ten times FedAvg's, or a broken stage. The
budget is the suite's (seconds a method), so the bars are loose; each is stated beside its assertion.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetfl.data import DatasetSplits, load_dataset
from hetfl.engine.simulator import Simulator, prepare
from hetfl.methods.checks import validate
from hetfl.models import register_model
from hetfl.models.simplecnn import SimpleCNN
from tests.conftest import DATA_ROOT, has_real_data

pytestmark = pytest.mark.realdata

ROUNDS = 6
# Method settings sized to the suite: every stage runs (generators, synthesis, clustering, distillation),
# each for a few steps; the rest is the methods' defaults.
METHODS = {
    "fedavg": {"rounds": ROUNDS, "sample_ratio": 0.5},
    "fedprox": {"rounds": ROUNDS, "sample_ratio": 0.5},
    # the KDIA authors' damped form: v starts at 0 and grows to FedAvg's step over ~10 rounds, so twice the rounds
    "fedavgm": {"rounds": 2 * ROUNDS, "sample_ratio": 0.5, "server_lr": 0.1},
    "moon": {"rounds": ROUNDS, "sample_ratio": 0.5},
    "feddisco": {"rounds": ROUNDS, "sample_ratio": 0.5},
    "fedgkd": {"rounds": ROUNDS, "sample_ratio": 0.5},
    # alpha = beta = 10 (the authors' MNIST values) blow this model's head up at lr 0.05: the generator is
    # barely trained after round 1 and its CE term (19 in round 2) grows to 1e21 within the round
    "fedgen": {"rounds": ROUNDS, "sample_ratio": 0.5, "alpha": 1.0, "beta": 1.0},
    "fedcog": {"rounds": ROUNDS, "sample_ratio": 0.5, "start_round": ROUNDS - 2, "g_steps": 5, "g_size": 32,
               "kd_weight": 0.01},
    "kdia": {"rounds": ROUNDS, "sample_ratio": 0.5, "gen_epochs": 2, "gen_batches": 3, "select": "student"},
    # these train every client every round (FedAvg above: half of them): half the rounds
    "hfldd": {"rounds": ROUNDS // 2, "clusters": 2, "aux_size": 100, "distilled_size": 20, "kip_steps": 10},
    "hfldd_nodd": {"rounds": ROUNDS // 2, "clusters": 2, "aux_size": 100},
    "fedseq": {"rounds": ROUNDS // 2, "clusters": 4},
    "dynafed": {"rounds": ROUNDS, "sample_ratio": 0.5, "trajectory_rounds": 3, "syn_iterations": 5, "syn_steps": 3,
                "expert_epochs": 1, "ipc": 2, "distill_iter": 2},
}
CHANCE = 10.0


@register_model
class SkewNet(SimpleCNN):
    """simplecnn's hooks (``extract`` to a 16x5x5 map, ``projection``, ``head``) that every method here needs,
    with BatchNorm and a one-layer projection: it learns MNIST in a few dozen steps, where simplecnn's
    four-layer head takes hundreds, more than the suite can give 13 methods."""

    arch = "skewnet"

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__(in_channels, image_size, num_classes)
        pad = 2 if image_size < 32 else 0
        self.extractor = nn.Sequential(
            nn.Conv2d(in_channels, 16, 5, padding=pad), nn.BatchNorm2d(16), nn.MaxPool2d(2), nn.ReLU(),
            nn.Conv2d(16, 16, 5), nn.BatchNorm2d(16), nn.MaxPool2d(2), nn.ReLU())
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(16 * 5 * 5, 64))
        self.head = nn.Linear(64, num_classes)
        self._record_feature_shape()


def small_mnist(per_class: int = 100, test_per_class: int = 50) -> DatasetSplits:
    """The first ``per_class`` training and ``test_per_class`` test images of each MNIST class."""
    full = load_dataset("mnist", DATA_ROOT)

    def take(ds, n):  # noqa: ANN001, ANN202
        idx = torch.cat([torch.nonzero(ds.y == c).flatten()[:n] for c in range(ds.num_classes)])
        return ds.subset(idx)

    return DatasetSplits(take(full.train, per_class), take(full.test, test_per_class))


@pytest.mark.slow
def test_every_round_method_learns_under_label_skew(tmp_path):
    """One run of every method (one test, so that pytest-xdist runs it once): each ends well above chance
    and within 30 points of FedAvg on the same clients and budget (measured on a 2-core EPYC: FedAvg 73.2 %,
    the others 46.4 % (FedGen) to 82.4 % (FedSeq))."""
    if not has_real_data("mnist") or not has_real_data("fmnist"):  # fmnist: HFLDD's auxiliary set
        pytest.skip("MNIST or Fashion-MNIST not fetched: run `make data`")
    cfg = validate({
        "name": "skew", "seed": 0, "dataset": "mnist", "data_root": str(DATA_ROOT), "clients": 20,
        "partition": {"kind": "classes", "per_client": 2}, "eval_every": 2 * ROUNDS,
        "client": {"model": "skewnet", "epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.0},
        "server": {"model": "skewnet"}, "methods": METHODS,
    })
    results = Simulator(prepare(cfg, splits=small_mnist()), tmp_path, None, quiet=True).run()["results"]
    fedavg = results["fedavg"]["accuracy"]
    assert fedavg > 5 * CHANCE, f"fedavg ends at {fedavg:.2f} %"
    ended = {m: round(r["accuracy"], 2) for m, r in results.items()}
    behind = {m: a for m, a in ended.items() if a < 2.5 * CHANCE or a < fedavg - 30}
    assert not behind, f"at chance or far behind FedAvg ({fedavg:.2f} %): {behind}; all: {ended}"
