"""KDIA and FedAvg on your own image folder: DIR/train/<class>/*.png and DIR/test/<class>/*.png.

    python examples/own_folder.py DIR [--clients 10] [--rounds 20] [--out runs/own-folder]

The classes are the sub-folders (sorted by name); the images are resized to --image-size if given.
Clients get a Dirichlet(0.5) label skew of the training images; a tenth of them is held out to pick
the model (validation), and the test folder scores it.
"""

from __future__ import annotations

import argparse

import hetfl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--out", default="runs/own-folder")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, as hetfl run --set does (repeatable)")
    args = parser.parse_args()

    dataset = {"kind": "folder", "path": args.folder}
    if args.image_size:
        dataset["image_size"] = args.image_size
    config = {
        "name": "own-folder",
        "dataset": dataset,
        "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 2},
        "clients": args.clients,
        "validation": 0.1,
        "client": {"model": "simplecnn", "epochs": 2, "batch_size": 32, "lr": 0.05},
        "methods": {
            "fedavg": {"rounds": args.rounds, "sample_ratio": 0.5},
            "kdia": {"rounds": args.rounds, "sample_ratio": 0.5, "gen_batches": 20},
        },
    }
    result = hetfl.run(config, out=args.out, overrides=args.overrides)
    print(result.table())
    for method in result.methods:
        print(f"{method}: final {result.accuracy(method):.2f} %, validation-selected "
              f"{result.accuracy(method, 'val'):.2f} %, {result.bytes(method) / 2**20:.2f} MiB up")


if __name__ == "__main__":
    main()
