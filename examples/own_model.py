"""DENSE and FedAvg with your own torch model (a plain nn.Module: forward is all they need).

    python examples/own_model.py [--dataset mnist] [--clients 5] [--out runs/own-model]

``hetfl.register_model`` names the model's factory for configs; ``model: "package.module:factory"`` in a
YAML does the same without registering. Methods that call ``extract`` / ``classify`` (KDIA, FedGen, MOON)
need a ``hetfl.models.HetflModel`` subclass and say so before training.
"""

from __future__ import annotations

import argparse

from torch import nn

import hetfl


@hetfl.register_model("my_mlp")
def my_mlp(in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, 128), nn.ReLU(),
                         nn.BatchNorm1d(128), nn.Linear(128, num_classes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="mnist", help="a dataset name, or an .npz file (kind: arrays)")
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2, help="local epochs (FedAvg) and DENSE's server epochs")
    parser.add_argument("--out", default="runs/own-model")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, as hetfl run --set does (repeatable)")
    args = parser.parse_args()

    dataset = {"kind": "arrays", "path": args.dataset} if args.dataset.endswith(".npz") else args.dataset
    config = {
        "name": "own-model",
        "dataset": dataset,
        "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 2},
        "clients": args.clients,
        "client": {"model": "my_mlp", "epochs": args.epochs, "batch_size": 64, "lr": 0.05},
        "methods": {"fedavg": {}, "dense": {"epochs": args.epochs}},
    }
    result = hetfl.run(config, out=args.out, data_root=args.data_root, overrides=args.overrides)
    print(result.table())


if __name__ == "__main__":
    main()
