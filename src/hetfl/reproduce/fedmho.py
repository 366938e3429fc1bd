"""`hetfl reproduce fedmho`: FedMHO's Table 4 (MNIST and Fashion rows), Table 6, Table 8 and Fig. 6.

Every cell (dataset x Dir(alpha) x seed) is one simulator run of the chosen methods with the
paper's model assignment (Table 1): the baselines' clients are "large" (clients 0-4) and "small"
(clients 5-9) classifiers, FedMHO's clients 0-4 train the large classifier (same requests as the
baselines', so the uploads are shared through the cache) and clients 5-9 train CVAE-small, and
FedCVAE's clients train CVAE-large (0-4) and CVAE-small (5-9). Finished cells are skipped, so the
command resumes after an interruption; the results file is rewritten after each cell.

Options: ``--ablation`` adds Table 6 (FedMHO-MD/SD without the K-means filter, on as many
samples as the filter keeps) and Table 8 (R_th in 0.4, 0.6, 0.9; the paper's Table 8 is on EMNIST,
so our MNIST/Fashion numbers stand without a paper column); ``--curve`` adds Fig. 6 (test accuracy
per server epoch of FedMHO, FedMHO-MD and FedMHO-SD over a longer server training).

Budgets (:data:`BUDGETS`): ``paper``; ``reduced`` (cnn2 classifiers, a few hours for the grid);
``vgg9-e10`` (``reduced`` with the paper's VGG-9 classifiers and server, 10 local epochs in bf16;
about 47 min per MNIST cell for the FedMHO family on 2 avx512_bf16 cores, 7-8 min for all eight
methods on a GPU); ``vgg9-e50`` (``vgg9-e10`` with 50 local epochs for the classifiers, the plateau of
the paper's Fig. 7; a GPU budget); ``reduced-feddf-partition`` and ``vgg9-e10-feddf-partition``
(the same on the partition of the authors' code, ``feddf_dirichlet``: equal client slices, which
``paper`` uses too).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

from hetfl.reproduce import common
from hetfl.reproduce.common import budget_cells, csv, failure_note, minutes_per_machine, run_cell, stats
from hetfl.reproduce.probe_table import probe_file, probe_lines

METHODS = ("fedavg", "feddf", "dense", "coboosting", "fedcvae_ens", "fedmho", "fedmho_md", "fedmho_sd")
BASELINES = tuple(m for m in METHODS if not m.startswith("fedmho"))  # what the paper ranks MD/SD against
LABELS = {"fedavg": "FedAvg", "feddf": "FedDF", "dense": "DENSE", "coboosting": "Co-Boosting",
          "fedcvae_ens": "FedCVAE(-Ens)", "fedcvae_kd": "FedCVAE-KD", "fedmho": "FedMHO",
          "fedmho_md": "FedMHO-MD", "fedmho_sd": "FedMHO-SD",
          "fedmho_md_klmean": "FedMHO-MD, KL mean (authors' code)",
          "fedmho_sd_klmean": "FedMHO-SD, KL mean (authors' code)"}
SETTINGS = ("0.5", "0.3", "0.1")
DATASETS = ("mnist", "fmnist")
PREFIX = "fedmho"

# Table 4, top-1 % (mean ± sd over the paper's seeds), alpha = 0.5, 0.3, 0.1.
PAPER: dict[str, dict[str, list[str]]] = {
    "mnist": {
        "fedavg": ["85.91±0.57", "74.57±0.73", "49.12±2.99"], "feddf": ["88.73±1.29", "78.46±0.91", "62.58±4.50"],
        "dense": ["90.51±2.39", "86.12±1.01", "73.76±1.72"], "coboosting": ["91.42±1.44", "89.27±0.48", "81.30±0.54"],
        "fedcvae_ens": ["92.61±0.25", "91.37±0.65", "89.73±0.40"], "fedmho": ["93.45±0.65", "92.43±0.42", "88.48±0.99"],
        "fedmho_md": ["95.71±0.68", "93.98±0.69", "91.22±0.56"],
        "fedmho_sd": ["95.67±0.47", "94.25±0.18", "91.55±0.27"],
    },
    "fmnist": {
        "fedavg": ["60.24±1.47", "47.36±0.21", "30.37±0.79"], "feddf": ["65.66±1.36", "59.21±2.20", "42.21±2.80"],
        "dense": ["72.29±2.63", "68.14±0.97", "56.12±3.94"], "coboosting": ["72.98±1.61", "69.50±0.64", "61.73±1.36"],
        "fedcvae_ens": ["69.11±1.35", "68.39±0.49", "64.01±2.47"], "fedmho": ["75.30±0.62", "72.36±0.92", "62.14±1.45"],
        "fedmho_md": ["77.27±0.48", "75.69±0.93", "71.04±0.50"],
        "fedmho_sd": ["77.73±0.59", "76.45±0.53", "69.65±0.99"],
    },
}
# Table 6: FedMHO-MD / FedMHO-SD without unsupervised data optimisation.
PAPER_NOFILTER = {
    "mnist": {"fedmho_md": ["94.45±0.42", "92.33±0.23", "90.66±0.31"],
              "fedmho_sd": ["94.70±0.38", "93.17±0.32", "90.33±0.86"]},
    "fmnist": {"fedmho_md": ["74.56±1.02", "73.15±0.52", "65.13±0.91"],
               "fedmho_sd": ["75.11±1.93", "74.12±2.40", "65.42±3.68"]},
}
RTH_SWEEP = (0.4, 0.6, 0.9)
CURVE_METHODS = ("fedmho", "fedmho_md", "fedmho_sd")

BUDGETS: dict[str, dict[str, Any]] = {
    # Sec. 5.1 and Table 3: VGG-9 / CNN clients, 200 local epochs, SGD 5e-3, batch 64; CVAEs and
    # server at the per-dataset values (null = the method's per-dataset default); Fig. 6: 100 epochs.
    "paper": {"large": "vgg9", "small": "lenet5", "server": "vgg9", "client_epochs": 200, "cvae": {},
              "fedcvae_cvae": ["cvae_large"] * 5 + ["cvae_small"] * 5, "gen_epochs": 200, "generator_steps": 30,
              "gen_batch": 64, "feddf_steps": 10000, "curve_epochs": 100, "partition": "feddf_dirichlet"},
    # Fits one cell into ~40 minutes on 2 shared CPU cores (docs/results/fedmho.md): cnn2 instead of
    # VGG-9, 5 local epochs, CVAE-small everywhere with 10 local epochs (paper: 30) at the paper's
    # Adam lr, the paper's server settings.
    "reduced": {"large": "cnn2", "small": "lenet5", "server": "cnn2", "client_epochs": 5,
                "cvae": {"cvae_epochs": 10}, "fedcvae_cvae": "cvae_small", "gen_epochs": 20,
                "generator_steps": 10, "gen_batch": 64, "feddf_steps": 1000, "curve_epochs": 30},
    # The reduced budget with the paper's classifiers: VGG-9 clients (10 local epochs, bf16 autocast:
    # 0.35 s per batch of 64 against 0.45 s in fp32 on 2 AVX-512 cores; emulated and 37x slower on a
    # CPU without native bf16) and a VGG-9 server (fp32, the paper's server settings). With it SD beats
    # plain FedMHO in 14 of 18 seed-cells and MD in 9 of 18, where cnn2 made both lose 18 of 18
    # (docs/results/fedmho-notes.md). 46-48 min per MNIST cell for FedAvg and the FedMHO family on 2
    # avx512_bf16 cores, 15-17 more for FedCVAE-Ens; with VGG-9 teachers DENSE 11 min and Co-Boosting
    # 17 min (server only), FedDF an estimated 22 min. On an H100 or H200 shared by seven cells: 6-8 min
    # for all eight methods.
    "vgg9-e10": {"large": "vgg9", "small": "lenet5", "server": "vgg9", "client_epochs": 10,
                 "client_precision": "bf16", "cvae": {"cvae_epochs": 10}, "fedcvae_cvae": "cvae_small",
                 "gen_epochs": 20, "generator_steps": 10, "gen_batch": 64, "feddf_steps": 1000,
                 "curve_epochs": 30},
}
# ``vgg9-e10`` with the VGG-9 and CNN clients trained 50 local epochs, where the paper's Fig. 7 (EMNIST)
# shows FedMHO's accuracy levelling off. The two budgets differ in the classifiers' training alone
# (does its length explain Fashion's gap to the paper?). About five times vgg9-e10's client time.
BUDGETS["vgg9-e50"] = {**BUDGETS["vgg9-e10"], "client_epochs": 50}
# The partition of the authors' code (FedDF's ``DataPartitioner``, :func:`hetfl.data.partition`
# ``feddf_dirichlet``): the same Dirichlet rule, but the clients are equal slices of the workers'
# concatenated lists, seeded as that code's ``--manual_seed``. Read in the forty-first session; the
# earlier budgets keep ``dirichlet`` (``min_size: half``), whose clients are the Dirichlet workers.
PAPER_PARTITION = BUDGETS["paper"]["partition"]
BUDGETS["reduced-feddf-partition"] = {**BUDGETS["reduced"], "partition": PAPER_PARTITION}
BUDGETS["vgg9-e10-feddf-partition"] = {**BUDGETS["vgg9-e10"], "partition": PAPER_PARTITION}


def partition_spec(budget: str, setting: str) -> dict[str, Any]:
    """Dir(alpha) as the budget's partition (``dirichlet`` with FedDF's half-average floor unless
    the budget names ``feddf_dirichlet``)."""
    if BUDGETS[budget].get("partition", "dirichlet") == PAPER_PARTITION:
        return {"kind": PAPER_PARTITION, "alpha": float(setting)}
    return {"kind": "dirichlet", "alpha": float(setting), "min_size": "half"}


def method_params(budget: str) -> dict[str, dict[str, Any]]:
    b = BUDGETS[budget]
    gen = {"epochs": b["gen_epochs"], "generator_steps": b["generator_steps"], "batch_size": b["gen_batch"]}
    # FedDF as FedMHO's baselines run it (Sec. 5.1): a student per client architecture, each from its
    # FedAvg, and their vote (cells archived before the fortieth session: one student from scratch)
    return {"fedavg": {}, "feddf": {"steps": b["feddf_steps"], "eval_every": 100, "prototypes": "all"},
            "dense": dict(gen),
            "coboosting": dict(gen), "fedcvae_ens": {**b["cvae"], "cvae": b["fedcvae_cvae"]},
            "fedcvae_kd": {**b["cvae"], "cvae": b["fedcvae_cvae"]},
            "fedmho": dict(b["cvae"]), "fedmho_md": dict(b["cvae"]), "fedmho_sd": dict(b["cvae"]),
            "fedmho_md_klmean": dict(b["cvae"]), "fedmho_sd_klmean": dict(b["cvae"])}


def cell_config(dataset: str, setting: str, seed: int, budget: str, methods: tuple[str, ...] = METHODS,
                variant: str = "main") -> dict[str, Any]:
    """One cell. ``variant``: ``main`` (Table 4), ``nofilter`` (Table 6), ``rth<R>`` (Table 8),
    ``curve`` (Fig. 6)."""
    b = BUDGETS[budget]
    params = method_params(budget)
    chosen = {m: dict(params[m]) for m in methods}
    if variant == "nofilter":
        chosen = {m: {**params[m], "filter": False, "num_samples": 4800} for m in ("fedmho_md", "fedmho_sd")}
    elif variant.startswith("rth"):
        chosen = {m: {**params[m], "r_th": float(variant[3:])} for m in CURVE_METHODS}
    elif variant == "curve":
        chosen = {m: {**params[m], "epochs": b["curve_epochs"]} for m in CURVE_METHODS}
    elif variant != "main":
        raise ValueError(f"unknown variant {variant!r}")
    suffix = "" if variant == "main" else f"-{variant}"
    return {
        "name": f"{PREFIX}-{dataset}-a{setting}{suffix}-s{seed}-{budget}", "seed": seed, "dataset": dataset,
        "partition": partition_spec(budget, setting), "clients": 10,
        "client": {"model": [b["large"]] * 5 + [b["small"]] * 5, "epochs": b["client_epochs"], "batch_size": 64,
                   "lr": 0.005, "momentum": 0.9,
                   **({"precision": b["client_precision"]} if "client_precision" in b else {})},
        "server": {"model": b["server"]},
        "methods": chosen,
    }


def grid(datasets: list[str], settings: list[str], seeds: list[int], budget: str, methods: tuple[str, ...],
         ablation: bool = False, curve: bool = False) -> list[dict[str, Any]]:
    cells = [cell_config(d, s, seed, budget, methods) for d in datasets for s in settings for seed in seeds]
    if ablation:
        variants = ["nofilter", *(f"rth{r}" for r in RTH_SWEEP)]
        cells += [cell_config(d, s, seed, budget, variant=v) for d in datasets for s in settings for seed in seeds
                  for v in variants]
    if curve:
        cells += [cell_config(d, "0.5", seed, budget, variant="curve") for d in datasets for seed in seeds[:1]]
    return cells


# ---- report ---------------------------------------------------------------------------------------
def _variant(cfg: dict[str, Any]) -> str:
    """``fedmho-<dataset>-a<alpha>[-<variant>]-s<seed>-<budget>``; a budget's name may hold dashes."""
    part = cfg["name"].split("-")[3]
    return "main" if part[:1] == "s" and part[1:].isdigit() else part


