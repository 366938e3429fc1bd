"""How far a one-shot parameter average falls under the same clients' logit ensemble, epoch by epoch.

FedMHO's initial model w_0 (Eq. 4) is the parameter average of the classification clients, and the
paper's FedAvg is the same average; with VGG-9 clients it can fall far under their logit ensemble
(docs/results/fedmho.md). This script trains a config's clients of one architecture exactly as a ``hetfl run`` of that
config does (same shared initialisation, same data order, ``hetfl.fl.training.local_train``) and, at
each snapshot epoch, evaluates on the test split:

* each client alone, their logit ensemble (uniform), their parameter average (uniform = Eq. 4, and
  weighted by sample count = FedAvg);
* each client's relative distance from the shared initialisation, ||w_k - w_init|| / ||w_init||;
* with ``--vote``, the paper's FedAvg for model-heterogeneous clients ("the voting results of each
  model prototype", Sec. 5.1): the config's clients of every other architecture are trained for the
  full ``client.epochs`` too, averaged per architecture, and the vote is the uniform mean of the
  per-architecture averages' logits (as the authors' ``federated_average_ensemble.py`` computes it).

Training saves each client's parameters at the snapshot epochs (safetensors, in ``--snap-dir`` or
a temporary folder: VGG-9 is 276 MB a file); evaluation then loads one client at a time and keeps
running sums of the averages (one float64 model per weighting). Evaluation (``predict_logits``) is
in the config's client precision (bf16 autocast where it trains in bf16).

    .venv/bin/python scripts/averaging_gap.py configs/fedmho-fmnist-vgg9-e10.yaml \\
        --snapshots 1,2,5,10 --out docs/results/fedmho-runs/vgg9-averaging/base.json \\
        [--set client.lr=0.001 ...]

The clients can train in parallel processes, one per client (on one GPU: the paper's 200 local
epochs), and be evaluated together afterwards; the result is the same as one process's:

    S=/tmp/snaps; A="configs/fedmho-fmnist-vgg9-e10.yaml --set client.epochs=200 --set device=cuda
        --snapshots 10,50,100,200 --vote --snap-dir $S"
    for c in 0 1 2 3 4 5 6 7 8 9; do python scripts/averaging_gap.py $A --clients $c & done; wait
    python scripts/averaging_gap.py $A --evaluate-only --out $OUT/e200.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hetfl.config import load_config
from hetfl.engine.environment import processor_name
from hetfl.engine.experiment import Experiment, prepare
from hetfl.fl.aggregate import normalise
from hetfl.fl.method import derive_seed
from hetfl.fl.precision import autocast
from hetfl.fl.train_config import TrainConfig
from hetfl.fl.training import accuracy_report, local_train, predict_logits
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


def shared_init(arch: str, exp: Experiment) -> dict[str, torch.Tensor]:
    """The initialisation every client of ``arch`` starts from in ``hetfl run``."""
    shape = exp.splits.shape
    torch.manual_seed(derive_seed(exp.cfg["seed"], "client-init", arch))
    return {k: v.clone() for k, v in build_model(arch, shape[0], shape[1], exp.splits.num_classes).state_dict().items()}


def snapshot_path(folder: Path, arch: str, client: int, epoch: int) -> Path:
    return folder / f"{arch}-client{client}-e{epoch}.safetensors"


def train_clients(arch: str, ids: list[int], snaps: list[int], exp: Experiment, train_cfg: TrainConfig,
                  folder: Path, t0: float) -> None:
    """Train clients ``ids`` of ``arch`` as ``hetfl run`` does (shared initialisation, seeds, data order)
    and save each one's parameters at the snapshot epochs (safetensors, one file per client and epoch)."""
    init_state = shared_init(arch, exp)
    shape, nc = exp.splits.shape, exp.splits.num_classes
    for c in ids:
        model = build_model(arch, shape[0], shape[1], nc)
        model.load_state_dict(init_state)

        def snapshot(epoch: int, loss: float, c: int = c, model: torch.nn.Module = model) -> None:
            print(f"{arch} client {c} epoch {epoch} loss {loss:.4f} ({time.time() - t0:.0f} s)", flush=True)
            if epoch in snaps:
                save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                          str(snapshot_path(folder, arch, c, epoch)))

        local_train(model, exp.client_data[c], train_cfg, exp.device,
                    seed=derive_seed(exp.cfg["seed"], "client-train", c), progress=snapshot)


