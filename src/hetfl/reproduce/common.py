"""Helpers shared by the paper reproductions: resumable cells, cell summaries, mean ± sd."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetfl.reproduce.worker import INTERRUPTED


def run_cell(cfg: dict[str, Any], root: Path, cache: Path, data_root: str | None,
             runner: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """Run one cell (a config) into ``root/<name>`` unless a finished summary with every method of
    the config is already there; stamps the wall-clock minutes into the summary."""
    out = root / cfg["name"]
    done = out / "summary.json"
    if done.is_file():
        summary = json.loads(done.read_text())
        if set(summary.get("results", {})) >= set(cfg["methods"]):
            return summary
    start = time.perf_counter()
    summary = runner(cfg, out, cache, data_root)
    summary["minutes"] = (time.perf_counter() - start) / 60
    done.write_text(json.dumps(summary, indent=1))
    return summary


def cell_summaries(root: Path, prefix: str, archive: Path | None = None) -> list[dict[str, Any]]:
    """The finished cells ``root/<prefix>-*/summary.json`` joined with the archived ones
    ``archive/<prefix>-*.json`` (:func:`archive_cell`), sorted by name. A cell in both is the runs
    folder's summary, carrying the archived ``curves`` of the methods whose results it has unchanged
    (:func:`cell_curves` prefers its metrics.jsonl), unless the archived copy has methods that the runs
    folder's lacks (some of a cell's methods run again into another folder): then the fuller archived copy."""
    cells = {p.parent.name: json.loads(p.read_text()) for p in root.glob(f"{prefix}-*/summary.json")}
    for p in sorted(archive.glob(f"{prefix}-*.json")) if archive is not None else ():
        saved = json.loads(p.read_text())
        if p.stem not in cells or drops_methods(saved, cells[p.stem]):
            cells[p.stem] = saved
        elif "curves" in saved:
            same = unchanged_curves(saved, cells[p.stem])
            if same:
                cells[p.stem].setdefault("curves", same)
    return [cells[name] for name in sorted(cells)]


def unchanged_curves(archived: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """The archived curves of the methods whose results ``summary`` still has unchanged (a method run
    again in the runs folder has its own curve in metrics.jsonl, or none)."""
    return {m: c for m, c in archived.get("curves", {}).items()
            if m in summary.get("results", {}) and archived["results"].get(m) == summary["results"][m]}


def budget_cells(root: Path, prefix: str, budget: str, archive: Path | None = None) -> list[dict[str, Any]]:
    """:func:`cell_summaries` of one budget (the cell names end in ``-<budget>``)."""
    return [s for s in cell_summaries(root, prefix, archive) if s["config"]["name"].endswith(f"-{budget}")]


# ---- the archive: measured cell summaries kept in git beside the results file -----------------------
def archive_folder(results: Path) -> Path:
    """Where the summaries behind a results file are archived: ``<stem>-runs/`` beside it (the runs
    folder holds models and stays out of git; the archive lets ``--report-only`` work on a fresh clone)."""
    return results.with_name(results.stem + "-runs")


def write_json_atomic(path: Path, data: Any) -> None:
    """``json.dumps(data, indent=1)`` (the format of summary.json) into ``path`` via a temporary file and
    ``os.replace``, so that a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def logged_curves(metrics: Path, methods: tuple[str, ...]) -> dict[str, list[list[float]]]:
    """``{method: [[step, accuracy], ...]}`` in step order for the ``methods`` that logged an
    evaluation in a cell's metrics.jsonl; a resumed stage logs some steps twice: the last value wins."""
    from hetfl.report import read_curves

    curves = read_curves(metrics)
    return {m: [[step, acc] for step, acc in sorted(dict(curves[m]).items())] for m in methods if curves.get(m)}


def cell_curves(root: Path, summary: dict[str, Any], methods: tuple[str, ...]) -> dict[str, list[list[float]]]:
    """The ``methods``' curves of one cell (:func:`logged_curves`): the archived ``curves`` joined with
    those in its metrics.jsonl in the runs folder (which win for a method in both; a cell that added a
    method to an archived run logs only that method)."""
    saved = summary.get("curves", {})
    curves = {m: saved[m] for m in methods if m in saved}
    metrics = root / summary["config"]["name"] / "metrics.jsonl"
    if metrics.is_file():
        curves.update(logged_curves(metrics, methods))
    return curves


ARCHIVE_KEEPS = ("note",)  # hand-written keys of an archived summary that a new copy keeps
PARTIAL = "partial"  # archive subfolder for summaries that ran only some of an archived cell's methods


def drops_methods(archived: dict[str, Any], summary: dict[str, Any]) -> bool:
    """Whether ``archived`` has results for methods that ``summary`` has none for."""
    return bool(set(archived.get("results", {})) - set(summary.get("results", {})))


def archive_cell(root: Path, name: str, archive: Path, curve_methods: tuple[str, ...] = ()) -> Path | None:
    """Copy the cell's ``root/<name>/summary.json`` to ``archive/<name>.json`` (same keys and format),
    with ``curves``: those logged in the cell's metrics.jsonl (:func:`logged_curves` of ``curve_methods``)
    joined with the earlier archived curves of the methods whose results are unchanged (a method added
    to an archived cell logs only its own). A ``note`` written by hand into the archived copy is kept.
    An archived cell never loses methods: a summary without some of them (a subset of the cell's
    methods run again into another runs folder, e.g. beside an ablation on the same uploads) goes to
    ``archive/partial/<runs folder name>/<name>.json`` instead. None when the cell has no summary yet."""
    summary_file = root / name / "summary.json"
    if not summary_file.is_file():
        return None
    summary = json.loads(summary_file.read_text())
    out = archive / f"{name}.json"
    old = json.loads(out.read_text()) if out.is_file() else {}
    if drops_methods(old, summary):
        out = archive / PARTIAL / root.resolve().name / f"{name}.json"
        old = json.loads(out.read_text()) if out.is_file() else {}
    kept = {k: old[k] for k in ARCHIVE_KEEPS if k in old and k not in summary}
    metrics = root / name / "metrics.jsonl"
    logged = logged_curves(metrics, curve_methods) if curve_methods and metrics.is_file() else {}
    joined = {**unchanged_curves(old, summary), **logged} if old else logged
    curves = {"curves": joined} if joined else {}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, {**summary, **kept, **curves})
    return out


def archive_and_say(root: Path, name: str, results: Path, curve_methods: tuple[str, ...] = ()) -> Path | None:
    """:func:`archive_cell` into the archive beside ``results``, printing where the summary went when
    it had fewer methods than the archived cell (``partial/``)."""
    archive = archive_folder(results)
    saved = archive_cell(root, name, archive, curve_methods)
    if saved is not None and saved.parent != archive:
        print(f"{name}: fewer methods than its archived copy, archived as {saved}", flush=True)
    return saved