def _alpha(cfg: dict[str, Any]) -> str:
    return f"{cfg['partition']['alpha']:g}"


def _cells(root: Path, budget: str, archive: Path | None = None) -> list[dict[str, Any]]:
    """The cells of one budget, from the runs folder and the archive (:func:`common.cell_summaries`)."""
    return budget_cells(root, PREFIX, budget, archive)


def _ours(runs: list[dict[str, Any]]) -> str:
    if not runs:
        return "not run"
    seeds = f" n={len(runs)}" if len(runs) > 1 else ""
    return f"{stats([r['accuracy'] for r in runs])} ({stats([r['best_accuracy'] for r in runs])}){seeds}"


def _table(cells: list[dict[str, Any]], methods: tuple[str, ...], paper: dict[str, list[str]] | None) -> list[str]:
    head = " | ".join(f"Dir({s}) ours | Dir({s}) paper" if paper else f"Dir({s}) ours" for s in SETTINGS)
    lines = ["| method | " + head + " |", "|---|" + ("---|---|" if paper else "---|") * len(SETTINGS)]
    for method in methods:
        row = [LABELS[method]]
        for i, setting in enumerate(SETTINGS):
            runs = [s["results"][method] for s in cells if _alpha(s["config"]) == setting and method in s["results"]]
            row.append(_ours(runs) + common.older_mark(method, runs)
                       + (f" | {paper.get(method, ['-'] * 3)[i]}" if paper else ""))
        lines.append("| " + " | ".join(row) + " |")
        if method in ("fedavg", "feddf") and any(_vote(s, method) is not None for s in cells):
            row = [f"{LABELS[method]}, vote of the per-architecture models (the paper's protocol; cells with it)"]
            for setting in SETTINGS:
                votes = [v for s in cells if _alpha(s["config"]) == setting and (v := _vote(s, method)) is not None]
                row.append(_ours([{"accuracy": v, "best_accuracy": v} for v in votes])
                           + (f" | {paper.get(method, ['-'] * 3)[SETTINGS.index(setting)]}" if paper else ""))
            lines.append("| " + " | ".join(row) + " |")
    return lines + common.older_note(methods, cells)


def _vote(cell: dict[str, Any], method: str) -> float | None:
    """A method's vote of its per-architecture models (``<method>[vote]``), where the cell reports it."""
    return ((cell["results"].get(method) or {}).get("models") or {}).get(f"{method}[vote]")


def feddf_protocol_note(cells: list[dict[str, Any]]) -> str:
    """Which FedDF cells ran before the per-architecture protocol (one student of the server's
    architecture, from scratch, no vote); empty when none did."""
    ran = [s for s in cells if "feddf" in s["results"]]
    old = [s for s in ran if (s["config"]["methods"].get("feddf") or {}).get("prototypes") != "all"]
    if not old:
        return ""
    return (f"FedDF: {len(old)} of {len(ran)} cells ran before the fortieth session's protocol, with one "
            "student of the server's architecture from scratch and no vote; the paper (Sec. 5.1) distils a "
            "student per architecture, each from its FedAvg, and reports their vote (measured at `reduced` "
            "on retrained uploads: the fortieth session's notes).")


def _all_cached(cell: dict[str, Any]) -> bool:
    """Every method of the cell got every upload from the cache, and none of the cell's own processes
    trained them (`--jobs`: the cell's clients' job trains them into the cache, then its methods read
    them there): its minutes are server stages."""
    from hetfl.engine.simulator import UPLOADS_TRAINED  # lazily: this module stays torch-free (cli's help)

    clients = cell["config"]["clients"]
    return (not cell.get(UPLOADS_TRAINED)
            and all(r.get("cached_uploads") == clients for r in cell["results"].values()))


def _minutes(cells: list[dict[str, Any]]) -> str:
    per_machine = minutes_per_machine(cells, "cell(s)")
    if not per_machine:
        return ""
    cached = sum(_all_cached(s) for s in cells if s.get("minutes"))
    note = f"; {cached} of them with every client upload from the cache (server stages only)" if cached else ""
    return f"Minutes per cell (all methods, incl. local training unless cached): {per_machine}{note}."


def _paper_mean(value: str) -> float:
    return float(value.split("±")[0])


