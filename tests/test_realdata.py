"""Real MNIST / Fashion-MNIST (fetched by `make data`): official splits and a short federated run."""

import pytest
import torch

from hetfl.data import load_dataset, make_partition
from hetfl.engine.simulator import Simulator, prepare
from hetfl.methods.checks import validate
from tests.conftest import DATA_ROOT, has_real_data

pytestmark = pytest.mark.realdata

MNIST_TRAIN = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def need(name: str) -> None:
    if not has_real_data(name):
        pytest.skip(f"{name} not fetched: run `make data`")


def test_mnist_is_the_official_split():
    need("mnist")
    s = load_dataset("mnist", DATA_ROOT)
    assert s.train.x.shape == (60000, 1, 28, 28) and s.test.x.shape == (10000, 1, 28, 28)
    assert s.train.label_counts().tolist() == MNIST_TRAIN
    assert s.test.label_counts().tolist() == MNIST_TEST
    assert s.train.x.dtype == torch.uint8 and int(s.train.x.max()) == 255


def test_fmnist_is_the_official_split():
    need("fmnist")
    s = load_dataset("fmnist", DATA_ROOT)
    assert s.train.label_counts().tolist() == [6000] * 10
    assert s.test.label_counts().tolist() == [1000] * 10
    assert s.train.class_names[0] == "T-shirt/top"


def test_dirichlet_partition_of_real_mnist_covers_it():
    need("mnist")
    y = load_dataset("mnist", DATA_ROOT).train.y.numpy()
    part = make_partition(y, 5, {"kind": "dirichlet", "alpha": 0.1, "min_size": 10}, seed=0)
    assert part.counts.sum() == 60000
    assert part.counts.sum(axis=0).tolist() == MNIST_TRAIN
    assert (part.sizes >= 10).all()


@pytest.mark.slow
def test_one_shot_run_on_real_mnist(tmp_path):
    need("mnist")
    cfg = validate({
        "name": "real", "seed": 0, "dataset": "mnist", "data_root": str(DATA_ROOT), "clients": 5,
        "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 10},
        "client": {"model": "cnn2", "epochs": 1, "batch_size": 128, "lr": 0.05},
        "methods": {"fedavg": {}, "ensemble": {}},
    })
    res = Simulator(prepare(cfg), tmp_path, tmp_path / "cache", quiet=True).run()["results"]
    assert res["ensemble"]["accuracy"] > 60  # five 1-epoch CNNs on Dir(0.5) MNIST: 75.5 measured, chance 10
    assert res["fedavg"]["bytes_up"] == res["ensemble"]["bytes_up"]
