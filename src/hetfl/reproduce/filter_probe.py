"""What FedMHO's K-means filter (Alg. 2) keeps and what it drops, measured on the uploads of archived
Table 4 cells.

The ablation cells find that, at our budgets, the filter costs FedMHO-MD and -SD accuracy, where the
paper finds that it helps. The paper's reason (Sec. 4.4) is label confusion: a lightweight CVAE
conditioned on one label occasionally decodes another class, and the filter removes such samples; too
low an R_th costs diversity instead (Sec. 5.4.4). This probe asks whether the dropped samples are in
fact the confused ones, and what the filter takes away besides. For one cell it reads the cell's uploads
from the upload cache (no client trains again), decodes the method's unfiltered synthetic set exactly as
the server stage does (:meth:`hetfl.methods.fedmho.FedMHO.decoded`: same decoders, allocation and seed),
applies the filter, and compares the kept and the dropped samples:

* ``agreement``: % whose label a *reference* classifier, trained on the dataset's real training split,
  predicts (how recognisable the sample is as its class);
* ``entropy``: that classifier's mean softmax entropy on them (nats);
* ``distance``: mean Euclidean distance of the pixels to the class's mean (what the filter ranks by;
  the reference records the same for the real training images, ``real_distance``);
* ``minority``: % drawn by a decoder other than the class's main one (the decoder that drew most of
  that class), i.e. how much of the other clients' styles survives.

The reference classifier is ours, not the paper's: a ``cnn2`` trained centrally with SGD on the whole
real training split (:func:`reference_model`); its test accuracy is recorded beside the probe.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetfl.fl.generative import kmeans_filter, teacher_logits, teacher_stats
from hetfl.fl.training import TrainConfig, evaluate, local_train
from hetfl.reproduce.probe_table import PROBE_FIELDS


def sources(alloc: torch.Tensor) -> torch.Tensor:
    """The decoder index of each generated sample, in :func:`hetfl.fl.generative.generate`'s order
    (decoder by decoder, the classes of each in order)."""
    return torch.repeat_interleave(torch.arange(alloc.shape[0]), alloc.long().sum(dim=1))


def class_centres(flat: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Per class, the mean of the flattened samples (zeros for a class with none)."""
    sums = torch.zeros(num_classes, flat.shape[1], dtype=flat.dtype, device=flat.device).index_add_(0, y, flat)
    counts = torch.bincount(y, minlength=num_classes).clamp(min=1).to(flat.dtype)
    return sums / counts[:, None]


def real_spread(data: Any, chunk: int = 10000) -> float:
    """Mean Euclidean distance of a real split's images (scaled to [0, 1], as the decoders' output) to
    their class's mean: the spread that a synthetic set's ``distance`` compares with."""
    flat = data.x.flatten(1).float() / 255.0
    centres = class_centres(flat, data.y, data.num_classes)
    total = sum(float((flat[s : s + chunk] - centres[data.y[s : s + chunk]]).norm(dim=1).sum())
                for s in range(0, len(flat), chunk))
    return round(total / max(len(flat), 1), 4)


def group_stats(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, minority: torch.Tensor,
                centres: torch.Tensor, num_classes: int) -> dict[str, Any]:
    """The probe's fields (module docstring) for one group of samples; ``None`` for an empty group."""
    if not len(y):
        return {"n": 0, **dict.fromkeys(PROBE_FIELDS)}
    told = teacher_stats(logits, y, num_classes)
    distance = (x.flatten(1).float() - centres[y]).norm(dim=1)
    return {"n": len(y), "agreement": told["agreement"], "entropy": told["entropy"],
            "distance": round(float(distance.mean()), 4), "minority": round(100.0 * float(minority.float().mean()), 4)}


def probe(x: torch.Tensor, y: torch.Tensor, alloc: torch.Tensor, r_th: float, logits: torch.Tensor,
          num_classes: int) -> dict[str, Any]:
    """Split the synthetic set ``(x, y)`` (drawn with the (K, C) allocation ``alloc``) by Alg. 2's filter
    at ``r_th`` and describe all, kept and dropped samples (:func:`group_stats`); ``logits`` are the
    reference classifier's on ``x``."""
    if alloc.ndim != 2 or alloc.shape[1] != num_classes or int(alloc.sum()) != len(y) or len(logits) != len(y):
        raise ValueError(f"alloc {tuple(alloc.shape)} (sum {int(alloc.sum())}) and logits {tuple(logits.shape)} "
                         f"do not describe {len(y)} samples over {num_classes} classes")
    centres = class_centres(x.flatten(1).float(), y, num_classes)
    main = alloc.argmax(dim=0)  # per class: the decoder that drew most of it (ties: the lower index)
    minority = sources(alloc).to(y.device) != main.to(y.device)[y]
    kept = torch.zeros(len(y), dtype=torch.bool, device=y.device)
    kept[kmeans_filter(x, y, r_th).to(y.device)] = True
    groups = {"all": torch.ones_like(kept), "kept": kept, "dropped": ~kept}
    return {name: group_stats(x[m], y[m], logits[m], minority[m], centres, num_classes) for name, m in groups.items()}