def _not_compared(runs: list[dict[str, Any]]) -> str:
    """The baselines that :func:`_best_baseline` leaves out of ``runs``: never run, or not on every seed."""
    ran = {m: sum(m in s["results"] for s in runs) for m in BASELINES}
    never = [LABELS[m] for m, k in ran.items() if k == 0]
    partly = [LABELS[m] for m, k in ran.items() if 0 < k < len(runs)]
    return "; ".join([f"{', '.join(never)} (not run)"] * bool(never)
                     + [f"{', '.join(partly)} (not run on every seed)"] * bool(partly))


def _ordering(cells: list[dict[str, Any]], dataset: str) -> str:
    """Per setting, over the seeds that ran FedMHO-MD and -SD: are their mean final accuracies above
    every baseline run on all those seeds (the paper's ordering), and do they match the paper's mean?
    Baselines missing from some seed are named, not silently left out; the per-seed count compares
    MD and SD with every baseline run in that seed."""
    verdicts = []
    for i, setting in enumerate(SETTINGS):
        runs = [s for s in cells if _alpha(s["config"]) == setting
                and all(m in s["results"] for m in ("fedmho_md", "fedmho_sd"))]
        if not runs:
            continue
        mean = {m: statistics.fmean(s["results"][m]["accuracy"] for s in runs) for m in ("fedmho_md", "fedmho_sd")}
        best = _best_baseline(runs)
        head = f"Dir({setting}), n={len(runs)}: "
        if best is None:
            verdicts.append(head + "no baseline ran on every seed of FedMHO-MD/SD")
            continue
        parts = []
        for m in ("fedmho_md", "fedmho_sd"):
            above = "above" if mean[m] > best[1] else "below"
            paper = _paper_mean(PAPER[dataset][m][i])
            parts.append(f"{LABELS[m]} {mean[m]:.2f} ({above} the best baseline; "
                         f"{'matches' if mean[m] >= paper else 'under'} the paper's {paper:.2f})")
        verdict = head + ", ".join(parts) + f"; best baseline {LABELS[best[0]]} {best[1]:.2f}"
        if missing := _not_compared(runs):
            verdict += f"; not compared: {missing}"
        wins = sum(all(s["results"][v]["accuracy"] > s["results"][b]["accuracy"]
                       for v in ("fedmho_md", "fedmho_sd") for b in BASELINES if b in s["results"]) for s in runs)
        verdicts.append(verdict + f"; per seed, MD and SD above every baseline run in {wins} of {len(runs)}")
    return ("Paper's ordering (FedMHO-MD/SD above every baseline, mean final %): "
            + ("; ".join(verdicts) if verdicts else "no cell with FedMHO-MD and -SD yet") + ".")


STANDING_INTRO = """Mean final-epoch % over the seeds run (n), Table 4 cells; "KL mean" = the authors' code's KD
reduction (`fedmho_md_klmean`, `fedmho_sd_klmean`; "(n=k)" where it ran on other seeds than MD/SD).
The best baseline is the highest mean among FedAvg, FedDF, DENSE, Co-Boosting and FedCVAE-Ens, over
the baselines run on every seed that MD/SD ran. **Bold** = above that baseline (the paper's
ordering). The last column is ours minus the paper for MD / SD."""


def standing_report(root: Path, archive: Path | None = None) -> str:
    """Markdown: per budget with Table 4 cells, one row per (dataset, Dir(alpha)): the paper's and our
    FedMHO, FedMHO-MD and -SD, the authors' KL reduction, the best baseline, and the gap to the paper."""
    lines: list[str] = []
    for budget in BUDGETS:
        main = [s for s in _cells(root, budget, archive) if _variant(s["config"]) == "main"]
        if not main:
            continue
        lines += [f"### Budget `{budget}`", "",
                  "| dataset | setting | FedMHO paper / ours | MD / SD paper | MD / SD ours | MD / SD ours, KL mean "
                  "| best baseline | ours - paper (MD / SD) |", "|---|---|---|---|---|---|---|---|"]
        lines += [_standing_row(main, d, i) for d in DATASETS for i in range(len(SETTINGS))]
        lines.append("")
    if not lines:
        return ""
    return "\n".join(["## Where the reproduction stands (Table 4, final epoch)", "", STANDING_INTRO, "", *lines])


def _best_baseline(runs: list[dict[str, Any]]) -> tuple[str, float] | None:
    """The baseline (:data:`BASELINES`) run in all ``runs`` with the highest mean final accuracy, and
    that mean; None if no baseline ran in all of them."""
    mean = {m: statistics.fmean(s["results"][m]["accuracy"] for s in runs)
            for m in BASELINES if runs and all(m in s["results"] for s in runs)}
    return max(mean.items(), key=lambda kv: kv[1]) if mean else None


def _standing_row(cells: list[dict[str, Any]], dataset: str, i: int) -> str:
    runs = [s for s in cells if s["config"]["dataset"] == dataset and _alpha(s["config"]) == SETTINGS[i]]

    def mean(method: str) -> float | None:
        got = [s["results"][method]["accuracy"] for s in runs if method in s["results"]]
        return statistics.fmean(got) if got else None

    def seeds(method: str) -> set[int]:
        return {s["config"]["seed"] for s in runs if method in s["results"]}

    def show(value: float | None, bold: bool = False) -> str:
        return "-" if value is None else (f"**{value:.2f}**" if bold else f"{value:.2f}")

    paper = PAPER[dataset]
    with_md = [s for s in runs if "fedmho_md" in s["results"]]
    best = _best_baseline(with_md)
    md, sd = mean("fedmho_md"), mean("fedmho_sd")
    ours = " / ".join(show(v, best is not None and v is not None and v > best[1]) for v in (md, sd))
    ours = f"{ours} n={len(with_md)}" if with_md else "not run"
    # the KL-mean variants often ran on other seeds than MD/SD: say on how many where the seeds differ
    klmean = " / ".join(show(mean(m)) + (f" (n={len(seeds(m))})" if seeds(m) and seeds(m) != seeds("fedmho_md") else "")
                        for m in ("fedmho_md_klmean", "fedmho_sd_klmean"))
    gaps = " / ".join("-" if v is None else f"{v - _paper_mean(paper[m][i]):+.2f}"
                      for m, v in (("fedmho_md", md), ("fedmho_sd", sd)))
    return (f"| {dataset.upper()} | Dir({SETTINGS[i]}) | {_paper_mean(paper['fedmho'][i]):.2f} / "
            f"{show(mean('fedmho'))} | {_paper_mean(paper['fedmho_md'][i]):.2f} / "
            f"{_paper_mean(paper['fedmho_sd'][i]):.2f} | {ours} | "
            f"{klmean} | "
            f"{f'{best[1]:.2f} {LABELS[best[0]]}' if best else '-'} | {gaps} |")


KD_VARIANTS = ("fedmho_md", "fedmho_sd", "fedmho_md_klmean", "fedmho_sd_klmean")
KD_COST_INTRO = """Each point is one Table 4 cell and seed: x = FedMHO minus w_0 (how far the KD teachers' side,
the classifiers' average w_0, is below what CE alone reaches on the synthetic set), y = FedMHO minus
the KD variant (what the KD term costs; above 0 = the variant is below plain FedMHO). Final-epoch %.
The paper has y < 0 in every MNIST/Fashion cell (MD/SD above FedMHO by {low:.2f}-{high:.2f} points)."""


def _paper_kd_gains() -> list[float]:
    """The paper's FedMHO-MD/SD minus FedMHO, over its MNIST and Fashion-MNIST Table 4 cells."""
    return [_paper_mean(PAPER[d][m][i]) - _paper_mean(PAPER[d]["fedmho"][i])
            for d in DATASETS for m in ("fedmho_md", "fedmho_sd") for i in range(len(SETTINGS))]


