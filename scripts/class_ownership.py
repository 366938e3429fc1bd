"""How often one client of a group owns a class, per partition kind, over many partition seeds.

A one-shot parameter average scores 0 % on a class whose images one client of the averaged group
holds almost alone (docs/results/fedmho-notes.md, fortieth session), so this statistic of a
partition predicts part of FedAvg's accuracy. For each partition spec and seed the script makes
the partition (``hetfl.data.partition.make_partition``, no training) and, over the classes of which
the group (``--group``: client ids, default FedMHO's classifiers 0-4) holds at least ``--present``
of the training images, counts those held ``>= --owned`` by a single client of the group, and the
mean largest-client share. It prints one row per (dataset, alpha, kind): the mean over
``--seeds`` seeds, how many seeds have no owned class, and the listed ``--show`` seeds' counts.

    .venv/bin/python scripts/class_ownership.py --datasets fmnist,mnist --alphas 0.5,0.3,0.1 \\
        --seeds 50 --show 0,1,2,2023 [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from hetfl.data import load_dataset
from hetfl.data.partition import make_partition
from hetfl.reproduce.fedmho import partition_spec

# partition kind -> a FedMHO budget that uses it (its Dir(alpha) spec is the one compared)
KINDS = {"dirichlet": "reduced", "feddf_dirichlet": "reduced-feddf-partition"}


def ownership(counts: np.ndarray, group: list[int], owned: float, present: float) -> tuple[int, float]:
    """(classes owned by one client of ``group``, mean largest-client share) over the classes of
    which ``group`` holds at least ``present`` of all the clients' images."""
    sub = counts[group].astype(float)
    held = sub.sum(axis=0)
    keep = held >= present * counts.sum(axis=0)
    shares = sub.max(axis=0)[keep] / held[keep]
    return int((shares >= owned).sum()), float(shares.mean()) if len(shares) else 0.0


def table(labels: np.ndarray, clients: int, alphas: list[float], seeds: int, show: list[int],
          group: list[int], owned: float, present: float) -> list[dict[str, Any]]:
    rows = []
    for alpha in alphas:
        for kind, budget in KINDS.items():
            spec = partition_spec(budget, f"{alpha:g}")
            stats = {s: ownership(make_partition(labels, clients, spec, s).counts, group, owned, present)
                     for s in sorted(set(range(seeds)) | set(show))}
            sample = [stats[s] for s in range(seeds)]
            rows.append({"alpha": alpha, "kind": kind,
                         "owned_mean": statistics.fmean(o for o, _ in sample),
                         "seeds_without": sum(o == 0 for o, _ in sample),
                         "top_share_mean": statistics.fmean(t for _, t in sample),
                         "shown": {str(s): stats[s][0] for s in show}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", default="fmnist")
    ap.add_argument("--alphas", default="0.5,0.3,0.1")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--group", default="0,1,2,3,4", help="client ids of the averaged group")
    ap.add_argument("--seeds", type=int, default=50, help="seeds 0..N-1 make the mean")
    ap.add_argument("--show", default="0,1,2", help="seeds whose own counts are listed")
    ap.add_argument("--owned", type=float, default=0.9, help="share of the group's images that makes an owner")
    ap.add_argument("--present", type=float, default=0.1, help="least share of a class the group must hold")
    ap.add_argument("--data-root", default="data")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    group = [int(c) for c in args.group.split(",")]
    if not group or min(group) < 0 or max(group) >= args.clients:
        raise SystemExit(f"--group must list client ids in 0..{args.clients - 1}, got {args.group!r}")
    show = [int(s) for s in args.show.split(",") if s]
    result = {}
    for name in args.datasets.split(","):
        labels = load_dataset(name, args.data_root).train.y.numpy()
        rows = table(labels, args.clients, [float(a) for a in args.alphas.split(",")], args.seeds, show, group,
                     args.owned, args.present)
        result[name] = rows
        for r in rows:
            print(f"{name} Dir({r['alpha']:g}) {r['kind']}: {r['owned_mean']:.2f} owned classes per seed "
                  f"(none in {r['seeds_without']} of {args.seeds}), mean top share {r['top_share_mean']:.3f}; "
                  f"seeds {r['shown']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