def merge_methods(archived_file: Path, summary: dict[str, Any], methods: Iterable[str],
                  metrics: Path | None = None) -> list[str]:
    """Add ``methods``' results from ``summary`` (a run elsewhere, e.g. on a lent GPU with the cell's
    upload cache carried, or on a CPU with it imported) to the archived cell ``archived_file``, with
    their configs and, from ``metrics`` (that run's metrics.jsonl), their per-epoch curves when the
    archived cell keeps curves. Only on the same uploads (:func:`same_uploads`: same setting and the
    same ``uploads_sha256``) and with each method's config as the archived cell's, where it names the method
    (:func:`same_method_config`: a key at its default counts as left out; the cell keeps its config as
    written); ValueError otherwise, naming the mismatch. The archived cell's environment stays its own: each
    merged result carries its own seconds and, where the run's ``environment`` differs from the cell's
    (another processor, thread count or device), that environment too, so timings are compared only
    under like settings; a hand-written ``note`` should say where it ran.
    A result the merge replaces is kept, with its config and curve, in the cell's ``replaced``
    (``{method: [{"result": ..., "config": ..., "curve": ...}, ...]}``, oldest first), so a re-run after
    a change of defaults (:data:`CHANGED_DEFAULTS`) can be read beside the run it replaced.
    A method new to the cell that ran on the cell's machine (:func:`machine_label`) adds its server
    ``seconds`` to the cell's ``merged_minutes``, which :func:`cell_minutes` counts, so that the report's
    minutes per cell cover every method; a replaced result's time is in the cell already, and a run on
    another machine is timed in its own result only."""
    archived = json.loads(archived_file.read_text())
    methods = list(methods)
    missing = [m for m in methods if m not in summary["results"]]
    if missing:
        raise ValueError(f"{missing} not in the summary's results {sorted(summary['results'])}")
    merged = {**summary, "results": {m: summary["results"][m] for m in methods}}
    # by digests where both recorded them; else FedAvg and the ensemble, which the merged methods lack
    if not same_uploads(archived, merged if method_digests(archived) and method_digests(merged) else summary):
        raise ValueError(f"{archived_file.name}: the summary did not run on the archived cell's uploads "
                         "(setting or uploads_sha256 differ)")
    for m in methods:
        theirs, ours = summary["config"]["methods"].get(m), archived["config"]["methods"].get(m)
        if ours is not None and not same_method_config(m, theirs, ours):
            raise ValueError(f"{archived_file.name}: {m} ran with {theirs}, the archived cell with {ours}")
    env = summary.get("environment")
    same_machine = machine_label(summary) == machine_label(archived)
    for m in methods:
        result = summary["results"][m]
        if env and env != archived.get("environment") and "environment" not in result:
            result = {**result, "environment": env}  # timed elsewhere: its timings name their own host
        if m not in archived["results"] and same_machine and result.get("seconds"):
            archived["merged_minutes"] = archived.get("merged_minutes", 0.0) + result["seconds"] / 60
        if m in archived["results"] and archived["results"][m] != result:
            earlier = {"result": archived["results"][m], "config": archived["config"]["methods"].get(m, {})}
            if m in archived.get("curves", {}):
                earlier["curve"] = archived["curves"][m]
            archived.setdefault("replaced", {}).setdefault(m, []).append(earlier)
        archived["results"][m] = result
        if m not in archived["config"]["methods"]:  # a method the cell had keeps its config as written
            archived["config"]["methods"][m] = summary["config"]["methods"].get(m, {})
    if metrics is not None and "curves" in archived:
        archived["curves"].update(logged_curves(metrics, tuple(methods)))
    write_json_atomic(archived_file, archived)
    return methods