def kd_costs(cells: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Per KD variant, one ``(FedMHO - w_0, FedMHO - variant)`` point (final %) per cell that ran both."""
    points: dict[str, list[tuple[float, float]]] = {}
    for s in cells:
        r = s["results"]
        if r.get("fedmho", {}).get("init_accuracy") is None:
            continue
        gap = r["fedmho"]["accuracy"] - r["fedmho"]["init_accuracy"]
        for m in KD_VARIANTS:
            if m in r:
                points.setdefault(m, []).append((gap, r["fedmho"]["accuracy"] - r[m]["accuracy"]))
    return points


def kd_teacher_points(cells: list[dict[str, Any]]) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """Per (KD variant, dataset), one ``(teacher agreement %, FedMHO - variant)`` point (final %) per
    cell where the variant recorded its teacher (:func:`hetfl.fl.generative.teacher_stats`, runs since
    the forty-third session) and plain FedMHO ran: how often the teacher's argmax is the synthetic
    label, against what its KD term costs."""
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in cells:
        r = s["results"]
        if "fedmho" not in r:
            continue
        for m in KD_VARIANTS:
            stats = r.get(m, {}).get("teacher")
            if stats and stats.get("agreement") is not None:
                points.setdefault((m, s["config"]["dataset"]), []).append(
                    (stats["agreement"], r["fedmho"]["accuracy"] - r[m]["accuracy"]))
    return points


def _teacher_lines(points: dict[tuple[str, str], list[tuple[float, float]]], budget: str, path: Path) -> list[str]:
    """The table and figure of :func:`kd_teacher_points` for one budget ([] without points)."""
    from hetfl.report import plot_scatter_fits

    if not points:
        return []
    lines = ["", f"Against the KD teacher (budget `{budget}`): x = % of the filtered synthetic samples whose label "
             "the teacher's argmax gives (MD: the classifiers' mean logits; SD: w_0), y = FedMHO minus the "
             "variant (final %), per dataset. Where the fit crosses 0 (shown for r <= -0.5), the KD term "
             "starts to pay.",
             "",
             "| variant | dataset | points | agreement % (range) | fit: cost = a + b x agreement | r | pays above |",
             "|---|---|---|---|---|---|---|"]
    for (m, dataset), pts in sorted(points.items()):
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        fit, r, line, corr = _fit_columns(xs, ys)
        zero = "-"
        if line is not None and line.slope < 0 and corr <= -0.5:  # only where the line says much
            zero = f"{-line.intercept / line.slope:.1f} %"
        lines.append(f"| {LABELS[m]} | {dataset.upper()} | {len(pts)} | {min(xs):.1f}-{max(xs):.1f} | {fit} | {r} | "
                     f"{zero} |")
    figure = path.with_name(f"{path.stem}-kd-teacher-{budget}.png")
    if plot_scatter_fits({f"{LABELS[m]}, {d.upper()}": pts for (m, d), pts in sorted(points.items())}, figure,
                         "teacher agrees with the synthetic label (%)", "FedMHO - KD variant (final %)",
                         f"FedMHO: KD cost against the teacher's agreement, budget {budget}"):
        lines += ["", f"![KD cost against the teacher, {budget}]({figure.name})"]
    return lines


_LABELS_CACHE: dict[tuple[str, str, str], Any] = {}


def recomputed_class_counts(summary: dict[str, Any]) -> Any:
    """The cell's (clients, classes) counts from its partition recomputed from its config (the same
    seeded :func:`hetfl.data.make_partition` as the run), for summaries that predate
    ``clients.class_counts``; None when the dataset is not on this disk or the client sizes disagree
    with the recorded ones."""
    from hetfl.data import load_dataset, make_partition

    cfg = summary["config"]
    key = (cfg["dataset"], str(cfg.get("data_root", "data")), json.dumps(cfg.get("data", {}), sort_keys=True))
    try:
        if key not in _LABELS_CACHE:
            splits = load_dataset(key[0], key[1], cfg.get("data", {}))
            _LABELS_CACHE[key] = (splits.train.y.numpy(), splits.num_classes)
        labels, num_classes = _LABELS_CACHE[key]
    except (OSError, ValueError):  # no data here (a fresh clone before `make data`), or another format
        return None
    part = make_partition(labels, cfg["clients"], cfg["partition"], cfg["seed"], num_classes=num_classes)
    if part.sizes.tolist() != summary.get("clients", {}).get("sizes", part.sizes.tolist()):
        return None
    return part.counts


def class_shares(summary: dict[str, Any]) -> list[float] | None:
    """Per class, the % of its training images that FedMHO's classification clients hold (the rest
    are with the generative clients), from the summary's ``clients.class_counts`` or else
    :func:`recomputed_class_counts`; None when FedMHO did not run or the counts are unknown."""
    import numpy as np

    generative = summary["results"].get("fedmho", {}).get("generative_clients")
    counts = summary.get("clients", {}).get("class_counts")
    if generative is None or (counts is None and (counts := recomputed_class_counts(summary)) is None):
        return None
    counts = np.asarray(counts)
    classifiers = [k for k in range(len(counts)) if k not in set(generative)]
    return [100.0 * float(h) / max(1, int(n)) for h, n in zip(counts[classifiers].sum(axis=0), counts.sum(axis=0))]


def kd_class_costs(cells: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Per KD variant, one ``(share of the class held by the classification clients, FedMHO - variant)``
    point (per-class final %) per class of every cell that ran both and whose partition is known."""
    points: dict[str, list[tuple[float, float]]] = {}
    for s in cells:
        r = s["results"]
        base = r.get("fedmho", {}).get("per_class")
        if not base or not any(r.get(m, {}).get("per_class") for m in KD_VARIANTS):
            continue
        shares = class_shares(s)
        if shares is None:
            continue
        for m in KD_VARIANTS:
            per_class = r.get(m, {}).get("per_class")
            if per_class:
                points.setdefault(m, []).extend((x, b - v) for x, b, v in zip(shares, base, per_class))
    return points


CLASS_BINS = ((0.0, 25.0, "under 25 % (mostly the CVAE clients')"), (25.0, 75.0, "25-75 %"),
              (75.0, 100.01, "over 75 % (mostly the classifiers')"))


def _class_cost_lines(points: dict[str, list[tuple[float, float]]], budget: str, path: Path) -> list[str]:
    """The per-class section of :func:`kd_cost_report`: mean cost per share bin, and the scatter."""
    from hetfl.report import plot_scatter_fits

    if not points:
        return []
    lines = ["", f"Per class (budget `{budget}`): x = % of the class's training images held by the "
             "classification clients (the KD teachers' side), y = FedMHO minus the variant on that class's "
             "test images (final %; above 0 = the KD term cost that class). Mean y per range of x, "
             "with the number of (cell, class) points:", "",
             "| variant | " + " | ".join(label for _, _, label in CLASS_BINS) + " |",
             "|---|" + "---|" * len(CLASS_BINS)]
    for m, pts in points.items():
        cells = []
        for low, high, _ in CLASS_BINS:
            ys = [y for x, y in pts if low <= x < high]
            cells.append(f"{statistics.fmean(ys):+.2f} (n={len(ys)})" if ys else "-")
        lines.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    figure = path.with_name(f"{path.stem}-kd-per-class-{budget}.png")
    if plot_scatter_fits({LABELS[m]: pts for m, pts in points.items()}, figure,
                         "% of the class held by the classification clients", "FedMHO - KD variant, that class (%)",
                         f"FedMHO: per-class cost of the KD term, budget {budget}"):
        lines += ["", f"![KD cost per class, {budget}]({figure.name})"]
    return lines


def _fit_columns(xs: list[float], ys: list[float]) -> tuple[str, str, Any, float]:
    """A table's ``a + b x`` and ``r`` cells for ys on xs ("-" without a fit: under three points, a
    constant x, or a constant y, which has no correlation), the line and r."""
    line = _linear_fit(xs, ys)
    if line is None or len(set(ys)) < 2:
        return "-", "-", None, 0.0
    r = statistics.correlation(xs, ys)
    return f"{line.intercept:+.2f} {line.slope:+.3f} x", f"{r:.2f}", line, r


def _linear_fit(xs: list[float], ys: list[float]) -> Any:
    """Least-squares line of ys on xs (``statistics.linear_regression``), or None with fewer than three
    points or a constant x."""
    return statistics.linear_regression(xs, ys) if len(xs) >= 3 and len(set(xs)) > 1 else None


def kd_cost_report(root: Path, path: Path, archive: Path | None = None) -> str:
    """Markdown, per budget with Table 4 cells: what each KD variant costs against plain FedMHO, and a
    least-squares fit of that cost on FedMHO - w_0 (drawn as ``<stem>-kd-cost-<budget>.png`` beside ``path``)."""
    from hetfl.report import plot_scatter_fits

    lines: list[str] = []
    gains = _paper_kd_gains()
    for budget in BUDGETS:
        main = [s for s in _cells(root, budget, archive) if _variant(s["config"]) == "main"]
        points = kd_costs(main)
        if not points:
            continue
        lines += [f"### What the KD term costs FedMHO (budget `{budget}`)", "",
                  KD_COST_INTRO.format(low=min(gains), high=max(gains)), "",
                  "| variant | points | mean cost | below FedMHO in | fit: cost = a + b x (FedMHO - w_0) | r |",
                  "|---|---|---|---|---|---|"]
        for m, pts in points.items():
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            fit, r, _, _ = _fit_columns(xs, ys)
            lines.append(f"| {LABELS[m]} | {len(pts)} | {statistics.fmean(ys):.2f} | "
                         f"{sum(y > 0 for y in ys)} of {len(ys)} | {fit} | {r} |")
        figure = path.with_name(f"{path.stem}-kd-cost-{budget}.png")
        if plot_scatter_fits({LABELS[m]: pts for m, pts in points.items()}, figure,
                             "FedMHO - w_0 (final %)", "FedMHO - KD variant (final %)",
                             f"FedMHO: cost of the KD term, budget {budget}"):
            lines += ["", f"![KD cost, {budget}]({figure.name})"]
        lines += _class_cost_lines(kd_class_costs(main), budget, path)
        lines += _teacher_lines(kd_teacher_points(main), budget, path)
        lines.append("")
    return "\n".join(lines)