def evaluate_clients(arch: str, ids: list[int], epoch: int, exp: Experiment, precision: str,
                     weights: dict[str, torch.Tensor], folder: Path, init: dict[str, torch.Tensor]) -> Snapshot:
    """Each saved client of one snapshot epoch on the test split, and the weighted sums of their
    parameters; ``init`` is the architecture's :func:`shared_init` (distances are measured from it)."""
    init_flat = torch.cat([v.float().flatten() for v in init.values()])
    shape, nc = exp.splits.shape, exp.splits.num_classes
    model = build_model(arch, shape[0], shape[1], nc)
    snap = Snapshot()
    for j, c in enumerate(ids):
        path = snapshot_path(folder, arch, c, epoch)
        if not path.is_file():
            raise SystemExit(f"no snapshot {path}: train client {c} first (--clients {c} --snap-dir {folder})")
        saved = load_file(str(path))
        state = {k: saved[k] for k in init}  # the model's order (the file's is sorted by name)
        for w, wt in weights.items():
            sums = snap.sums.setdefault(w, {k: torch.zeros_like(v, dtype=torch.float64) for k, v in state.items()})
            for k, v in state.items():
                sums[k] += float(wt[j]) * v.double()
        model.load_state_dict(state)
        with autocast(exp.device, precision):
            snap.logits.append(predict_logits(model, exp.splits.test, exp.device).cpu())
        snap.clients.append(accuracy(snap.logits[-1], exp))
        flat = torch.cat([v.float().flatten() for v in state.values()])
        snap.distance_from_init.append(round(float((flat - init_flat).norm() / init_flat.norm()), 4))
    return snap


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


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--arch", default=None, help="client architecture to average (default: the server's)")
    ap.add_argument("--snapshots", default="", help="comma-separated epochs (default: the last epoch)")
    ap.add_argument("--vote", action="store_true", help="also train the other architectures' clients "
                    "and report the vote of the per-architecture averages")
    ap.add_argument("--snap-dir", default=None, help="folder for the clients' snapshot parameters "
                    "(default: a temporary folder, removed at the end)")
    ap.add_argument("--clients", default=None, help="comma-separated client ids: train only these, save their "
                    "snapshots in --snap-dir and stop (one process per client, then --evaluate-only)")
    ap.add_argument("--evaluate-only", action="store_true", help="train nothing: evaluate the snapshots "
                    "already in --snap-dir")
    ap.add_argument("--out", default=None, help="result JSON (needed unless --clients)")
    args = ap.parse_args()
    if (args.clients is not None or args.evaluate_only) and args.snap_dir is None:
        ap.error("--clients and --evaluate-only need --snap-dir")
    if args.clients is not None and args.evaluate_only:
        ap.error("--clients trains and --evaluate-only does not: give one of them")
    if args.clients is None and args.out is None:
        ap.error("--out is required unless --clients")
    return args


def main() -> None:
    args = parse_args()
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
    # which epochs of which clients: every snapshot of ``arch``, the last epoch of the others (the vote)
    wanted = {a: (snaps if a == arch else [train_cfg.epochs]) for a in groups if a == arch or args.vote}
    owner = {c: a for a, ids in groups.items() for c in ids}
    chosen = None if args.clients is None else [int(c) for c in args.clients.split(",") if c]
    if chosen is not None and (bad := [c for c in chosen if owner.get(c) not in wanted]):
        raise SystemExit(f"clients {bad} are not among those this run averages: "
                         f"{sorted(c for a in wanted for c in groups[a])}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.snap_dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        if not args.evaluate_only:
            for a, epochs in wanted.items():
                ids = [c for c in groups[a] if chosen is None or c in chosen]
                train_clients(a, ids, epochs, exp, train_cfg, folder, t0)
        if chosen is None:
            result = evaluate(arch, groups, wanted, snaps, exp, train_cfg, folder)
            result.update(config=cfg, overrides=args.overrides, minutes=round((time.time() - t0) / 60, 1),
                          processor=processor_name(), threads=torch.get_num_threads())
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def evaluate(arch: str, groups: dict[str, list[int]], wanted: dict[str, list[int]], snaps: list[int],
             exp: Experiment, train_cfg: TrainConfig, folder: Path) -> dict:
    """The result: every snapshot of ``arch`` (clients, ensemble, averages, vote with the other
    architectures' final averages) from the saved parameters."""
    others: dict[str, dict] = {}
    for other in (a for a in wanted if a != arch):  # their full-length averages vote
        ids = groups[other]
        final = evaluate_clients(other, ids, train_cfg.epochs, exp, train_cfg.precision,
                                 client_weights(exp, ids), folder, shared_init(other, exp))
        logits = {w: average_logits(other, s, exp, train_cfg.precision) for w, s in final.sums.items()}
        others[other] = {"clients": ids, "client_accuracy": final.clients, "logits": logits,
                         **{f"average_{w}": accuracy(v, exp) for w, v in logits.items()}}
    ids, init, weights = groups[arch], shared_init(arch, exp), client_weights(exp, groups[arch])
    rows = {}
    for e in snaps:
        snap = evaluate_clients(arch, ids, e, exp, train_cfg.precision, weights, folder, init)
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
    return {"arch": arch, "clients": ids, "sizes": [len(exp.client_data[c]) for c in ids],
            "other_archs": {a: {k: v for k, v in o.items() if k != "logits"} for a, o in others.items()},
            "train": train_cfg.to_dict(), "snapshots": {str(e): rows[e] for e in snaps}}


if __name__ == "__main__":
    main()
