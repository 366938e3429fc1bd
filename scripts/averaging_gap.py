"""How far a one-shot parameter average falls under the same clients' logit ensemble, epoch by epoch.

FedMHO's initial model w_0 (Eq. 4) is the parameter average of the classification clients, and the
paper's FedAvg is the same average. With VGG-9 on Fashion-MNIST Dir(0.5) our average scores 36.5 %
while the same five clients' logit ensemble scores 58.9 % (docs/results/fedmho-notes.md, thirty-ninth
session). This script trains a config's clients of one architecture exactly as a ``hetfl run`` of that
config does (same shared initialisation, same data order, ``hetfl.fl.training.local_train``) and, at
each snapshot epoch, evaluates on the test split:

* each client alone, their logit ensemble (uniform), their parameter average (uniform = Eq. 4, and
  weighted by sample count = FedAvg);
* each client's relative distance from the shared initialisation, ||w_k - w_init|| / ||w_init||;
* with ``--vote``, the paper's FedAvg for model-heterogeneous clients ("the voting results of each
  model prototype", Sec. 5.1): the config's clients of every other architecture are trained for the
  full ``client.epochs`` too, averaged per architecture, and the vote is the uniform mean of the
  per-architecture averages' logits (as the authors' ``federated_average_ensemble.py`` computes it).

Only running sums of the snapshot weights are kept (one float64 model per snapshot and weighting),
so VGG-9 at four snapshots holds about 4.4 GB whatever the number of clients. Evaluation
(``predict_logits``) is in the config's client precision (bf16 autocast where it trains in bf16).

    .venv/bin/python scripts/averaging_gap.py configs/fedmho-fmnist-vgg9-e10.yaml \\
        --snapshots 1,2,5,10 --out docs/results/fedmho-runs/vgg9-averaging/base.json \\
        [--set client.lr=0.001 ...]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from hetfl.config import load_config
from hetfl.engine.simulator import Experiment, prepare, processor_name
from hetfl.fl.aggregate import normalise
from hetfl.fl.method import derive_seed
from hetfl.fl.training import TrainConfig, accuracy_report, autocast, local_train, predict_logits
from hetfl.models import build_model


def per_class(logits: torch.Tensor, exp: Experiment) -> list[float | None]:
    return accuracy_report(logits, exp.splits.test.y, exp.splits.num_classes)["per_class"]


def accuracy(logits: torch.Tensor, exp: Experiment) -> float:
    return round(accuracy_report(logits, exp.splits.test.y, exp.splits.num_classes)["accuracy"], 2)


@dataclass
class Snapshot:
    """One epoch of one architecture's clients: their accuracies, distances from the shared init,
    test logits, and the running weighted sums of their parameters (per weighting)."""

    clients: list[float] = field(default_factory=list)
    distance_from_init: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    sums: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def train_group(arch: str, ids: list[int], snaps: list[int], exp: Experiment, train_cfg: TrainConfig,
                weights: dict[str, torch.Tensor], t0: float) -> dict[int, Snapshot]:
    """Train one architecture's clients as ``hetfl run`` does (shared initialisation, seeds, data
    order) and record each snapshot epoch."""
    seed, shape, nc, device = exp.cfg["seed"], exp.splits.shape, exp.splits.num_classes, exp.device
    torch.manual_seed(derive_seed(seed, "client-init", arch))
    init_state = {k: v.clone() for k, v in build_model(arch, shape[0], shape[1], nc).state_dict().items()}
    init_flat = torch.cat([v.float().flatten() for v in init_state.values()])
    out = {e: Snapshot(sums={w: {k: torch.zeros_like(v, dtype=torch.float64) for k, v in init_state.items()}
                             for w in weights}) for e in snaps}
    for j, c in enumerate(ids):
        model = build_model(arch, shape[0], shape[1], nc)
        model.load_state_dict(init_state)

        def snapshot(epoch: int, loss: float, j: int = j, c: int = c, model: torch.nn.Module = model) -> None:
            print(f"{arch} client {c} epoch {epoch} loss {loss:.4f} ({time.time() - t0:.0f} s)", flush=True)
            if epoch not in out:
                return
            snap, state = out[epoch], model.state_dict()
            for w, wt in weights.items():
                for k, v in state.items():
                    snap.sums[w][k] += float(wt[j]) * v.detach().double().cpu()
            with autocast(device, train_cfg.precision):
                snap.logits.append(predict_logits(model, exp.splits.test, device).cpu())
            model.train()
            snap.clients.append(accuracy(snap.logits[-1], exp))
            flat = torch.cat([v.detach().float().flatten().cpu() for v in state.values()])
            snap.distance_from_init.append(round(float((flat - init_flat).norm() / init_flat.norm()), 4))

        local_train(model, exp.client_data[c], train_cfg, device,
                    seed=derive_seed(seed, "client-train", c), progress=snapshot)
    return out


def average_logits(arch: str, sums: dict[str, torch.Tensor], exp: Experiment, precision: str) -> torch.Tensor:
    """Test logits of the model whose parameters are ``sums`` (a weighted average)."""
    shape = exp.splits.shape
    model = build_model(arch, shape[0], shape[1], exp.splits.num_classes)
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in sums.items()})
    with autocast(exp.device, precision):
        return predict_logits(model, exp.splits.test, exp.device).cpu()


def client_weights(exp: Experiment, ids: list[int]) -> dict[str, torch.Tensor]:
    """Uniform (Eq. 4, w_0) and by sample count (FedAvg)."""
    return {"uniform": normalise([1.0] * len(ids)), "samples": normalise([len(exp.client_data[c]) for c in ids])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--arch", default=None, help="client architecture to average (default: the server's)")
    ap.add_argument("--snapshots", default="", help="comma-separated epochs (default: the last epoch)")
    ap.add_argument("--vote", action="store_true", help="also train the other architectures' clients "
                    "and report the vote of the per-architecture averages")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    cfg = load_config(args.config, args.overrides)
    exp = prepare(cfg)
    arch = args.arch or cfg["server"]["model"]
    groups = {a: [c for c, b in enumerate(exp.archs) if b == a] for a in dict.fromkeys(exp.archs)}
    if arch not in groups:
        raise SystemExit(f"no client of architecture {arch!r} in {args.config} (clients: {exp.archs})")
    train_cfg = TrainConfig(**{k: v for k, v in cfg["client"].items() if k in {f.name for f in fields(TrainConfig)}})
    snaps = sorted({int(s) for s in args.snapshots.split(",") if s}) or [train_cfg.epochs]
    if snaps[0] < 1 or snaps[-1] > train_cfg.epochs:
        raise SystemExit(f"snapshots must lie in 1..{train_cfg.epochs} (client.epochs), got {snaps}")
    t0 = time.time()
    others: dict[str, dict] = {}
    for other in (a for a in groups if a != arch and args.vote):  # their full-length averages vote
        final = train_group(other, groups[other], [train_cfg.epochs], exp, train_cfg,
                            client_weights(exp, groups[other]), t0)[train_cfg.epochs]
        logits = {w: average_logits(other, s, exp, train_cfg.precision) for w, s in final.sums.items()}
        others[other] = {"clients": groups[other], "client_accuracy": final.clients, "logits": logits,
                         **{f"average_{w}": accuracy(v, exp) for w, v in logits.items()}}
    ids = groups[arch]
    rows = {}
    for e, snap in train_group(arch, ids, snaps, exp, train_cfg, client_weights(exp, ids), t0).items():
        row = {"clients": snap.clients, "distance_from_init": snap.distance_from_init,
               "ensemble": accuracy(torch.stack(snap.logits).mean(0), exp)}
        for w, sums in snap.sums.items():
            out = average_logits(arch, sums, exp, train_cfg.precision)
            row[f"average_{w}"] = accuracy(out, exp)
            if others:
                vote = torch.stack([out] + [o["logits"][w] for o in others.values()]).mean(0)
                row[f"vote_{w}"] = accuracy(vote, exp)
                row[f"vote_{w}_per_class"] = per_class(vote, exp)
            row[f"average_{w}_per_class"] = per_class(out, exp)
        rows[e] = row
        print(f"epoch {e}: {json.dumps(row)}", flush=True)
    result = {"config": cfg, "overrides": args.overrides, "arch": arch, "clients": ids,
              "sizes": [len(exp.client_data[c]) for c in ids],
              "other_archs": {a: {k: v for k, v in o.items() if k != "logits"} for a, o in others.items()},
              "train": train_cfg.to_dict(), "snapshots": {str(e): rows[e] for e in snaps},
              "minutes": round((time.time() - t0) / 60, 1), "processor": processor_name(),
              "threads": torch.get_num_threads()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