# Tables 6 and 8 as one sweep of the filter, each ablation cell against the Table 4 cell of its seed
# (variant -> R_th, ascending): Table 8's sweep, Table 4 at FedMHO's default 0.8, no filter drawn at 1.0
FILTER_POINTS = dict(sorted({**{f"rth{r}": r for r in RTH_SWEEP}, "main": 0.8, "nofilter": 1.0}.items(),
                            key=lambda kv: kv[1]))
FILTER_HEADS = {**{v: f"R_th {x:g}" for v, x in FILTER_POINTS.items()},
                "main": "R_th 0.8 (Table 4)", "nofilter": "no filter (4,800)"}
FILTER_INTRO = """Tables 6 and 8 read against Table 4 on the same client uploads: each ablation cell (R_th = 0.4, 0.6
and 0.9 of 6,000 decoded samples kept; or no filter, 4,800 samples unfiltered: as many as R_th = 0.8
keeps) beside the Table 4 cell of its seed (R_th = 0.8), counted only where both ran on byte-identical
uploads (equal `uploads_sha256`), so the differences are the filter's alone. Each entry: mean final %
(mean difference from R_th = 0.8 on the same seeds); "best" is the setting with the largest mean
difference (0.8 itself counts 0). The paper finds 0.8 best on EMNIST (Table 8), and without the filter
(Table 6) its MD and SD lose {low:.2f}-{high:.2f} points on MNIST and Fashion-MNIST."""


def _paper_filter_costs() -> list[float]:
    """The paper's FedMHO-MD/SD with the filter (Table 4) minus without it (Table 6), MNIST and Fashion."""
    return [_paper_mean(PAPER[d][m][i]) - _paper_mean(PAPER_NOFILTER[d][m][i])
            for d in DATASETS for m in ("fedmho_md", "fedmho_sd") for i in range(len(SETTINGS))]


def filter_pairs(cells: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, list[tuple[float, float]]]]:
    """Per (dataset, setting, method of :data:`CURVE_METHODS`): per filter variant (:data:`FILTER_POINTS`),
    ``(final %, final % minus the Table 4 cell's)`` for each ablation cell run on the uploads of the
    Table 4 cell of its seed (:func:`common.same_uploads`), and under ``main`` that Table 4 cell once
    per seed paired (difference 0). Cells on other uploads are left out."""
    main = {(s["config"]["dataset"], _alpha(s["config"]), s["config"]["seed"]): s
            for s in cells if _variant(s["config"]) == "main"}
    pairs: dict[tuple[str, str, str], dict[str, list[tuple[float, float]]]] = {}
    paired: set[tuple[str, str, int, str]] = set()
    for s in cells:
        cfg, variant = s["config"], _variant(s["config"])
        base = main.get((cfg["dataset"], _alpha(cfg), cfg["seed"]))
        if variant == "main" or variant not in FILTER_POINTS or base is None or not common.same_uploads(base, s):
            continue
        for method in (m for m in CURVE_METHODS if m in s["results"] and m in base["results"]):
            acc, ref = s["results"][method]["accuracy"], base["results"][method]["accuracy"]
            row = pairs.setdefault((cfg["dataset"], _alpha(cfg), method), {})
            row.setdefault(variant, []).append((acc, acc - ref))
            if (seen := (cfg["dataset"], _alpha(cfg), cfg["seed"], method)) not in paired:
                paired.add(seen)
                row.setdefault("main", []).append((ref, 0.0))
    return pairs


def filter_report(root: Path, path: Path, budget: str, archive: Path | None = None) -> str:
    """Markdown for one budget's paired ablation cells (:func:`filter_pairs`; "" without any): final %
    per filter setting beside R_th = 0.8, which setting is best per row (the largest mean paired
    difference), and the mean difference per setting drawn against R_th as ``<stem>-filter-<budget>.png``
    beside ``path``."""
    from hetfl.report import plot_accuracy_lines

    pairs = filter_pairs(_cells(root, budget, archive))
    if not pairs:
        return ""
    lines = [f"### The K-means filter on the Table 4 uploads (Tables 6 and 8 paired, budget `{budget}`)", "",
             FILTER_INTRO.format(low=min(costs := _paper_filter_costs()), high=max(costs)), "",
             "| dataset | setting | method | " + " | ".join(FILTER_HEADS.values()) + " | best |",
             "|---|---|---|" + "---|" * (len(FILTER_HEADS) + 1)]
    best_counts = {v: 0 for v in FILTER_POINTS}
    for dataset in DATASETS:
        for setting in SETTINGS:
            for method in CURVE_METHODS:
                row = pairs.get((dataset, setting, method))
                if not row:
                    continue
                # paired: the mean difference from R_th = 0.8 on the seeds each setting shares with it
                diffs = {v: statistics.fmean(d for _, d in row[v]) for v in FILTER_POINTS if v in row}
                best = max(sorted(diffs, key=lambda v: v != "main"), key=diffs.__getitem__)  # a tie: 0.8
                best_counts[best] += 1
                entries = [_filter_entry(row.get(v), v == "main") for v in FILTER_POINTS]
                lines.append(f"| {dataset.upper()} | Dir({setting}) | {LABELS[method]} | " + " | ".join(entries)
                             + f" | {FILTER_HEADS[best]} |")
    rows = sum(best_counts.values())
    lines += ["", "Best setting per row: " + ", ".join(f"{FILTER_HEADS[v]} in {n} of {rows}"
                                                      for v, n in best_counts.items() if n) + "."]
    curves = {f"{dataset.upper()} {LABELS[method]}": _mean_differences(pairs, dataset, method)
              for dataset in DATASETS for method in CURVE_METHODS}
    figure = path.with_name(f"{path.stem}-filter-{budget}.png")
    if plot_accuracy_lines(curves, figure, "R_th (1.0 = no filter, 4,800 samples)",
                           f"filter against R_th = 0.8, budget {budget}: mean over settings and seeds",
                           ylabel="final % minus R_th = 0.8 (same uploads)"):
        lines += ["", f"![filter sweep, {budget}]({figure.name})"]
    if archive is not None:
        lines += probe_lines(probe_file(archive, budget), DATASETS)
    return "\n".join(lines + [""])


def _filter_entry(points: list[tuple[float, float]] | None, reference: bool) -> str:
    if not points:
        return "-"
    mean = statistics.fmean(a for a, _ in points)
    n = f" n={len(points)}" if len(points) > 1 else ""
    if reference:
        return f"{mean:.2f}{n}"
    return f"{mean:.2f} ({statistics.fmean(d for _, d in points):+.2f}){n}"


def _mean_differences(pairs: dict[tuple[str, str, str], dict[str, list[tuple[float, float]]]], dataset: str,
                      method: str) -> list[tuple[float, float]]:
    """(R_th, mean difference from R_th = 0.8 over the dataset's settings and seeds), per filter setting run."""
    rows = [row for (d, _, m), row in pairs.items() if d == dataset and m == method]
    return [(x, statistics.fmean(diff for row in rows for _, diff in row.get(v, [])))
            for v, x in FILTER_POINTS.items() if any(v in row for row in rows)]


def report(root: Path, budget: str, stem: str = "fedmho", archive: Path | None = None) -> str:
    """Markdown tables of one budget from the cells in ``root`` and the ``archive`` folder; ``stem``
    names the Fig. 6 pictures (``<stem>-fig6-<cell>.png``)."""
    cells = _cells(root, budget, archive)
    lines = [f"## Budget `{budget}`: {json.dumps(BUDGETS[budget])}", ""]
    for dataset in DATASETS:
        mine = [s for s in cells if s["config"]["dataset"] == dataset]
        main = [s for s in mine if _variant(s["config"]) == "main"]
        if main:
            failures = failure_note(main)
            extra = tuple(m for m in LABELS if m not in METHODS and any(m in s["results"] for s in main))
            lines += [f"### Table 4, {dataset.upper()}: ours = final % (best over epochs %), paper = Table 4", "",
                      *_table(main, METHODS + extra, PAPER[dataset]), "",
                      *([note, ""] if (note := feddf_protocol_note(main)) else []), _minutes(main), "",
                      _ordering(main, dataset), "", *([failures, ""] if failures else [])]
        nofilter = [s for s in mine if _variant(s["config"]) == "nofilter"]
        if nofilter:
            lines += [f"### Table 6, {dataset.upper()}: without the K-means filter (4,800 unfiltered samples)", "",
                      *_table(nofilter, ("fedmho_md", "fedmho_sd"), PAPER_NOFILTER[dataset]), ""]
        for r in RTH_SWEEP:
            sweep = [s for s in mine if _variant(s["config"]) == f"rth{r}"]
            if sweep:
                lines += [f"### Table 8, {dataset.upper()}: R_th = {r} (the paper's Table 8 is EMNIST only)", "",
                          *_table(sweep, CURVE_METHODS, None), ""]
        curves = [s for s in mine if _variant(s["config"]) == "curve"]
        if curves:
            lines += [f"### Fig. 6, {dataset.upper()}: test accuracy per server epoch (epoch 0 = w_0)", "",
                      *_curve_table(curves, stem), ""]
    return "\n".join(lines)


