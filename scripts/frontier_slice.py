"""Time a slice of one frontier cell before running the grid: every method at the budget's settings but a
few rounds, each in its own simulator run (on the shared upload cache), one torch thread.

    python scripts/frontier_slice.py [--dataset mnist] [--setting 0.5] [--budget reduced] [--rounds 5]
                                     [--methods fedavg,kdia,...] [--out /tmp/frontier-slice]

FedCOG's synthesis starts in round 2 and DynaFed's after round 3, so that the slice pays for them once.
Prints one JSON line per method: seconds, final accuracy and MiB exchanged.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--setting", default="0.5")
    parser.add_argument("--budget", default="reduced")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--methods", default=None, help="comma-separated labels (default: the budget's)")
    parser.add_argument("--out", default="/tmp/frontier-slice")
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--cache-dir", default="cache/uploads")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from hetfl.engine.simulator import Simulator, prepare
    from hetfl.methods.checks import validate
    from hetfl.reproduce.paper import cell_config, load_paper

    cfg = cell_config(load_paper("frontier"), args.dataset, args.setting, 0, args.budget)
    cfg["name"] = "frontier-slice"
    for params in cfg["methods"].values():
        if "rounds" in params:
            params["rounds"] = args.rounds
    if "fedcog" in cfg["methods"]:
        cfg["methods"]["fedcog"]["start_round"] = 2
    if "dynafed" in cfg["methods"]:
        cfg["methods"]["dynafed"]["trajectory_rounds"] = 3
    labels = args.methods.split(",") if args.methods else list(cfg["methods"])
    for label in labels:
        one = {**copy.deepcopy(cfg), "methods": {label: cfg["methods"][label]}}
        start = time.perf_counter()
        summary = Simulator(prepare(validate(one), args.data_root), Path(args.out), Path(args.cache_dir),
                            quiet=True).run()
        r = summary["results"][label]
        mib = (r["bytes_up"] + r["bytes_down"] + r.get("bytes_peer", 0)) / 2**20
        print(json.dumps({"method": label, "wall_s": round(time.perf_counter() - start, 1),
                          "seconds": round(r["seconds"], 1), "accuracy": round(r["accuracy"], 2),
                          "mib": round(mib, 1)}), flush=True)


if __name__ == "__main__":
    main()