def same_method_config(method: str, a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two configs of ``method`` run it alike: equal once each is completed with the method's
    current defaults, so a key set to its default value (``--set methods.dense.pool_shuffle=true``
    since that became the default) is the same run as the key left out. A config of an unknown method
    compares as written."""
    from hetfl.methods import METHODS  # importing the package registers every method

    defaults = getattr(METHODS.get(method), "defaults", {})
    return {**defaults, **(a or {})} == {**defaults, **(b or {})}


def merge_cell_methods(run: Path, methods: list[str], folder: Path) -> tuple[Path, list[str]]:
    """:func:`merge_methods` of ``methods`` from the cell ``run`` (a `hetfl reproduce` cell folder: its
    summary.json and metrics.jsonl) into the archived cell of the same name in ``folder``; ValueError
    naming what is missing. Returns the archived file and the merged methods."""
    summary_file = run / "summary.json"
    if not summary_file.is_file():
        raise ValueError(f"{summary_file}: missing (the cell has not finished)")
    summary = json.loads(summary_file.read_text())
    target = folder / f"{summary['config']['name']}.json"
    if not target.is_file():
        raise ValueError(f"{target}: no archived cell named {summary['config']['name']}")
    metrics = run / "metrics.jsonl"
    return target, merge_methods(target, summary, methods, metrics if metrics.is_file() else None)


# what decides whether clients retrained from a cell's seeds upload its models byte for byte (kernels
# and their reduction order differ between processors, the instruction set torch dispatches to, torch
# builds and thread counts). ``cpu`` alone does not tell: "AMD EPYC" names both AVX2 and AVX-512
# machines, and an AVX2 cell retrained on an AVX-512 one gave other uploads (sixty-fourth session).
RETRAIN_KEYS = ("device", "cpu", "cpu_capability", "torch", "threads")


def retrain_mismatch(archived_env: dict[str, Any], here: dict[str, Any]) -> str | None:
    """Why clients retrained in the environment ``here`` (a summary's ``environment``) would not give
    the uploads of an archived cell that ran in ``archived_env``: the :data:`RETRAIN_KEYS` the two
    both record and on which they differ, e.g. ``"cpu_capability 'AVX2' here 'AVX512'"``;
    None where they agree or the cell did not record them (runs before the field, where only
    :func:`merge_methods`' digest check, after the run, can tell)."""
    diffs = [f"{k} {archived_env[k]!r} here {here[k]!r}" for k in RETRAIN_KEYS
             if archived_env.get(k) is not None and here.get(k) is not None and archived_env[k] != here[k]]
    return "; ".join(diffs) or None


def unrecorded(archived_env: dict[str, Any]) -> list[str]:
    """The :data:`RETRAIN_KEYS` an archived cell's ``environment`` does not record: where any is
    missing, :func:`retrain_mismatch` cannot tell before a re-run (measured: FedMHO's `reduced` cells
    recorded no ``cpu`` before their whole re-run; retrained on an Intel Xeon VM and on an AVX-512 AMD
    EPYC they gave other uploads, FedAvg 27.71 and 27.77 against 27.76, sixty-third and sixty-fourth
    sessions)."""
    return [k for k in RETRAIN_KEYS if archived_env.get(k) is None]


def check_retrain(folder: Path, names: Iterable[str],
                  here: dict[str, Any]) -> dict[str, tuple[str | None, list[str]]]:
    """:func:`retrain_mismatch` and :func:`unrecorded` for each archived cell ``folder/<name>.json``,
    by name; ValueError naming a cell that is not archived."""
    out: dict[str, tuple[str | None, list[str]]] = {}
    for name in names:
        cell = folder / f"{name}.json"
        if not cell.is_file():
            raise ValueError(f"{cell}: no archived cell named {name}")
        env = json.loads(cell.read_text()).get("environment", {})
        out[name] = (retrain_mismatch(env, here), unrecorded(env))
    return out


CURVE_RUNS = "paper-server-curves"  # archive subfolder of runs measured apart from a cell (its runs.json lists them)


def cell_label(name: str, seed: int) -> str:
    """A cell's short name in runs.json: its config name ``<paper>-<cell>-s<seed>-<budget>`` without the
    paper and the budget (which may hold a hyphen), ``fedhydra-mnist-0.01-s0-paper-bf16`` -> ``mnist-0.01-s0``."""
    end = name.rfind(f"-s{seed}-")
    start = name.find("-") + 1
    if end < start:
        raise ValueError(f"{name!r} is not a cell name <paper>-<cell>-s{seed}-<budget>")
    return name[start:end + len(f"-s{seed}")]


TRIAL_SUMMARY = ".summary.json"  # scripts/device-trials.sh: <name>.summary.json and <name>.jsonl


def _run_files(run: Path, method: str) -> tuple[Path, Path, Path]:
    """A run's summary, metrics log and config (:func:`archive_run`): in a run folder, or a device
    trial's ``<name>.summary.json`` and ``<name>.jsonl``. The metrics log must exist (ValueError)."""
    if run.name.endswith(TRIAL_SUMMARY) and not run.is_dir():
        stem = run.name.removesuffix(TRIAL_SUMMARY)
        summary, metrics = run, run.with_name(stem + ".jsonl")
        if not summary.is_file() or not metrics.is_file():
            raise ValueError(f"{summary} and {metrics}: a device trial needs both")
        return summary, metrics, run.with_name(stem + ".config.json")
    summary, metrics, config = run / "summary.json", run / "metrics.jsonl", run / "config.json"
    if not metrics.is_file():  # a stopped run has only its method's own log so far
        metrics = run / method / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{run / 'metrics.jsonl'} and {metrics}: missing")
    return summary, metrics, config


def archive_run(archive: Path, run_dir: Path, method: str, label: str, *, change: str | None = None,
                merge: bool = False, curve: str | None = None, twin: str | None = None) -> dict[str, str]:
    """Keep one ``hetfl run`` of ``method`` (``run_dir``: its summary.json and metrics.jsonl) made on an
    archived cell's uploads (``archive/<config name>.json``): with ``merge`` its result joins the cell
    (:func:`merge_methods`: the budget's own config only); always its curve (that method's lines of
    metrics.jsonl) is copied to ``archive/paper-server-curves/<curve>`` (default
    ``<cell>-<method>-cpu.jsonl``, never overwritten) and listed in that folder's runs.json with
    ``label`` (``run``), for a trial of our variant ``change``, and with ``twin`` the curve file of an
    entry already listed for the same method and cell (before the comma) that ran on the same uploads
    with one setting apart (e.g. the fp32 run of a bf16 probe: the report sets them side by side).
    The runs.json cell is the one its earlier entries of this cell use (they name where the uploads
    were trained), else the short name.
    An earlier entry of the same cell and method whose curve begins this one's (the same run, archived
    when it was stopped) is removed with its file, and the new entry names it as ``replaces``.
    A stopped run (no summary.json yet: its config.json and the epochs ``<method>/metrics.jsonl``
    logged) keeps its curve but cannot be merged, and only its setting (not ``uploads_sha256``, which
    the summary records) is checked against the cell's. ``run_dir`` may instead be a finished trial as
    ``scripts/device-trials.sh`` brings it back: ``<name>.summary.json``, with ``<name>.jsonl`` beside it.
    Checks everything before writing anything; ValueError naming the problem. Returns the new entry."""
    summary_file, metrics, config_file = _run_files(run_dir, method)
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        if method not in summary.get("results", {}):
            raise ValueError(f"{method} not in {summary_file}'s results {sorted(summary.get('results', {}))}")
    elif merge:
        raise ValueError(f"{summary_file}: missing; a stopped run cannot be merged (keep its curve without --merge)")
    elif config_file.is_file():
        summary = {"config": json.loads(config_file.read_text()), "results": {}}
    else:
        raise ValueError(f"{summary_file} and {config_file}: missing")
    name = summary["config"]["name"]
    cell_file = archive / f"{name}.json"
    if not cell_file.is_file():
        raise ValueError(f"{cell_file}: no archived cell named {name}")
    cell = json.loads(cell_file.read_text())
    if summary["results"]:
        same = same_uploads(cell, {**summary, "results": {method: summary["results"][method]}})
    else:  # a stopped run: its setting only
        same = all(cell["config"].get(k) == summary["config"].get(k) for k in UPLOAD_KEYS)
    if not same:
        raise ValueError(f"{run_dir} did not run on {cell_file.name}'s uploads (setting or uploads_sha256 differ)")
    short = cell_label(name, summary["config"]["seed"])
    folder = archive / CURVE_RUNS
    target = folder / (curve or f"{short}-{method}-cpu.jsonl")
    if target.exists():
        raise ValueError(f"{target}: exists; give another curve name")
    if not logged_curves(metrics, (method,)):
        raise ValueError(f"{metrics}: no evaluated epoch of {method}")
    from hetfl.fl.payload import jsonl_rows

    lines = [json.dumps(row) for row in jsonl_rows(metrics) if row.get("method") == method]
    manifest_file = folder / "runs.json"
    manifest = json.loads(manifest_file.read_text()) if manifest_file.is_file() else {"about": "", "runs": []}
    known = [r["cell"] for r in manifest["runs"] if r["cell"] == short or r["cell"].startswith(short + ",")]
    if twin is not None:
        listed = [r for r in manifest["runs"] if r["file"] == twin]
        if not listed or not (folder / twin).is_file():
            raise ValueError(f"twin {twin!r}: not a curve listed in {manifest_file}")
        if listed[0]["method"] != method or listed[0]["cell"].split(",")[0] != short:
            raise ValueError(f"twin {twin!r} is {listed[0]['method']} of {listed[0]['cell']}, not {method} of {short}")
    entry = {"cell": known[0] if known else short, "method": method, "run": label, "file": target.name}
    if change:
        entry["change"] = change
    if twin is not None:
        entry["twin"] = twin
    # the same run archived earlier when it was stopped: its curve is a prefix of this one's
    def begins_this(r: dict[str, str]) -> bool:
        if r["cell"] != entry["cell"] or r["method"] != method or not (folder / r["file"]).is_file():
            return False
        earlier = (folder / r["file"]).read_text().splitlines()
        return bool(earlier) and lines[:len(earlier)] == earlier

    older = [r for r in manifest["runs"] if begins_this(r)]
    if older:
        entry["replaces"] = ", ".join(r["file"] for r in older)
    if twin in {r["file"] for r in older}:
        raise ValueError(f"twin {twin!r} is an earlier copy of this run (this one replaces it)")
    if merge:
        merge_methods(cell_file, summary, [method], metrics)
    folder.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(lines) + "\n")
    for r in older:
        (folder / r["file"]).unlink()
    manifest["runs"] = [r for r in manifest["runs"] if r not in older] + [entry]
    write_json_atomic(manifest_file, manifest)
    return entry


REPLACED_WHOLE = "replaced_whole"  # key of a cell kept apart under partial/ after a whole re-run replaced it


def replace_cell(run: Path, archive: Path, kept_as: str, curve_methods: tuple[str, ...] = (),
                 folder: str = "") -> tuple[Path, Path]:
    """Archive the finished cell ``run`` (a `hetfl reproduce` cell folder: summary.json, metrics.jsonl)
    in place of the archived cell of its name in ``archive/<folder>`` (``folder`` "": the archive itself;
    FedHydra's one-cache cells: ``one-cache``), a whole re-run of it (every method, on uploads trained
    again, e.g. on another machine after a change of defaults), and keep the earlier copy apart as
    ``archive/partial/<kept_as>/<name>.json`` with ``replaced_whole`` (the run's environment, when it
    replaced it and, where not "", the ``folder`` that holds the cell that replaced it), so "Re-runs
    kept apart" reads the two side by side. ValueError, naming the problem, where the run has not
    finished, no archived cell has its name, its setting differs (:data:`UPLOAD_KEYS`), it lacks a method
    the archived cell has, or ``kept_as`` already holds the cell. Returns (the archived cell, where the
    earlier copy went)."""
    summary_file = run / "summary.json"
    if not summary_file.is_file():
        raise ValueError(f"{summary_file}: missing (the cell has not finished)")
    summary = json.loads(summary_file.read_text())
    name = summary["config"]["name"]
    cells = archive / folder  # folder "": the archive itself (Path / "" is the same path)
    target = cells / f"{name}.json"
    if not target.is_file():
        raise ValueError(f"{target}: no archived cell named {name} to replace")
    if run.name != name:
        raise ValueError(f"{run}: its summary names the cell {name}; archive_cell needs the folder named so")
    earlier = json.loads(target.read_text())
    differ = [k for k in UPLOAD_KEYS if earlier["config"].get(k) != summary["config"].get(k)]
    if differ:
        raise ValueError(f"{name}: the re-run's setting differs from the archived cell's in {differ}")
    if drops_methods(earlier, summary):
        lost = sorted(set(earlier["results"]) - set(summary["results"]))
        raise ValueError(f"{name}: the re-run lacks {lost}, which the archived cell has (run them too, "
                         "or merge single methods with archive-merge)")
    kept = archive / PARTIAL / kept_as / f"{name}.json"
    if kept.exists():
        raise ValueError(f"{kept}: already kept; choose another name for the earlier copies")
    kept.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"environment": summary.get("environment", {}), "on": time.strftime("%Y-%m-%d"),
             **({"folder": folder} if folder else {})}
    write_json_atomic(kept, {**earlier, REPLACED_WHOLE: stamp})
    target.unlink()
    saved = archive_cell(run.parent, name, cells, curve_methods)
    if saved != target:  # archive_cell keeps a summary apart only beside an archived copy, gone now
        raise RuntimeError(f"{name}: archived as {saved}, not {target}")
    return target, kept


def partial_runs(archive: Path) -> list[tuple[str, dict[str, Any], dict[str, Any] | None]]:
    """``(runs folder, summary, archived cell or None)`` for every summary kept apart under
    ``archive/partial/<runs folder>/`` (:func:`archive_cell`, :func:`replace_cell`), sorted by folder and
    cell name. The archived cell is ``archive/<name>.json``, or ``archive/<folder>/<name>.json`` where a
    whole re-run replaced a cell of a subfolder (its ``replaced_whole`` names the folder)."""
    out = []
    for p in sorted((archive / PARTIAL).glob("*/*.json")):
        summary = json.loads(p.read_text())
        main = archive / summary.get(REPLACED_WHOLE, {}).get("folder", "") / p.name
        out.append((p.parent.name, summary, json.loads(main.read_text()) if main.is_file() else None))
    return out


UPLOAD_KEYS = ("dataset", "seed", "clients", "partition", "client", "server")  # what makes the uploads


def same_uploads(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two cells provably ran on the same client uploads: the same clients, partition and seed,
    and then, where both recorded ``uploads_sha256`` (runs since that field), the same digest for every
    method both ran and every digest of the cell with fewer of them found in the other (a cell's
    methods may upload different things: FedMHO's classifiers and CVAEs, FedCVAE's decoders), else
    FedAvg and the ensemble (pure functions of the uploads) equal to the last digit."""
    if any(a["config"].get(k) != b["config"].get(k) for k in UPLOAD_KEYS):
        return False
    per_a, per_b = method_digests(a), method_digests(b)
    if per_a and per_b:
        if any(per_a[m] != per_b[m] for m in per_a.keys() & per_b.keys()):
            return False
        fewer, more = sorted((set(per_a.values()), set(per_b.values())), key=len)
        return fewer <= more

    def accuracy(cell: dict[str, Any], method: str) -> float | None:
        return cell["results"].get(method, {}).get("accuracy")

    # FedAvg must have run in both; the ensemble must agree too (or be absent from both)
    return accuracy(a, "fedavg") is not None and all(accuracy(a, m) == accuracy(b, m) for m in ("fedavg", "ensemble"))


def method_digests(cell: dict[str, Any]) -> dict[str, str]:
    """``{method: uploads_sha256}`` for the methods of a cell that recorded it."""
    return {m: r["uploads_sha256"] for m, r in cell["results"].items() if "uploads_sha256" in r}


def upload_digests(cell: dict[str, Any]) -> set[str]:
    return set(method_digests(cell).values())


PARTIAL_INTRO = """Summaries of methods run again into another runs folder, on the seeds of archived cells (same
code and config), kept in `{where}` because they lack some of the archived cell's methods (or, moved
there by `hetfl archive-replace` or by hand, because a later run of the whole cell replaced them, or
because their config differs from the budget's in a way their name says, such as `-amx-bf16`), so the
tables above do not use them.
Per runs folder: how many cells had byte-identical uploads, and how far the methods both runs have lie
apart (final %, the later run minus the earlier); then every method that only these re-runs
measured."""

WHOLE_INTRO = """Cells that a later run of the whole cell replaced (`hetfl archive-replace`: every method again,
on uploads trained again), per method: the mean over those cells of the earlier copies (kept apart)
and of the archived cells that replaced them. Best over epochs % (final %); Δ = later minus earlier.
Marked methods ran older defaults in some earlier copies ({mark}: the footnotes of the tables above)."""


def partial_report(archive: Path, labels: dict[str, str]) -> str:
    """Markdown section on :func:`partial_runs` ("" when there are none): their agreement with the
    archived cells, and the methods found only in them (final %, best over epochs in brackets)."""
    runs = partial_runs(archive)
    if not runs:
        return ""
    lines = ["### Re-runs kept apart", "", PARTIAL_INTRO.format(where=f"{archive.name}/{PARTIAL}/"), "",
             "| runs folder | cells | same uploads | methods in both | final Δ: mean abs / largest |",
             "|---|---|---|---|---|"]
    only: list[str] = []
    for folder in sorted({f for f, _, _ in runs}):
        pairs = [(s, a) for f, s, a in runs if f == folder]
        deltas = [_later_minus_earlier(s, a, m) for s, a in pairs if a is not None
                  for m in s["results"] if m in a["results"]]
        same = f"{sum(a is not None and same_uploads(s, a) for s, a in pairs)} of {len(pairs)}"
        why = [f"{n} {what}" for n, what in (
            (sum(a is None for _, a in pairs), "with no archived cell"),
            (sum(a is not None and not (upload_digests(s) and upload_digests(a)) for s, a in pairs),
             "without digests")) if n]
        if why:
            same += f" ({'; '.join(why)})"
        spread = (f"{statistics.fmean(abs(d) for d in deltas):.2f} / {max(deltas, key=abs):+.2f}"
                  if deltas else "-")
        lines.append(f"| `{folder}` | {len(pairs)} | {same} | {len(deltas)} | {spread} |")
        for s, a in pairs:
            for m, r in s["results"].items():
                if a is None or m not in a["results"]:
                    only.append(f"| {s['config']['name']} | {labels.get(m, m)} | "
                                f"{r['accuracy']:.2f} ({r.get('best_accuracy', r['accuracy']):.2f}) | `{folder}` |")
    if only:
        lines += ["", "Measured only in these re-runs:", "", "| cell | method | final (best) % | runs folder |",
                  "|---|---|---|---|", *only]
    return "\n".join(lines + _replaced_whole_lines(runs, labels))


def _later_minus_earlier(kept: dict[str, Any], archived: dict[str, Any], method: str) -> float:
    """``method``'s final accuracy in the later of a kept-apart summary and its archived cell minus the
    earlier's: the archived cell is the later where it replaced the kept one whole (:data:`REPLACED_WHOLE`)."""
    delta = kept["results"][method]["accuracy"] - archived["results"][method]["accuracy"]
    return -delta if REPLACED_WHOLE in kept else delta


def _replaced_whole_lines(runs: list[tuple[str, dict[str, Any], dict[str, Any] | None]],
                          labels: dict[str, str]) -> list[str]:
    """The per-method table of :data:`WHOLE_INTRO` (no lines when no kept cell was replaced whole)."""
    pairs = [(f, s, a) for f, s, a in runs if REPLACED_WHOLE in s and a is not None]
    if not pairs:
        return []
    out = ["", WHOLE_INTRO.format(mark=OLDER_MARK), "",
           "| runs folder | method | cells | earlier | later | Δ best | Δ final |", "|---|---|---|---|---|---|---|"]
    for folder in sorted({f for f, _, _ in pairs}):
        group = [(s, a) for f, s, a in pairs if f == folder]
        methods = sorted({m for s, a in group for m in s["results"] if m in a["results"]},
                         key=lambda m: labels.get(m, m))
        for m in methods:
            both = [(s, a) for s, a in group if m in s["results"] and m in a["results"]]
            before, after = [s["results"][m] for s, _ in both], [a["results"][m] for _, a in both]
            best = (statistics.fmean(map(_best, before)), statistics.fmean(map(_best, after)))
            final = (statistics.fmean(r["accuracy"] for r in before), statistics.fmean(r["accuracy"] for r in after))
            out.append(f"| `{folder}` | {labels.get(m, m)}{older_mark(m, before)} | {len(both)} | "
                       f"{best[0]:.2f} ({final[0]:.2f}) | {best[1]:.2f} ({final[1]:.2f}) | "
                       f"{best[1] - best[0]:+.2f} | {final[1] - final[0]:+.2f} |")
    return out


# Methods whose defaults changed after results were archived: the settings since, and what the
# mark on a result that ran the older ones says. A result ran them when it has no ``params`` (recorded
# since the change) or its params differ on these keys.
CHANGED_DEFAULTS: dict[str, tuple[dict[str, Any], str]] = {
    "coboosting": ({"grad_clip": 10.0, "generator_grad_clip": 10.0, "pool_shuffle": True},
                   "Co-Boosting without its code's gradient clipping (student and generator at norm 10) and "
                   "with the KD batches in pool order, not reshuffled each epoch as its code's DataLoader "
                   "does: the defaults before the fifty-ninth session; the notes say what they change"),
    **{method: ({"pool_shuffle": True},
                f"{who} with the KD batches in pool order (this epoch's batch first, then the pool oldest first), "
                f"not drawn each epoch from a loader shuffled over the whole pool as {code} does: the defaults "
                "before the sixty-sixth session; the notes say what it changes")
       for method, who, code in (
           ("dense", "DENSE", "its code"),
           ("fedhydra_dense", "FedHydra in DENSE's loop", "the FedHydra authors' code"),
           ("fedhydra_dense_log1p", "Ours (FedHydra in DENSE's loop, log1p(U))", "the FedHydra authors' code"))},
}
OLDER_MARK = "†"


def older_defaults(method: str, result: dict[str, Any]) -> bool:
    """Whether ``result`` (a method's entry in a summary) ran ``method``'s defaults of before
    :data:`CHANGED_DEFAULTS`."""
    if method not in CHANGED_DEFAULTS:
        return False
    params = result.get("params")
    return not isinstance(params, dict) or any(params.get(k) != v for k, v in CHANGED_DEFAULTS[method][0].items())


def older_mark(method: str, runs: list[dict[str, Any]]) -> str:
    """`` †`` where every run of ``runs`` ran the older defaults, `` † k of n`` where some did."""
    older = sum(older_defaults(method, r) for r in runs)
    if not older:
        return ""
    return f" {OLDER_MARK}" if older == len(runs) else f" {OLDER_MARK} {older} of {len(runs)}"


def older_footnotes(marked: Iterable[str]) -> list[str]:
    """One footnote per method of ``marked``, each after a blank line (a paragraph of its own in
    markdown); none: no lines."""
    return [x for m in marked for x in ("", f"{OLDER_MARK} {CHANGED_DEFAULTS[m][1]}.")]


def older_note(methods: Iterable[str], cells: list[dict[str, Any]]) -> list[str]:
    """The footnote lines for the marks :func:`older_mark` puts in a table of ``cells``."""
    return older_footnotes(m for m in methods
                           if any(older_defaults(m, s["results"][m]) for s in cells if m in s["results"]))


REPLACED_INTRO = """Results merged into archived cells on the cells' own uploads (`merge_methods`: the same
upload digests, or FedAvg and the ensemble to the last digit), replacing an earlier result of the same
method: after a change of its defaults (marked {mark} where the earlier one ran them), the earlier and
the new result side by side. Best over epochs % (final %); a setting's seeds are followed by their
mean row, and a budget's method re-run in several settings by the mean over all its cells."""


def replaced_rows(archive: Path) -> list[dict[str, Any]]:
    """One row per method result replaced in an archived cell (the cell's ``replaced``, written by
    :func:`merge_methods`) in ``archive`` and its subfolders: cell name, its setting (the short name
    without the seed: ``fmnist-0.5``) and seed, method, the earlier and the current result, whether the
    earlier one ran the older defaults (:func:`older_defaults`), and the cell's other ``results``."""
    rows = []
    for p in sorted(archive.rglob("*.json")):
        if PARTIAL in p.relative_to(archive).parts:
            continue
        try:
            cell = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if not isinstance(cell, dict) or not isinstance(cell.get("replaced"), dict):
            continue
        name, seed = cell["config"]["name"], cell["config"]["seed"]
        setting = cell_label(name, seed).removesuffix(f"-s{seed}")
        for method, earlier in cell["replaced"].items():
            for old in earlier:
                rows.append({"cell": name, "setting": setting, "seed": seed, "method": method,
                             "before": old["result"], "after": cell["results"][method],
                             "older": older_defaults(method, old["result"]), "results": cell["results"]})
    return rows


def _best(r: dict[str, Any]) -> float:
    return r.get("best_accuracy", r["accuracy"])


def _replaced_line(budget: str, what: str, name: str, group: list[dict[str, Any]], against: str | None) -> str:
    """The mean row of ``group`` (:func:`replaced_report`)."""
    d_best = statistics.fmean(_best(r["after"]) - _best(r["before"]) for r in group)
    d_final = statistics.fmean(r["after"]["accuracy"] - r["before"]["accuracy"] for r in group)
    higher = sum(_best(r["after"]) > _best(r["before"]) for r in group)
    cols = [f"`{budget}`", f"**{what}, mean of {len(group)}** (best higher in {higher})", name,
            f"{statistics.fmean(_best(r['before']) for r in group):.2f}",
            f"{statistics.fmean(_best(r['after']) for r in group):.2f}", f"**{d_best:+.2f}**", f"**{d_final:+.2f}**"]
    if against is not None:
        theirs = [_best(r["results"][against]) for r in group if against in r["results"]]
        cols.append(f"{statistics.fmean(theirs):.2f} n={len(theirs)}" if theirs else "-")
    return "| " + " | ".join(cols) + " |"


def replaced_report(archive: Path, labels: dict[str, str], budgets: Iterable[str], against: str | None = None) -> str:
    """Markdown section on :func:`replaced_rows` ("" when there are none): per budget (the one a cell's
    name ends in, longest match first) and method, each setting's cells by seed and their mean row, and
    the mean over all of them where there are several settings; with ``against`` a last column gives
    that method's best-over-epochs accuracy in the same cells (say, ours beside the re-run baseline)."""
    rows = replaced_rows(archive)
    if not rows:
        return ""

    def budget_of(name: str) -> str:
        return next((b for b in sorted(budgets, key=len, reverse=True) if name.endswith(f"-{b}")), "other")

    def acc(r: dict[str, Any]) -> str:
        return f"{_best(r):.2f} ({r['accuracy']:.2f})"

    head = "| budget | cell | method | before | after | Δ best | Δ final |"
    rule = "|---|---|---|---|---|---|---|"
    if against is not None:
        head, rule = head + f" {labels.get(against, against)}, best |", rule + "---|"
    lines = ["## Results re-run after a change of defaults (same uploads)", "",
             REPLACED_INTRO.format(mark=OLDER_MARK), "", "### Per cell and method", "", head, rule]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: (r["setting"], r["seed"])):
        groups.setdefault((budget_of(r["cell"]), r["method"]), []).append(r)
    for (budget, method), group in sorted(groups.items()):
        name = labels.get(method, method)
        settings = list(dict.fromkeys(r["setting"] for r in group))
        for setting in settings:
            these = [r for r in group if r["setting"] == setting]
            for r in these:
                mark = f" {OLDER_MARK}" if r["older"] else ""
                cols = [f"`{budget}`", r["cell"], name, f"{acc(r['before'])}{mark}", acc(r["after"]),
                        f"{_best(r['after']) - _best(r['before']):+.2f}",
                        f"{r['after']['accuracy'] - r['before']['accuracy']:+.2f}"]
                if against is not None:
                    cols.append(f"{_best(r['results'][against]):.2f}" if against in r["results"] else "-")
                lines.append("| " + " | ".join(cols) + " |")
            if len(these) > 1:
                lines.append(_replaced_line(budget, setting, name, these, against))
        if len(settings) > 1:
            lines.append(_replaced_line(budget, "all", name, group, against))
    marked = sorted({r["method"] for r in rows if r["older"]})
    return "\n".join(lines + older_footnotes(marked))


def check_choices(option: str, given: str | list[str] | tuple[str, ...], valid: Iterable[str], also: str = "") -> None:
    """A :class:`hetfl.config.ConfigError` naming the command-line ``option``, its unknown values and
    the valid ones (``also``: a further accepted form, e.g. " (or none)")."""
    from hetfl.config import ConfigError

    valid = list(valid)
    bad = [g for g in ([given] if isinstance(given, str) else given) if g not in valid]
    if bad:
        raise ConfigError(f"--{option}: unknown {', '.join(map(repr, bad))}; choose from {', '.join(valid)}{also}")


def simulator_flags(args: Any) -> dict[str, bool]:
    """The ``simulator`` settings that ``hetfl reproduce``'s flags of the same names ask for
    (``--batch-clients``, ``--flush-denormal``; {} for none: the cells keep the defaults)."""
    from hetfl.config import SIMULATOR_KEYS

    return {key: True for key in SIMULATOR_KEYS if getattr(args, key, False)}


def csv(text: str) -> list[str]:
    """A comma-separated command-line value as its non-empty, stripped items."""
    return [t.strip() for t in text.split(",") if t.strip()]


def int_list(option: str, text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``, or a :class:`hetfl.config.ConfigError` naming ``--option``."""
    from hetfl.config import ConfigError

    try:
        return [int(t) for t in csv(text)]
    except ValueError:
        raise ConfigError(f"--{option}: expected comma-separated integers such as 0,1,2, got {text!r}") from None


def stats(values: list[float]) -> str:
    """``mean ± sd`` over seeds (just the value for one seed, ``-`` for none)."""
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.2f}"
    return f"{mean:.2f} ± {statistics.stdev(values):.2f}"


def write_results(path: Path, header: str, bodies: list[str], notes: Path | None = None) -> None:
    """A results file: the header, every budget's tables that hold a cell (``###``), then the
    hand-written notes file if there is one."""
    parts = [header, *(b for b in bodies if "###" in b)]
    if notes is not None and notes.is_file():
        parts.append(notes.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(parts) + "\n")


def failure_note(cells: list[dict[str, Any]]) -> str:
    """One line naming every client a method had to leave out (a failed or rejected upload), per
    cell, so that a table mean built on fewer clients is visible; empty when no client failed."""
    found: dict[tuple[str, int, str], list[str]] = {}
    for s in cells:
        for method, r in s["results"].items():
            for f in r.get("client_failures", []):
                reason = re.sub(r"tensor '[^']+' has ", "", f["reason"])  # same failure, other tensor names
                found.setdefault((s["config"]["name"], f["client"], reason), []).append(method)
    if not found:
        return ""
    parts = [f"{name}: client {client} left out by {', '.join(methods)} ({reason})"
             for (name, client, reason), methods in sorted(found.items())]
    return "Client failures (these methods ran without that client): " + "; ".join(parts) + "."


def cell_minutes(summary: dict[str, Any]) -> float:
    """Wall minutes spent on a cell over all its runs (methods added later carry ``prior_minutes``), with
    the server minutes of methods merged in from runs on the same machine (``merged_minutes``,
    :func:`merge_methods`)."""
    return summary.get("minutes", 0.0) + summary.get("prior_minutes", 0.0) + summary.get("merged_minutes", 0.0)


def machine_label(summary: dict[str, Any]) -> str:
    """Where a cell ran, for its minutes: the GPU's name on a GPU (``cuda`` for summaries written before
    the name was recorded), else ``cpu`` with the processor, its vector extension and its strongest bf16
    unit (``cpu_bf16``, recorded since the forty-ninth session: ``amx_bf16`` makes one "Intel(R) Xeon(R)
    Processor" several times faster in bf16 than another); empty when the summary records no device."""
    env = summary.get("environment", {})
    device = env.get("device", "")
    if device.startswith("cuda"):
        return f"{device} ({env['accelerator']})" if env.get("accelerator") else device
    strongest_bf16 = (env.get("cpu_bf16") or [None])[-1]
    details = ", ".join(v for v in (env.get("cpu"), env.get("cpu_capability"), strongest_bf16) if v)
    return f"{device} ({details})" if details else device


def minutes_per_machine(cells: list[dict[str, Any]], unit: str = "cells") -> str:
    """``12.00 ± 1.00 over 3 cells on cpu (AMD EPYC, AVX2); 7.00 over 1 cells on cuda (...)``, one part
    per :func:`minutes_by_machine` group; empty when no cell is timed."""
    return "; ".join(f"{stats(m)} over {len(m)} {unit}" + (f" on {label}" if label else "")
                     for label, m in minutes_by_machine(cells))


def minutes_by_machine(cells: list[dict[str, Any]]) -> list[tuple[str, list[float]]]:
    """The cells' wall minutes (:func:`cell_minutes`) grouped by :func:`machine_label`, in order of
    first appearance: minutes from a GPU and from 2 CPU cores do not average into one figure."""
    groups: dict[str, list[float]] = {}
    for s in cells:
        if s.get("minutes"):
            groups.setdefault(machine_label(s), []).append(cell_minutes(s))
    return list(groups.items())


def same_setting(earlier: dict[str, Any], cfg: dict[str, Any]) -> bool:
    """Whether an earlier run's config has the same setting as ``cfg`` (a validated config), methods
    aside. The earlier config goes through :func:`hetfl.config.validate` first, so a key added to the
    schema after that run (``flower``, ``min_clients``) takes its default instead of making the finished
    cell run again; a config the current schema rejects is not the same setting."""
    from hetfl.config import ConfigError, validate

    try:
        filled = validate({**earlier, "methods": cfg["methods"]})
    except ConfigError:
        return False
    return {k: v for k, v in filled.items() if k != "methods"} == {k: v for k, v in cfg.items() if k != "methods"}


def prior_results(out: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """What an earlier run of this cell (same setting, other or fewer methods) finished, so that adding
    methods to a cell (e.g. the baselines after the FedMHO family) keeps the earlier methods' results:
    the simulator rewrites ``summary.json`` with the methods it runs. A copy of the earlier summary is
    kept in ``summary-prior.json`` while the new methods run (an interrupted run loses nothing)."""
    empty: dict[str, Any] = {"config": {**cfg, "methods": {}}, "results": {}}
    found = [json.loads(p.read_text()) for p in (out / "summary-prior.json", out / "summary.json") if p.is_file()]
    prior = empty
    for s in found:
        if not same_setting(s["config"], cfg):
            continue
        done = {m: q for m, q in s["config"]["methods"].items() if m in s["results"]}  # not the unfinished ones
        prior = {**s, "config": {**s["config"], "methods": {**prior["config"]["methods"], **done}},
                 "results": {**prior["results"], **s["results"]},
                 "minutes": max(prior.get("minutes", 0.0), s.get("minutes", 0.0))}
    if prior["results"]:
        (out / "summary-prior.json").write_text(json.dumps(prior, indent=1))
    return prior


def merge_results(out: Path, prior: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` (the methods just run) joined with ``prior``'s other methods, written to
    ``summary.json``; the cell's minutes are the earlier run's plus this one's (``prior_minutes``), and
    so are the uploads its runs trained (``uploads_trained``); metrics.jsonl covers every method."""
    if not prior["results"]:
        return summary
    methods = {**prior["config"]["methods"], **summary["config"]["methods"]}
    merged = {**summary, "config": {**summary["config"], "methods": methods},
              "results": {**{m: r for m, r in prior["results"].items() if m not in summary["results"]},
                          **summary["results"]},
              "prior_minutes": prior.get("minutes", 0.0) + prior.get("prior_minutes", 0.0)}
    from hetfl.engine.simulator import UPLOADS_TRAINED  # the caller ran the simulator: torch is loaded

    if trained := prior.get(UPLOADS_TRAINED, 0) + summary.get(UPLOADS_TRAINED, 0):
        merged[UPLOADS_TRAINED] = trained
    (out / "config.json").write_text(json.dumps(merged["config"], indent=1))
    (out / "summary.json").write_text(json.dumps(merged, indent=1))  # before the prior copy goes
    with open(out / "metrics.jsonl", "w") as f:
        for m in methods:
            if (out / m / "metrics.jsonl").is_file():
                f.write((out / m / "metrics.jsonl").read_text())
    (out / "summary-prior.json").unlink(missing_ok=True)
    return merged


def missing_methods(cfg: dict[str, Any], prior: dict[str, Any]) -> list[str]:
    """Methods of ``cfg`` that ``prior`` (:func:`prior_results`) has not finished with the same parameters."""
    return [m for m, p in cfg["methods"].items()
            if m not in prior["results"] or prior["config"]["methods"].get(m) != p]


def run_missing_methods(cfg: dict[str, Any], out: Path, cache: Path | None, data_root: str | None,
                        quiet: bool = False, warm: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run the methods of ``cfg`` that ``out`` has not finished with the same parameters, and
    return the cell's summary with the earlier methods' results kept. ``warm`` (other methods of the
    cell, name -> parameters): their client uploads are trained into ``cache`` first
    (:meth:`Simulator.train_uploads`), for workers that run them later."""
    from hetfl.engine.simulator import Simulator, prepare

    prior = prior_results(out, cfg)
    todo = {m: cfg["methods"][m] for m in missing_methods(cfg, prior)}
    if not todo:
        return prior
    sim = Simulator(prepare({**cfg, "methods": todo}, data_root), out, cache, quiet=quiet, data_root=data_root)
    if warm:
        sim.train_uploads(warm)
    return merge_results(out, prior, sim.run())


def train_upload_shard(cfg: dict[str, Any], out: Path, cache: Path, data_root: str | None, quiet: bool,
                       methods: dict[str, dict[str, Any]], clients: list[int]) -> dict[str, int]:
    """Train the client uploads of ``methods`` (name -> parameters) for the client ids ``clients`` of
    the cell ``cfg`` into ``cache``, and run no server stage: one shard of a cell's clients' job
    (:func:`run_cells_parallel` with ``client_jobs``). Returns the accepted uploads per method."""
    from hetfl.engine.simulator import Simulator, prepare

    sim = Simulator(prepare({**cfg, "methods": methods}, data_root), out, cache, quiet=quiet, data_root=data_root)
    return sim.train_uploads(methods, clients)


def client_shards(num_clients: int, client_jobs: int) -> list[list[int]]:
    """The client ids of a cell dealt round-robin into ``client_jobs`` shards (at most one per client):
    with FedMHO's ten clients and five shards, each shard holds one strong and one weak client."""
    if client_jobs < 1:
        raise ValueError(f"client_jobs must be at least 1, got {client_jobs}")
    n = min(client_jobs, num_clients)
    return [list(range(k, num_clients, n)) for k in range(n)]


# ---- parallel cells: one process per method on the cached uploads ----------------------------------
CHEAP = ("ensemble", "fedavg")  # methods that only need the client uploads: they train the clients first


@dataclass
class _Job:
    cell: str
    methods: list[str]
    out: Path
    log: Path
    proc: subprocess.Popen | None = None
    start: float = 0.0
    warm: list[str] = field(default_factory=list)  # methods whose uploads this job trains first
    clients: list[int] | None = None  # a shard of the cell's clients: this job trains their uploads only


def _start(job: _Job, cfg: dict[str, Any], cache: Path | None, data_root: str | None, quiet: bool,
           threads: int) -> None:
    job.out.mkdir(parents=True, exist_ok=True)
    spec = job.log.with_suffix(".json")
    warm = {m: cfg["methods"][m] for m in job.warm} if cache else {}  # without a cache nothing is shared
    spec.write_text(json.dumps({"config": {**cfg, "methods": {m: cfg["methods"][m] for m in job.methods}},
                                "out": str(job.out), "cache": str(cache) if cache else None,
                                "data_root": data_root, "quiet": quiet, "threads": threads, "warm": warm,
                                "clients": job.clients}))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    with open(job.log, "w") as log:
        job.proc = subprocess.Popen([sys.executable, "-m", "hetfl.reproduce.worker", str(spec)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
    job.start = time.perf_counter()


def _merge_part(cfg: dict[str, Any], cell_out: Path, part: _Job) -> None:
    """Move a worker's method folder into the cell folder and join its summary to the cell's."""
    summary = json.loads((part.out / "summary.json").read_text())
    for m in part.methods:
        if (cell_out / m).exists():
            shutil.rmtree(cell_out / m)
        shutil.move(str(part.out / m), str(cell_out / m))
    merge_results(cell_out, prior_results(cell_out, cfg), summary)
    shutil.rmtree(part.out)


def merge_finished_parts(root: Path, cells: list[dict[str, Any]] | None = None) -> list[str]:
    """Join to ``root/<cell>`` every worker's method folder ``root/.parts/<cell>/<method>`` that
    finished (its summary.json holds the method's result, on the cell's setting) but was not merged:
    a worker that ended while its parent was being stopped, say by a device call's deadline. With
    ``cells`` (validated configs), only their parts whose method parameters are the ones asked for.
    A cell folder without a summary yet takes nothing. Returns the merged parts as ``<cell>: <method>``."""
    from hetfl.config import validate

    wanted = {c["name"]: c for c in cells} if cells is not None else None
    merged = []
    for done in sorted(root.glob(".parts/*/*/summary.json")):
        part, cell = done.parent, done.parent.parent.name
        method, cell_file = part.name, root / cell / "summary.json"
        summary = json.loads(done.read_text())
        if method not in summary.get("results", {}) or not cell_file.is_file():
            continue
        params = summary["config"]["methods"].get(method)
        if wanted is not None and (cell not in wanted or wanted[cell]["methods"].get(method) != params):
            continue
        earlier = json.loads(cell_file.read_text())["config"]
        cfg = validate({**earlier, "methods": {**earlier["methods"], method: params}})
        if not same_setting(summary["config"], cfg):
            continue
        _merge_part(cfg, root / cell, _Job(cell, [method], part, part.with_suffix(".log")))
        merged.append(f"{cell}: {method}")
    return merged


@dataclass
class _Plan:
    ready: list[_Job]  # jobs that can start now
    later: dict[str, list[_Job]]  # per cell: the method jobs that start when its clients' job is done
    held: dict[str, _Job] = field(default_factory=dict)  # per cell: the clients' job, until its shards end
    shards: dict[str, int] = field(default_factory=dict)  # per cell: shards still running or to start
    shard_minutes: dict[str, float] = field(default_factory=dict)  # per cell: its ended shards' wall minutes


def _plan(cells: list[dict[str, Any]], root: Path, client_jobs: int = 1) -> _Plan:
    """Per unfinished cell: the clients' job (ready now; it trains every missing method's uploads) and
    one job per other missing method (later). With ``client_jobs`` > 1, that many shard jobs come
    first (:func:`client_shards`), each training every missing method's uploads for its own clients,
    and the clients' job is held until they all end (it then finds every upload in the cache)."""
    plan = _Plan([], {})
    for cfg in cells:
        name = cfg["name"]
        prior = prior_results(root / name, cfg)
        todo = missing_methods(cfg, prior)
        if not todo:
            continue
        first = [m for m in todo if m in CHEAP]
        if not first and not prior["results"]:  # no summary yet: the clients' job writes the first
            first = todo[:1]
        parts = root / ".parts" / name
        parts.mkdir(parents=True, exist_ok=True)
        rest = [m for m in todo if m not in first]
        plan.later[name] = [_Job(name, [m], parts / m, parts / f"{m}.log") for m in rest]
        shards = [_Job(name, [], parts / f"clients-{k}", parts / f"clients-{k}.log", warm=todo, clients=ids)
                  for k, ids in enumerate(client_shards(int(cfg["clients"]), client_jobs))]
        # the clients' job also trains the uploads the other methods ask for (FedMHO's CVAEs, say),
        # so that the workers started after it do not train the same request side by side
        clients = _Job(name, first, root / name, parts / "clients.log", warm=rest)
        if first and len(shards) == 1:  # the clients' job trains them all, as without client_jobs
            plan.ready.append(clients)
            continue
        plan.ready += shards  # then the clients' job, held until they end; or, in a resumed cell (say, a
        plan.shards[name] = len(shards)  # second device call), every method at once: none waits for another
        if first:
            plan.held[name] = clients
    return plan


def _pending(cell: str, plan: _Plan, running: list[_Job]) -> bool:
    """Whether a job of ``cell`` is still to start or running."""
    return cell in plan.later or cell in plan.held or any(j.cell == cell for j in (*plan.ready, *running))


def worker_threads(cpus: int, jobs: int, startable: int) -> int:
    """Torch threads for a worker started when ``startable`` jobs (it, those running and those ready)
    could run: the cores shared by as many of them as ``jobs`` allows. A worker's threads are fixed
    when it starts, and jobs become ready only when a cell's clients' job ends, so a job that starts
    alone (one cell's clients' job, or its last method) cannot be joined by another cell's job later.
    With fewer cells than ``jobs``, a cell's methods can start beside another cell's clients' job that
    took more threads, so the threads may exceed the cores until that job ends."""
    if cpus < 1 or jobs < 1 or startable < 1:
        raise ValueError(f"worker_threads needs positive counts, got cpus={cpus}, jobs={jobs}, "
                         f"startable={startable}")
    return max(1, cpus // min(jobs, startable))


def run_cells_parallel(cells: list[dict[str, Any]], root: Path, cache: Path | None, data_root: str | None,
                       jobs: int, quiet: bool = True, threads: int | None = None,
                       say: Callable[[str], None] = print,
                       done: Callable[[str], Any] | None = None, client_jobs: int = 1) -> list[str]:
    """Run every unfinished method of ``cells`` with up to ``jobs`` worker processes at once.

    Per cell, one job first trains the client uploads of every missing method into the upload cache
    (classifiers and, for FedMHO, CVAEs) and runs the methods that only need the uploads (ensemble,
    FedAvg; or, in a cell with no summary yet, the first missing method) into the cell folder; then
    every other missing method runs in a worker of its own on those cached uploads, into
    ``root/.parts/<cell>/<method>``, and is
    merged into the cell folder as soon as it is done (only this process writes there). A cell that
    has a summary but none of those cheap methods left (a resumed call) gets an uploads-only job (the
    shards of ``client_jobs``, or one), and then all its missing methods start at once, so that the
    long ones resume from their checkpoints instead of waiting for a short one to end. This is what
    keeps a GPU busy: one data-free method alone leaves it mostly idle between small kernels. Each
    worker gets ``threads`` torch threads (default: the CPU count divided by the number of workers that
    can run beside it when it starts, :func:`worker_threads`: a cell's clients' job alone gets every core).
    ``done(cell)`` is called once per cell when its last job has ended and been merged (at once for a
    cell with nothing left to run), e.g. to archive it. Returns the failed jobs (``cell: methods
    (log)``). Ctrl-C or SIGTERM to this process (it waits for the step under way), or a worker stopped
    by either, stops every worker, which keep their checkpoints, and starts no other job: the same call
    resumes (a worker that finished but was not merged is merged first: :func:`merge_finished_parts`).
    The stop ends with KeyboardInterrupt, or, for SIGTERM to this process, with SIGTERM re-raised.

    ``client_jobs`` > 1 splits each cell's client training over that many processes first, each
    training one shard of the clients (:func:`client_shards`) for every missing method; the clients'
    job then finds every upload in the cache. On a GPU, one process's small kernels leave it mostly
    idle, and cells side by side have shown that processes fill it (seven of them kept an H100
    99-100 % busy), so shards should train a cell's clients in a fraction of the time; that is not
    yet measured. A shard is a ``jobs`` slot like any worker. Each client's upload is the one a
    single process would train (same seed and request; under ``batch_clients`` a shard batches only
    its own clients). A failed shard stops its cell's other jobs from starting.
    """
    from hetfl.config import validate

    if client_jobs > 1 and cache is None:
        raise ValueError("client_jobs needs an upload cache: the shards share their uploads through it")
    cells = [validate(c) for c in cells]  # a finished method is recognised by its validated config
    for line in merge_finished_parts(root, cells):  # workers that ended after their parent was stopped
        say(f"{line} merged (finished in an earlier call)")
    by_name = {c["name"]: c for c in cells}
    plan = _plan(cells, root, client_jobs)
    running: list[_Job] = []
    failed: list[str] = []
    for name in by_name if done is not None else ():
        if name not in plan.later:  # finished before this call
            done(name)
    from hetfl.fl.training import stop_deferred

    with stop_deferred("hetfl reproduce: stopping the workers (each saves its checkpoint first)") as asked:
        try:
            while plan.ready or running:
                while plan.ready and len(running) < jobs and asked() is None:
                    job = plan.ready.pop(0)
                    _start(job, by_name[job.cell], cache, data_root, quiet,
                           threads or worker_threads(os.cpu_count() or 1, jobs, len(running) + 1 + len(plan.ready)))
                    running.append(job)
                    say(f"{job.cell}: {_label(job)} started")
                time.sleep(0.2)
                if asked() is not None:  # this process was sent SIGINT or SIGTERM
                    raise KeyboardInterrupt
                for job in [j for j in running if j.proc is not None and j.proc.poll() is not None]:
                    running.remove(job)
                    _ended(job, plan, running, failed, root, by_name, say, done)
        except KeyboardInterrupt:
            _stop(running)
            raise
    return failed


STOPPED_CODES = (INTERRUPTED, -signal.SIGINT, -signal.SIGTERM)  # a worker that Ctrl-C, SIGINT or SIGTERM stopped


def _ended(job: _Job, plan: _Plan, running: list[_Job], failed: list[str], root: Path,
           by_name: dict[str, dict[str, Any]], say: Callable[[str], None],
           done: Callable[[str], Any] | None) -> None:
    """Account for a worker that has ended: merge it and start what it lets start, or record it as
    failed. A worker stopped by a signal (say ``pkill -TERM -f hetfl.reproduce.worker``, or a deadline's
    SIGTERM that reached the workers first) means the run is being stopped: KeyboardInterrupt, so that
    the caller stops the other workers (they save their checkpoints) and starts no job, instead of
    counting it as failed and starting the next."""
    code = job.proc.returncode if job.proc is not None else None
    minutes = f"({(time.perf_counter() - job.start) / 60:.1f} min)"
    if code in STOPPED_CODES:
        say(f"{job.cell}: {_label(job)} stopped by a signal {minutes}: stopping the other workers")
        raise KeyboardInterrupt
    ok = code == 0
    say(f"{job.cell}: {_label(job)} {'done' if ok else 'FAILED'} {minutes}")
    if not ok:
        failed.append(f"{job.cell}: {_label(job)} ({job.log})")
    _advance(plan, job, ok, root, by_name)
    if done is not None and not _pending(job.cell, plan, running):
        done(job.cell)


def _label(job: _Job) -> str:
    return ",".join(job.methods) if job.clients is None else f"clients {','.join(map(str, job.clients))}"


def _advance(plan: _Plan, job: _Job, ok: bool, root: Path, by_name: dict[str, dict[str, Any]]) -> None:
    """What an ended job lets start: a cell's last shard its clients' job, the clients' job the
    method jobs; a finished method job is merged into its cell. A failed shard or clients' job drops
    the cell's jobs that were to follow it."""
    cell = job.cell
    if job.clients is not None:  # a shard of the cell's clients
        plan.shards[cell] -= 1
        if not ok:
            plan.held.pop(cell, None)
            plan.later.pop(cell, None)
            return
        shutil.rmtree(job.out, ignore_errors=True)  # its uploads are in the cache, its log stays
        plan.shard_minutes[cell] = plan.shard_minutes.get(cell, 0.0) + (time.perf_counter() - job.start) / 60
        if plan.shards[cell] == 0 and cell in plan.held:  # the clients' job may start
            plan.ready.append(plan.held.pop(cell))
        elif plan.shards[cell] == 0:  # a resumed cell: its summary is there, and its methods may start
            add_minutes(root / cell, plan.shard_minutes.pop(cell))
            plan.ready.extend(plan.later.pop(cell, []))  # none after a failed shard
    elif job.out == root / cell:  # the clients' job: the other methods may start now
        rest = plan.later.pop(cell, [])
        plan.ready.extend(rest if ok else [])
        if ok:
            add_minutes(root / cell, plan.shard_minutes.pop(cell, 0.0))
    elif ok:
        _merge_part(by_name[cell], root / cell, job)


def add_minutes(cell_out: Path, minutes: float) -> None:
    """Add ``minutes`` (say, the cell's client shards', which write no summary of their own) to the
    cell's summary, so that its minutes count every process that worked on it."""
    summary_file = cell_out / "summary.json"
    if minutes and summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        summary["minutes"] = summary.get("minutes", 0.0) + minutes
        write_json_atomic(summary_file, summary)


def run_grid_parallel(cells: list[dict[str, Any]], root: Path, cache: Path, data_root: str | None, jobs: int,
                      archive: Callable[[str], Any], write_report: Callable[[], Any], client_jobs: int = 1) -> None:
    """A paper's grid with ``--jobs`` (and ``--client-jobs``): :func:`run_cells_parallel` (archiving
    each cell when it is done), then the results file; raises :class:`hetfl.config.ConfigError` naming
    the failed jobs' logs."""
    from hetfl.config import ConfigError

    failed = run_cells_parallel(cells, root, cache, data_root, jobs, quiet=True,
                                say=lambda line: print(line, flush=True), done=archive, client_jobs=client_jobs)
    write_report()
    if failed:
        raise ConfigError("these jobs failed (see their logs): " + "; ".join(failed))


def _stop(running: list[_Job], grace: float = 2.0, timeout: float = 120.0) -> None:
    """Stop the workers: a terminal's Ctrl-C (or a deadline's signal to the process group) may have
    reached them already, so wait ``grace`` seconds before sending SIGTERM to those still running (a
    second signal could cut a checkpoint short), then up to ``timeout`` for them to write their
    checkpoints. SIGTERM, not SIGINT: a run started in the background by a shell without job control
    (``cmd &``) has SIGINT ignored, and its workers inherit that; every worker saves on SIGTERM as it
    does on SIGINT (:func:`hetfl.fl.training.stop_deferred`)."""
    procs = [j.proc for j in running if j.proc is not None]
    end = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