def _curve_table(cells: list[dict[str, Any]], stem: str) -> list[str]:
    lines = []
    for s in cells:
        curves = {m: s["results"][m].get("curve", []) for m in CURVE_METHODS if m in s["results"]}
        n = max((len(c) for c in curves.values()), default=0)
        picks = sorted({0, 1, 2, 5, 10, 20, 30, 50, 100, n - 1} & set(range(n)))
        lines += [f"{s['config']['name']}:", "", "| epoch | " + " | ".join(LABELS[m] for m in curves) + " |",
                  "|---|" + "---|" * len(curves)]
        lines += [f"| {e} | " + " | ".join(f"{c[e]:.2f}" if e < len(c) else "-" for c in curves.values()) + " |"
                  for e in picks]
        lines += ["", f"![Fig. 6, {s['config']['name']}]({stem}-fig6-{s['config']['name']}.png)", ""]
    return lines


HEADER = """# FedMHO reproduction: MNIST and Fashion-MNIST

Generated by `hetfl reproduce fedmho` from the runs under its output folder; do not edit by hand
(notes below the tables are kept in `docs/results/fedmho-notes.md`).

Protocol: 10 clients, Dirichlet(alpha) with every client holding at least half the average size
(FedDF/FedMHO's partition rule), models per Table 1 (see each budget). Accuracy is top-1 on the
official 10k test split of the **final** server model (the paper reports the model after training),
with the best test accuracy over server epochs in parentheses; n = number of seeds (± = sd over
seeds). The paper's numbers are Table 4 / Table 6 (mean ± sd over its seeds).
"""


def plot_curves(root: Path, path: Path) -> list[Path]:
    """Fig. 6 as a picture: accuracy per server epoch of FedMHO (CE only) and FedMHO-MD/-SD (CE +
    KD), one PNG per curve cell, written next to ``path`` as ``<stem>-fig6-<cell>.png``. The curve is
    part of the cell's summary (``results[method]["curve"]``), so an archived cell (the archive beside
    ``path``) draws it as well; a cell without one writes nothing (an earlier picture stays)."""
    from hetfl.report import plot_accuracy_lines

    archive = common.archive_folder(path)
    written = []
    for s in (s for b in BUDGETS for s in _cells(root, b, archive) if _variant(s["config"]) == "curve"):
        curves = {LABELS[m] + (" (no KD)" if m == "fedmho" else ""): list(enumerate(s["results"][m].get("curve", [])))
                  for m in CURVE_METHODS if m in s["results"]}
        out = path.with_name(f"{path.stem}-fig6-{s['config']['name']}.png")
        if plot_accuracy_lines(curves, out, "server epoch (0 = w_0, the average of the classifiers)",
                               f"Fig. 6: {s['config']['name']}"):
            written.append(out)
    return written


LEAD_METHODS = ("fedmho", "fedmho_md", "fedmho_sd")
LEAD_INTRO = """Each point is one Table 4 cell and seed: x = w_0 (FedMHO's initial model, the average of the
classification clients), y = the method minus FedCVAE-Ens (final %; above 0 = ahead of the generative
baseline, the paper's ordering). "Within a setting": each setting's seeds centred on their own means
before the fit, so alpha does not drive it. Break-even = the w_0 where the pooled fit crosses 0."""


def generative_leads(cells: list[dict[str, Any]]) -> dict[str, list[tuple[str, float, float]]]:
    """Per FedMHO method, one ``(setting, w_0, method - FedCVAE-Ens)`` point (final %) per cell that ran
    both; w_0 is the method's own ``init_accuracy``, else FedMHO's (the same classifier uploads)."""
    points: dict[str, list[tuple[str, float, float]]] = {}
    for s in cells:
        r = s["results"]
        if "fedcvae_ens" not in r:
            continue
        for m in LEAD_METHODS:
            w0 = r.get(m, {}).get("init_accuracy", r.get("fedmho", {}).get("init_accuracy"))
            if m in r and w0 is not None:
                lead = r[m]["accuracy"] - r["fedcvae_ens"]["accuracy"]
                points.setdefault(m, []).append((_alpha(s["config"]), w0, lead))
    return points


def within_setting_fit(points: list[tuple[str, float, float]]) -> tuple[float, float] | None:
    """``(r, slope)`` of y on x after centring both on each setting's mean; None with fewer than three
    points or where the centred x or y does not vary (one point per setting, a constant lead)."""
    by_setting: dict[str, list[tuple[float, float]]] = {}
    for setting, x, y in points:
        by_setting.setdefault(setting, []).append((x, y))
    xs: list[float] = []
    ys: list[float] = []
    for pts in by_setting.values():
        mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
        xs += [p[0] - mx for p in pts]
        ys += [p[1] - my for p in pts]
    sxx = sum(x * x for x in xs)
    if len(xs) < 3 or sxx < 1e-12 or sum(y * y for y in ys) < 1e-12:
        return None
    return statistics.correlation(xs, ys), sum(x * y for x, y in zip(xs, ys)) / sxx


def _lead_row(label: str, pts: list[tuple[str, float, float]]) -> str:
    xs, ys = [p[1] for p in pts], [p[2] for p in pts]
    within = within_setting_fit(pts)
    pooled, even = "-", "-"
    line = _linear_fit(xs, ys)
    if line is not None:
        pooled = f"{line.intercept:+.2f} {line.slope:+.3f} w_0"
        if line.slope > 0:
            even = f"{-line.intercept / line.slope:.1f}"
    return (f"| {label} | {len(pts)} | {statistics.fmean(xs):.1f} ({min(xs):.1f}-{max(xs):.1f}) | "
            f"{sum(y > 0 for y in ys)} of {len(ys)} | "
            f"{f'{within[0]:.2f}, {within[1]:+.2f}' if within else '-'} | {pooled} | {even} |")


def lead_report(root: Path, path: Path, archive: Path | None = None) -> str:
    """Markdown, per dataset: how far FedMHO, MD and SD are ahead of FedCVAE-Ens against w_0, per budget,
    with one figure per dataset (``<stem>-lead-<dataset>.png`` beside ``path``)."""
    from hetfl.report import plot_scatter_fits

    lines: list[str] = []
    main = {budget: [s for s in _cells(root, budget, archive) if _variant(s["config"]) == "main"]
            for budget in BUDGETS}
    for dataset in DATASETS:
        rows: list[str] = []
        figure_points: dict[str, list[tuple[float, float]]] = {}
        for budget, cells in main.items():
            for m, pts in generative_leads([s for s in cells if s["config"]["dataset"] == dataset]).items():
                rows.append(_lead_row(f"{LABELS[m]}, `{budget}`", pts))
                if m != "fedmho":
                    figure_points[f"{LABELS[m]}, {budget}"] = [(p[1], p[2]) for p in pts]
        if not rows:
            continue
        if not lines:
            lines += ["### Ahead of FedCVAE-Ens, against the classifiers' average w_0", "", LEAD_INTRO, ""]
        lines += [f"{dataset.upper()}:", "",
                  "| method, budget | points | w_0 mean (range) | ahead in | within a setting: r, slope | "
                  "pooled fit | break-even w_0 |", "|---|---|---|---|---|---|---|", *rows]
        figure = path.with_name(f"{path.stem}-lead-{dataset}.png")
        if plot_scatter_fits(figure_points, figure, "w_0: the classifiers' average (final %)",
                             "method - FedCVAE-Ens (final %)", f"{dataset.upper()}: ahead of FedCVAE-Ens"):
            lines += ["", f"![lead over FedCVAE-Ens, {dataset}]({figure.name})"]
        lines.append("")
    return "\n".join(lines)


EPOCH_RUNS = "ablate"  # archive subfolder: fedmho-E<epochs>-<dataset>-a<alpha>-s<seed>.json, the local-epochs runs
EPOCH_METHODS = ("fedmho", "fedmho_md", "fedmho_sd", "fedcvae_ens")