def reference_model(splits: Any, arch: str, epochs: int, seed: int, device: torch.device) -> tuple[nn.Module, float]:
    """A ``arch`` classifier trained centrally on the real training split (SGD lr 0.01, momentum 0.9,
    batch 64) and its test accuracy (%)."""
    from hetfl.models import build_model

    torch.manual_seed(seed)
    model = build_model(arch, splits.shape[0], splits.shape[1], splits.num_classes).to(device)
    local_train(model, splits.train, TrainConfig(epochs=epochs, batch_size=64, lr=0.01), device, seed=seed)
    return model.eval(), round(evaluate(model, splits.test, device)["accuracy"], 4)


def probe_cell(cfg: dict[str, Any], cache_dir: Path, method: str, reference: nn.Module,
               data_root: str | None = None, splits: Any = None) -> dict[str, Any]:
    """:func:`probe` on the synthetic set that ``method`` of the cell ``cfg`` (its ``config``) decodes
    from the cell's cached uploads, at the method's own ``r_th``; also the uploads' digest, so that a
    reader can check they are the cell's. ``splits``: the cell's dataset, if already loaded."""
    from hetfl.engine.simulator import Simulator, prepare
    from hetfl.fl.cache import uploads_digest

    exp = prepare(cfg, data_root, splits=splits)
    with tempfile.TemporaryDirectory() as out:
        algo, uploads, ctx = Simulator(exp, Path(out), cache_dir=cache_dir, quiet=True).cached_uploads(method)
    if not hasattr(algo, "decoded"):
        raise ValueError(f"{method} decodes no synthetic set (a FedMHO method is needed)")
    x, y, alloc = algo.decoded(uploads, ctx)
    with torch.no_grad():
        logits = teacher_logits([reference.to(x.device)], x)
    r_th = float(algo.params["r_th"])
    part = cfg["partition"]
    setting = f"{part['alpha']:g}" if "alpha" in part else str(part["kind"])
    return {"cell": cfg["name"], "dataset": cfg["dataset"], "setting": setting, "seed": cfg["seed"], "method": method,
            "r_th": r_th,
            "uploads_sha256": uploads_digest(uploads), **probe(x, y, alloc, r_th, logits, ctx.num_classes)}


def run_probes(cells: Sequence[dict[str, Any]], out: Path, cache_dir: Path, method: str = "fedmho_md",
               arch: str = "cnn2", epochs: int = 2, data_root: str | None = None, device: str | None = None,
               say: Any = print) -> dict[str, Any]:
    """:func:`probe_cell` on each cell summary of ``cells``, with one reference classifier per dataset
    (:func:`reference_model`, seed 0), written to ``out`` (JSON; probes of other cells already there are
    kept, a cell probed again is replaced). Returns what was written."""
    from hetfl.data import load_dataset
    from hetfl.engine.simulator import resolve_device
    from hetfl.reproduce.common import write_json_atomic

    saved = json.loads(out.read_text()) if out.is_file() else {}
    references: dict[str, Any] = saved.get("reference", {})
    probes = {p["cell"]: p for p in saved.get("probes", [])}
    models: dict[str, nn.Module] = {}
    loaded: dict[str, Any] = {}  # the dataset, loaded once per (dataset, data root, data settings)
    for summary in cells:
        cfg = {**summary["config"], **({"device": device} if device else {})}
        dataset = cfg["dataset"]
        root = data_root or cfg["data_root"]
        data_key = json.dumps([dataset, root, cfg["data"]], sort_keys=True, default=str)
        if data_key not in loaded:
            loaded[data_key] = load_dataset(dataset, root, cfg["data"])
        splits = loaded[data_key]
        if dataset not in models:
            say(f"{dataset}: training the reference {arch} ({epochs} epochs on the real training split)")
            models[dataset], accuracy = reference_model(splits, arch, epochs, 0, resolve_device(cfg["device"]))
            references[dataset] = {"arch": arch, "epochs": epochs, "seed": 0, "test_accuracy": accuracy,
                                   "real_distance": real_spread(splits.train)}
            say(f"{dataset}: reference test accuracy {accuracy:.2f} %")
        result = probe_cell(cfg, cache_dir, method, models[dataset], data_root, splits)
        recorded = summary.get("results", {}).get(method, {}).get("uploads_sha256")
        if recorded not in (None, result["uploads_sha256"]):
            raise ValueError(f"{cfg['name']}: the cache's uploads are not the ones {method} ran on "
                             f"({result['uploads_sha256'][:12]} against {recorded[:12]})")
        probes[cfg["name"]] = {**result, "reference": references[dataset]}
        say(f"{cfg['name']}: kept {result['kept']['agreement']:.1f} % recognised, dropped "
            f"{result['dropped']['agreement']:.1f} %")
    written = {"method": method, "reference": references, "probes": [probes[k] for k in sorted(probes)]}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, written)
    return written
