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
so VGG-9 at four snapshots holds about 4.4 GB whatever the number of clients. Evaluation is in the config's client
precision (bf16 autocast where the config trains in bf16).

    .venv/bin/python scripts/averaging_gap.py configs/fedmho-fmnist-vgg9-e10.yaml \\
        --snapshots 1,2,5,10 --out docs/results/fedmho-runs/vgg9-averaging/base.json \\
        [--set client.lr=0.001 ...]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path

import torch

from hetfl.config import load_config
from hetfl.engine.simulator import Experiment, prepare, processor_name
from hetfl.fl.aggregate import normalise, weighted_average
from hetfl.fl.method import derive_seed
from hetfl.fl.training import TrainConfig, accuracy_report, autocast, local_train
from hetfl.models import build_model


@torch.no_grad()
def test_logits(model: torch.nn.Module, x: torch.Tensor, device: torch.device, precision: str,
                batch_size: int = 500) -> torch.Tensor:
    model = model.to(device).eval()
    outs = []
    for s in range(0, len(x), batch_size):
        with autocast(device, precision):
            outs.append(model(x[s:s + batch_size].to(device).float().div_(255.0)).float().cpu())
    return torch.cat(outs)


def group_average_logits(arch: str, ids: list[int], exp: Experiment, cfg: dict, train_cfg: TrainConfig,
                         weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train one architecture's clients as the cell does; test logits of their averages per weighting."""
    shape, nc, device = exp.splits.shape, exp.splits.num_classes, exp.device
    torch.manual_seed(derive_seed(cfg["seed"], "client-init", arch))
    init_state = build_model(arch, shape[0], shape[1], nc).state_dict()
    states, accs = [], []
    for c in ids:
        model = build_model(arch, shape[0], shape[1], nc)
        model.load_state_dict(init_state)
        local_train(model, exp.client_data[c], train_cfg, device, seed=derive_seed(cfg["seed"], "client-train", c))
        states.append({k: v.detach().cpu() for k, v in model.state_dict().items()})
        out = test_logits(model, exp.splits.test.x, device, train_cfg.precision)
        accs.append(round(accuracy_report(out, exp.splits.test.y, nc)["accuracy"], 2))
    logits = {}
    for w, wt in weights.items():
        avg = build_model(arch, shape[0], shape[1], nc)
        avg.load_state_dict(weighted_average(states, wt.tolist()))
        logits[w] = test_logits(avg, exp.splits.test.x, device, train_cfg.precision)
    return logits, accs


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.detach().float().flatten().cpu() for v in state.values()])


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
    ids = [c for c, a in enumerate(exp.archs) if a == arch]
    if not ids:
        raise SystemExit(f"no client of architecture {arch!r} in {args.config} (clients: {exp.archs})")
    keys = {f.name for f in fields(TrainConfig)}
    train_cfg = TrainConfig(**{k: v for k, v in cfg["client"].items() if k in keys})
    snaps = sorted({int(s) for s in args.snapshots.split(",") if s}) or [train_cfg.epochs]
    if snaps[0] < 1 or snaps[-1] > train_cfg.epochs:
        raise SystemExit(f"snapshots must lie in 1..{train_cfg.epochs} (client.epochs), got {snaps}")
    shape, nc, device = exp.splits.shape, exp.splits.num_classes, exp.device
    test = exp.splits.test
    sizes = [len(exp.client_data[c]) for c in ids]
    weights = {"uniform": normalise([1.0] * len(ids)), "samples": normalise(sizes)}

    torch.manual_seed(derive_seed(cfg["seed"], "client-init", arch))
    init_state = {k: v.clone() for k, v in build_model(arch, shape[0], shape[1], nc).state_dict().items()}
    init_flat = flat(init_state)
    sums = {(e, w): {k: torch.zeros_like(v, dtype=torch.float64) for k, v in init_state.items()}
            for e in snaps for w in weights}
    logits: dict[int, list[torch.Tensor]] = {e: [] for e in snaps}
    rows: dict[int, dict] = {e: {"clients": [], "distance_from_init": []} for e in snaps}
    t0 = time.time()
    others: dict[str, dict] = {}
    if args.vote:
        for other in sorted(set(exp.archs) - {arch}):
            oids = [c for c, a in enumerate(exp.archs) if a == other]
            ow = {"uniform": normalise([1.0] * len(oids)),
                  "samples": normalise([len(exp.client_data[c]) for c in oids])}
            logits_o, accs = group_average_logits(other, oids, exp, cfg, train_cfg, ow)
            others[other] = {"clients": oids, "client_accuracy": accs, "logits": logits_o,
                             **{f"average_{w}": round(accuracy_report(v, test.y, nc)["accuracy"], 2)
                                for w, v in logits_o.items()}}
            print(f"{other}: {json.dumps({k: v for k, v in others[other].items() if k != 'logits'})}", flush=True)
    for j, c in enumerate(ids):
        model = build_model(arch, shape[0], shape[1], nc)
        model.load_state_dict(init_state)

        def snapshot(epoch: int, loss: float, j: int = j, c: int = c, model: torch.nn.Module = model) -> None:
            print(f"client {c} epoch {epoch} loss {loss:.4f} ({time.time() - t0:.0f} s)", flush=True)
            if epoch not in snaps:
                return
            state = model.state_dict()
            for w, wt in weights.items():
                for k, v in state.items():
                    sums[(epoch, w)][k] += float(wt[j]) * v.detach().double().cpu()
            out = test_logits(model, test.x, device, train_cfg.precision)
            model.train()
            logits[epoch].append(out)
            rows[epoch]["clients"].append(round(accuracy_report(out, test.y, nc)["accuracy"], 2))
            dist = float((flat(state) - init_flat).norm() / init_flat.norm())
            rows[epoch]["distance_from_init"].append(round(dist, 4))

        local_train(model, exp.client_data[c], train_cfg, device,
                    seed=derive_seed(cfg["seed"], "client-train", c), progress=snapshot)
    for e in snaps:
        rows[e]["ensemble"] = round(accuracy_report(torch.stack(logits[e]).mean(0), test.y, nc)["accuracy"], 2)
        for w in weights:
            avg = build_model(arch, shape[0], shape[1], nc)
            avg.load_state_dict({k: v.to(init_state[k].dtype) for k, v in sums[(e, w)].items()})
            out = test_logits(avg, test.x, device, train_cfg.precision)
            rows[e][f"average_{w}"] = round(accuracy_report(out, test.y, nc)["accuracy"], 2)
            if others:
                vote = torch.stack([out] + [o["logits"][w] for o in others.values()]).mean(0)
                rows[e][f"vote_{w}"] = round(accuracy_report(vote, test.y, nc)["accuracy"], 2)
                rows[e][f"vote_{w}_per_class"] = accuracy_report(vote, test.y, nc)["per_class"]
            rows[e][f"average_{w}_per_class"] = accuracy_report(out, test.y, nc)["per_class"]
        print(f"epoch {e}: {json.dumps(rows[e])}", flush=True)
    result = {"config": cfg, "overrides": args.overrides, "arch": arch, "clients": ids, "sizes": sizes,
              "other_archs": {a: {k: v for k, v in o.items() if k != "logits"} for a, o in others.items()},
              "train": train_cfg.to_dict(), "snapshots": {str(e): rows[e] for e in snaps},
              "minutes": round((time.time() - t0) / 60, 1), "processor": processor_name(),
              "threads": torch.get_num_threads()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