def epoch_runs(archive: Path) -> list[dict[str, Any]]:
    """The local-epochs experiment at budget ``reduced``: one row per summary
    ``archive/ablate/fedmho-E<E>-<dataset>-a<alpha>-s<seed>.json`` (the grid's cell config with the
    classifiers' ``client.epochs`` set to E), plus, for a (dataset, alpha, seed) with runs at other
    epochs only, the grid cell of budget ``reduced`` (its own epochs) as the shorter run. Each row:
    dataset, setting, seed, epochs, source (``run`` or ``grid cell``), w_0 and the final % of
    :data:`EPOCH_METHODS`, sorted by dataset, setting (as in :data:`SETTINGS`), seed, epochs."""
    pattern = re.compile(r"fedmho-E(\d+)-(\w+)-a([\d.]+)-s(\d+)\.json")
    rows: list[dict[str, Any]] = []
    for f in sorted((archive / EPOCH_RUNS).glob("fedmho-E*.json")):
        if (m := pattern.fullmatch(f.name)) is not None:
            rows.append(_epoch_row(json.loads(f.read_text()), m[2], m[3], int(m[4]), "run"))
    grid_epochs = BUDGETS["reduced"]["client_epochs"]
    for key in sorted({(r["dataset"], r["setting"], r["seed"]) for r in rows}):
        grid = archive / f"fedmho-{key[0]}-a{key[1]}-s{key[2]}-reduced.json"
        if grid.is_file() and not any((r["dataset"], r["setting"], r["seed"]) == key and r["epochs"] == grid_epochs
                                      for r in rows):
            rows.append(_epoch_row(json.loads(grid.read_text()), *key, "grid cell"))
    return _by_cell(rows)


def _by_cell(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Epoch rows sorted by dataset, setting (as in :data:`SETTINGS`), seed and epochs."""
    order = {a: i for i, a in enumerate(SETTINGS)}
    return sorted(rows, key=lambda r: (r["dataset"], order.get(r["setting"], len(order)), r["seed"], r["epochs"]))


def _epoch_row(summary: dict[str, Any], dataset: str, setting: str, seed: int, source: str) -> dict[str, Any]:
    r = summary["results"]
    return {"dataset": dataset, "setting": setting, "seed": seed, "source": source,
            "epochs": summary["config"]["client"]["epochs"],
            "w0": r.get("fedmho", {}).get("init_accuracy"),
            **{m: r[m]["accuracy"] if m in r else None for m in EPOCH_METHODS}}


def _pct(value: float | None, sign: bool = False) -> str:
    return "-" if value is None else (f"{value:+.2f}" if sign else f"{value:.2f}")


def _lead(row: dict[str, Any], method: str) -> float | None:
    return None if row[method] is None or row["fedcvae_ens"] is None else row[method] - row["fedcvae_ens"]


VGG9_PAIR = ("vgg9-e10", "vgg9-e50")  # the same cells with the classifiers' local epochs 10 and 50


def vgg9_epoch_runs(archive: Path) -> list[dict[str, Any]]:
    """The local-epochs experiment at the VGG-9 scale: for every archived main cell of budget
    ``vgg9-e50`` (``archive/fedmho-<dataset>-a<alpha>-s<seed>-vgg9-e50.json``), one row for it and one
    for the ``vgg9-e10`` cell of the same dataset, setting and seed when archived (rows as
    :func:`epoch_runs`, source = the budget). FedCVAE-Ens trains no classifier, so where the
    ``vgg9-e50`` cell did not run it, its row takes the ``vgg9-e10`` cell's (source says so)."""
    short, long = VGG9_PAIR
    rows: list[dict[str, Any]] = []
    for f in sorted(archive.glob(f"{PREFIX}-*-{long}.json")):
        summary = json.loads(f.read_text())
        cfg = summary["config"]
        if _variant(cfg) != "main":
            continue
        key = (cfg["dataset"], _alpha(cfg), int(cfg["seed"]))
        e50 = _epoch_row(summary, *key, f"`{long}` cell")
        pair = archive / f"{PREFIX}-{key[0]}-a{key[1]}-s{key[2]}-{short}.json"
        if pair.is_file():
            e10 = _epoch_row(json.loads(pair.read_text()), *key, f"`{short}` cell")
            rows.append(e10)
            if e50["fedcvae_ens"] is None and e10["fedcvae_ens"] is not None:
                e50 = {**e50, "fedcvae_ens": e10["fedcvae_ens"],
                       "source": f"`{long}` cell (FedCVAE-Ens of `{short}`)"}
        rows.append(e50)
    return _by_cell(rows)


def epochs_report(archive: Path) -> str:
    """Markdown for :func:`epoch_runs` (budget ``reduced``, cnn2) and :func:`vgg9_epoch_runs` (VGG-9):
    every run, then per (dataset, setting) the mean change from the shorter to the longest run of each
    seed and how many seeds put MD and SD above FedCVAE-Ens there; empty without such runs."""
    text = ""
    rows = epoch_runs(archive)
    if rows:
        text += _epochs_tables(rows, "budget `reduced`, cnn2 classifiers", (
            "The grid cell's config with the classification clients' `client.epochs` changed (E); the CVAE "
            "clients do not depend on it, so FedCVAE-Ens is the same in a seed's runs where they share an "
            "upload cache. \"grid cell\" = the archived `reduced` cell of that seed (E = "
            f"{BUDGETS['reduced']['client_epochs']}), standing in for a run at E = "
            f"{BUDGETS['reduced']['client_epochs']} on the same cache (its CVAE uploads may differ). w_0 = the "
            "classifiers' average (FedMHO's initial model); final %. Summaries in "
            f"`{archive.name}/{EPOCH_RUNS}/`."))
    rows = vgg9_epoch_runs(archive)
    if rows:
        short, long = VGG9_PAIR
        text += ("\n" if text else "") + _epochs_tables(rows, "VGG-9 classifiers, budgets "
                                                         f"`{short}` and `{long}`", (
            f"The archived Table 4 cells of budget `{long}` beside the `{short}` cell of the same seed: the same "
            "config but the classification clients' `client.epochs` (E), each cell with its own uploads (both "
            "on a GPU, whose client training is not bit-for-bit repeatable). Where the "
            f"`{long}` cell did not run FedCVAE-Ens (it trains no classifier), the `{short}` cell's stands in. "
            "w_0 = the classifiers' average (FedMHO's initial model); final %."))
    return text


def _epochs_tables(rows: list[dict[str, Any]], what: str, intro: str) -> str:
    lines = [f"### The classifiers' local epochs ({what})", "", intro, "",
             "| dataset | setting | seed | E | source | w_0 | FedMHO | MD | SD | FedCVAE-Ens | MD - Ens | SD - Ens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dataset'].upper()} | Dir({r['setting']}) | {r['seed']} | {r['epochs']} | {r['source']} | "
                     f"{_pct(r['w0'])} | {_pct(r['fedmho'])} | {_pct(r['fedmho_md'])} | {_pct(r['fedmho_sd'])} | "
                     f"{_pct(r['fedcvae_ens'])} | {_pct(_lead(r, 'fedmho_md'), True)} | "
                     f"{_pct(_lead(r, 'fedmho_sd'), True)} |")
    lines += ["", "Per setting: the longest run of each seed minus its shortest (mean over the seeds with both), and "
              "the seeds whose longest run puts MD / SD above FedCVAE-Ens.", "",
              "| dataset | setting | E | seeds | w_0 change | MD change | SD change | MD above FedCVAE-Ens | "
              "SD above FedCVAE-Ens |", "|---|---|---|---|---|---|---|---|---|"]
    for (dataset, setting), group in _groups(rows).items():
        pairs = [(g[0], g[-1]) for g in group.values() if len(g) > 1]
        longest = [g[-1] for g in group.values()]
        spans = sorted({f"{g[0]['epochs']} to {g[-1]['epochs']}" if len(g) > 1 else str(g[0]['epochs'])
                        for g in group.values()})
        lines.append(f"| {dataset.upper()} | Dir({setting}) | {', '.join(spans)} | {len(group)} | "
                     + " | ".join(_mean_change(pairs, k) for k in ("w0", "fedmho_md", "fedmho_sd")) + " | "
                     + " | ".join(_ahead(longest, m) for m in ("fedmho_md", "fedmho_sd")) + " |")
    return "\n".join(lines) + "\n"


def _mean_change(pairs: list[tuple[dict[str, Any], dict[str, Any]]], key: str) -> str:
    diffs = [b[key] - a[key] for a, b in pairs if a[key] is not None and b[key] is not None]
    return f"{statistics.fmean(diffs):+.2f}" if diffs else "-"


def _ahead(rows: list[dict[str, Any]], method: str) -> str:
    leads = [x for x in (_lead(r, method) for r in rows) if x is not None]
    return f"{sum(x > 0 for x in leads)} of {len(leads)}"


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[int, list[dict[str, Any]]]]:
    """``rows`` (sorted by :func:`epoch_runs`) by (dataset, setting), then by seed, each seed's rows by epochs."""
    out: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
    for r in rows:
        out.setdefault((r["dataset"], r["setting"]), {}).setdefault(r["seed"], []).append(r)
    return out


TRIALS = "vgg9-trials"  # archive subfolder: <cell name>-<trial>.json, server trials on a cell's cached uploads
_CELL_NAME = re.compile(rf"{PREFIX}-(\w+)-a([\d.]+)-s(\d+)-(.+)")


def trial_rows(archive: Path) -> list[dict[str, Any]]:
    """Server trials on one cell's cached uploads: ``archive/vgg9-trials/<cell name>-<trial>.json``, each
    the summary of ``hetfl run`` on a main cell's config with ``--set`` overrides of its methods. One row
    per file and method (``[...]`` models left out): dataset, setting, seed, budget, trial, method, the
    method's settings that differ from the budget's (:func:`method_params`), the uploads' digest, torch
    threads, w_0, final and best %, the mean of the last five epochs' %, the server's minutes and what
    the KD teacher said on the synthetic set (:func:`hetfl.fl.generative.teacher_stats`, MD/SD). Rows
    are sorted by cell, uploads, method and trial, so the trials on the same bytes stand together."""
    rows: list[dict[str, Any]] = []
    for f in sorted((archive / TRIALS).glob(f"{PREFIX}-*.json")):
        summary = json.loads(f.read_text())
        cfg = summary["config"]
        if (m := _CELL_NAME.fullmatch(cfg["name"])) is None:
            continue
        dataset, setting, seed, budget = m[1], m[2], int(m[3]), m[4]
        defaults = method_params(budget) if budget in BUDGETS else {}
        trial = f.stem.removeprefix(cfg["name"] + "-")
        for method, r in summary["results"].items():
            if "[" in method:
                continue
            given, base = cfg["methods"].get(method, {}), defaults.get(method, {})
            # FedMHO's family records its curve in the results; other methods' come from the run's
            # metrics.jsonl, archived beside them as ``curves`` (step, %) like a cell's
            logged = [acc for _, acc in summary.get("curves", {}).get(method, [])]
            curve = [x for x in r.get("curve") or logged if x is not None]
            rows.append({
                "dataset": dataset, "setting": setting, "seed": seed, "budget": budget, "trial": trial,
                "method": method, "changed": {k: v for k, v in given.items() if base.get(k) != v},
                "uploads": (r.get("uploads_sha256") or "")[:8],
                "threads": summary.get("environment", {}).get("threads"),
                "w0": r.get("init_accuracy"), "final": r["accuracy"], "best": r.get("best_accuracy"),
                "last5": statistics.fmean(curve[-5:]) if len(curve) > 5 else None,
                "minutes": r["server_seconds"] / 60 if r.get("server_seconds") is not None else None,
                "teacher": r.get("teacher")})
    order = {a: i for i, a in enumerate(SETTINGS)}
    return sorted(rows, key=lambda r: (r["dataset"], order.get(r["setting"], len(order)), r["seed"], r["budget"],
                                       r["uploads"], r["method"], r["trial"]))


def trials_report(archive: Path) -> str:
    """Markdown for :func:`trial_rows`; empty without trials."""
    rows = trial_rows(archive)
    if not rows:
        return ""
    lines = ["### Server trials on one cell's uploads", "",
             "`hetfl run` on a Table 4 cell's config with one method's settings changed (`--set`), every trial of "
             "a cell on the same cached client uploads (column \"uploads\": the first digits of their digest) "
             "unless a changed setting retrains some clients (`cvae_epochs`). \"changed\" = the method's settings "
             "that differ from the budget's (none = the cell as configured, run again on these uploads). "
             "w_0 = the server's initial model; final and best %; \"last 5\" = mean % of the last five server "
             "epochs. \"KD teacher\" (MD and SD, summaries that record it): the teacher's mean softmax entropy "
             "on the filtered synthetic set in nats (log C is uniform: 2.30 for 10 classes), how often its argmax is "
             "the sample's label, and the classes where it never is.",
             f"Summaries in `{archive.name}/{TRIALS}/`; what each trial asks is in the notes.", "",
             "| cell | trial | method | changed | uploads | threads | w_0 | final | best | last 5 | server min "
             "| KD teacher |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        changed = ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in r["changed"].items()) or "none"
        minutes = "-" if r["minutes"] is None else f"{r['minutes']:.1f}"
        lines.append(f"| {r['dataset'].upper()} Dir({r['setting']}) s{r['seed']} `{r['budget']}` | {r['trial']} | "
                     f"{LABELS.get(r['method'], r['method'])} | {changed} | {r['uploads'] or '-'} | "
                     f"{r['threads'] if r['threads'] is not None else '-'} | {_pct(r['w0'])} | {_pct(r['final'])} | "
                     f"{_pct(r['best'])} | {_pct(r['last5'])} | {minutes} | {_teacher_cell(r['teacher'])} |")
    return "\n".join(lines) + "\n"


def _teacher_cell(stats: dict[str, Any] | None) -> str:
    """``H 1.49 nats, agrees 47.0 %, never on 6, 7, 8, 9`` from a ``teacher`` record; ``-`` without one."""
    if not stats or stats["entropy"] is None:
        return "-"
    blind = [str(c) for c, a in enumerate(stats["agreement_per_class"]) if a == 0.0]
    return (f"H {stats['entropy']:.2f} nats, agrees {stats['agreement']:.1f} %, "
            f"never on {', '.join(blind) or 'no class'}")


def write_results(root: Path, path: Path, notes: Path | None = None) -> None:
    archive = common.archive_folder(path)
    standing = standing_report(root, archive)
    if standing:
        standing += ("\n\n" + kd_cost_report(root, path, archive) + "\n" + lead_report(root, path, archive)
                     + "\n" + epochs_report(archive))
        if trials := trials_report(archive):
            standing += "\n" + trials
    bodies = [standing, *(report(root, budget, path.stem, archive) + "\n" + filter_report(root, path, budget, archive)
                          for budget in BUDGETS),
              common.partial_report(archive, LABELS), common.replaced_report(archive, LABELS, BUDGETS)]
    common.write_results(path, HEADER, bodies, notes)
    plot_curves(root, path)


# ---- command --------------------------------------------------------------------------------------
def probe_filter(args: argparse.Namespace, root: Path, results: Path, notes: Path, settings: list[str]) -> int:
    """``--filter-probe``: :func:`hetfl.reproduce.filter_probe.run_probes` on the chosen Table 4 cells
    of ``--budget`` (each at FedMHO-MD's draw), then the results file again."""
    from hetfl.reproduce.filter_probe import run_probes  # torch: only on request

    datasets, seeds = csv(args.datasets), common.int_list("seeds", args.seeds)
    archive = common.archive_folder(results)
    chosen = [s for s in _cells(root, args.budget, archive)
              if _variant(cfg := s["config"]) == "main" and cfg["dataset"] in datasets and _alpha(cfg) in settings
              and cfg["seed"] in seeds]
    if not chosen:
        raise ValueError(f"no Table 4 cell of budget {args.budget!r} matches --datasets {args.datasets} "
                         f"--settings {','.join(settings)} --seeds {args.seeds}")
    out = probe_file(archive, args.budget)
    run_probes(chosen, out, Path(args.cache_dir), data_root=args.data_root, device=args.device)
    print(f"wrote {out}")
    write_results(root, results, notes)
    print(f"wrote {results}")
    return 0


def main(args: argparse.Namespace) -> int:
    """``hetfl reproduce fedmho``: validate the whole grid, then run the cells not yet finished."""
    from hetfl.config import validate

    root = Path(args.out or "runs/reproduce-fedmho")
    results = Path(args.results or "docs/results/fedmho.md")
    notes = results.with_name(results.stem + "-notes.md")
    if args.report_only:
        write_results(root, results, notes)
        print(f"wrote {results}")
        return 0
    methods = tuple(csv(args.methods)) if args.methods else METHODS
    settings = csv(args.settings or ",".join(SETTINGS))
    common.check_choices("methods", methods, LABELS)
    common.check_choices("budget", args.budget, BUDGETS)
    common.check_choices("settings", settings, SETTINGS)
    if getattr(args, "filter_probe", False):
        return probe_filter(args, root, results, notes, settings)
    cells = grid(csv(args.datasets), settings, common.int_list("seeds", args.seeds), args.budget, methods,
                 args.ablation, getattr(args, "curve", False))
    for cfg in cells:  # validate the whole grid before running anything
        if getattr(args, "device", None):
            cfg["device"] = args.device
        if simulator := common.simulator_flags(args):
            cfg["simulator"] = simulator
        validate(cfg)

    def runner(cfg: dict, out: Path, cache: Path, data_root: str | None) -> dict:
        return common.run_missing_methods(validate(cfg), out, cache, data_root, args.quiet)

    if getattr(args, "jobs", 1) > 1:  # clients first (every method's uploads), then a worker per method
        common.run_grid_parallel(cells, root, Path(args.cache_dir), args.data_root, args.jobs,
                                 lambda name: common.archive_and_say(root, name, results),
                                 lambda: write_results(root, results, notes), getattr(args, "client_jobs", 1))
        print(f"wrote {results}")
        return 0
    for i, cfg in enumerate(cells, 1):
        print(f"[{i}/{len(cells)}] {cfg['name']}", flush=True)
        run_cell(cfg, root, Path(args.cache_dir), args.data_root, runner)
        common.archive_and_say(root, cfg["name"], results)  # Fig. 6's curve is in the summary
        write_results(root, results, notes)
    print(f"wrote {results}")
    return 0
