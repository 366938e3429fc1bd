"""Where a run stands (``hetfl status RUN_DIR``): per method, the steps logged, the last and best
accuracy, the step its checkpoint holds and the seconds per step so far, read from the files a run
writes as it goes (``<method>/metrics.jsonl``, the checkpoints, ``summary.json`` once it is done).
For a server stage of hours that a stop or a deadline interrupted: what a resume will
redo, and about how long the rest takes.

The pace: rows stamped ``logged_at`` (every row the simulator writes) give each step's wall seconds
(the time between the last rows of consecutive steps). A robust line through the last :data:`RECENT`
steps' seconds (Theil-Sen, never sloping down) prices each step left: DENSE's and Co-Boosting's
epochs grow slower as their pool grows, so the mean pace so far would promise too soon an end. The
medians ignore the gap of a resume or a paused process. Rows without ``logged_at`` fall
back to the mean pace to the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetfl.fl.payload import Payload, PayloadError, jsonl_rows

TOTAL_KEYS = ("epochs", "steps", "rounds")  # what a method's length is called in its params
RECENT = 20  # steps whose wall seconds price the rest


def step_seconds(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """``(step, wall seconds)`` for each step whose previous step was logged just before it, from
    the last ``logged_at`` of each step (rows of steps > 0, in file order)."""
    last: dict[int, float] = {}
    for r in rows:
        if isinstance(r.get("logged_at"), (int, float)):
            last[r["step"]] = float(r["logged_at"])
    return [(s, last[s] - last[s - 1]) for s in sorted(last) if s - 1 in last and last[s] >= last[s - 1]]


def recent_pace(seconds: list[tuple[int, float]], recent: int = RECENT) -> tuple[float, float] | None:
    """``(seconds per step at the last step, growth in seconds per step per step >= 0)``: a
    Theil-Sen line (the median of the pairwise slopes, then the median intercept) through the last
    ``recent`` of :func:`step_seconds`'s pairs, robust to a few outliers (a resume's gap, a paused
    process); None with fewer than 4."""
    import statistics

    tail = seconds[-recent:]
    if len(tail) < 4:
        return None
    slopes = [(tb - ta) / (sb - sa) for i, (sa, ta) in enumerate(tail) for sb, tb in tail[i + 1:]]
    slope = max(0.0, statistics.median(slopes))
    intercept = statistics.median(t - slope * s for s, t in tail)
    return intercept + slope * tail[-1][0], slope


def seconds_left(pace: tuple[float, float], at: int, total: int) -> float:
    """The seconds of steps ``at + 1 .. total`` at ``pace`` (:func:`recent_pace`) measured at step
    ``at``: an arithmetic series."""
    n = max(0, total - at)
    now, slope = pace
    return n * now + slope * n * (n + 1) / 2


def _saved_at(folder: Path) -> tuple[int | None, float | None]:
    """The step the method's checkpoint holds and the seconds per step to it, where it says."""
    info = folder / "checkpoint.json"  # the data-free loop (epoch) and multi-round methods (round)
    if info.is_file():
        try:
            saved = json.loads(info.read_text())
        except json.JSONDecodeError:
            saved = {}
        step = saved.get("epoch", saved.get("round"))
        seconds = saved.get("loop_seconds")
        if isinstance(step, int):
            return step, (seconds / step if seconds and step else None)
    rounds = folder / "checkpoint.safetensors"  # a multi-round method: one file, its metadata says the round
    if rounds.is_file() and not info.is_file():
        try:
            meta = Payload.read_meta(rounds)
        except (OSError, PayloadError, ValueError):
            meta = {}
        if isinstance(meta.get("round"), int):
            seconds = meta.get("seconds")
            return meta["round"], (seconds / meta["round"] if seconds and meta["round"] else None)
    for path in sorted(folder.glob("checkpoint-*.safetensors")):  # stage checkpoints, FedDF, central
        try:
            meta = Payload.read_meta(path)
        except (OSError, PayloadError, ValueError):
            continue
        step = meta.get("done", meta.get("epoch"))
        if isinstance(step, int):
            seconds = meta.get("seconds")
            return step, (seconds / step if seconds and step else None)
    return None, None


def _total(config: dict[str, Any], method: str) -> int | None:
    """The method's length from the run's config, its defaults filled in (None where unknown)."""
    import hetfl.methods  # noqa: F401  (registers the methods)
    from hetfl.fl.method import create_method

    params = (config.get("methods") or {}).get(method)
    if not isinstance(params, dict):
        return None
    try:
        resolved = create_method(method, params).params
    except (ValueError, TypeError):  # an unknown method or settings it refuses
        return None
    for key in TOTAL_KEYS:
        if isinstance(resolved.get(key), int):
            return resolved[key]
    return None


def run_folders(path: Path) -> list[Path]:
    """``path`` when it is a run's folder (it has a ``config.json``), else the run folders under it
    (a reproduction's output: one per cell), sorted; ValueError when there is none."""
    path = Path(path)
    if (path / "config.json").is_file():
        return [path]
    runs = sorted(p.parent for p in path.glob("*/config.json"))
    if not runs:
        raise ValueError(f"{path}: not a run folder (no config.json) and no run folder in it")
    return runs


def run_status(run_dir: Path) -> list[dict[str, Any]]:
    """One row per method of the run's config, in its order (module docstring); ValueError for a folder
    that is not a run's. ``state`` is ``done`` (in ``summary.json``: final and best accuracy from it),
    ``clients k/n`` (its clients are training), ``running`` (its server stage has logged steps) or
    ``pending``. ``seconds_left`` is the time the steps after the checkpoint take: at the recent pace
    and its growth where the rows are stamped, else at the mean pace to the checkpoint (a lower bound
    where steps grow slower, as the data-free loop's do); None for a finished method."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"{run_dir}: not a run folder (no config.json)")
    config = json.loads((run_dir / "config.json").read_text())
    summary = run_dir / "summary.json"
    results = json.loads(summary.read_text()).get("results", {}) if summary.is_file() else {}
    labels = list(config.get("methods") or {})
    labels += [p.parent.name for p in sorted(run_dir.glob("*/metrics.jsonl")) if p.parent.name not in labels]
    return [_method_status(run_dir / label, label, config, results.get(label)) for label in labels]


def _method_status(folder: Path, method: str, config: dict[str, Any], result: dict[str, Any] | None) -> dict[str, Any]:
    metrics = folder / "metrics.jsonl"
    rows = [r for r in jsonl_rows(metrics) if isinstance(r.get("step"), int) and r["step"] > 0] \
        if metrics.is_file() else []
    evals = [(r["step"], float(r["accuracy"])) for r in rows if "accuracy" in r]
    saved, per_step = _saved_at(folder)
    best = max(evals, key=lambda e: e[1]) if evals else None
    logged, total = max((r["step"] for r in rows), default=0), _total(config, method)
    pace = recent_pace(step_seconds(rows))
    left = None
    if total and saved is not None and result is None:
        if pace:  # measured at the last logged step: back to the checkpoint, where a resume starts
            now, growth = pace
            left = seconds_left((now - growth * max(0, logged - saved), growth), saved, total)
        elif per_step:
            left = per_step * max(0, total - saved)
    state = "done" if result is not None else "running" if rows else "pending"
    clients = folder / "clients.json"
    if result is None and not rows and clients.is_file():
        try:
            progress = json.loads(clients.read_text())
            state = f"clients {progress['done']}/{progress['total']}"
        except (ValueError, KeyError):
            pass
    last = result["accuracy"] if result is not None else evals[-1][1] if evals else None
    best_value = result["best_accuracy"] if result is not None else best[1] if best else None
    return {"method": method, "state": state, "finished": result is not None, "logged": logged, "total": total,
            "last": last, "best": best_value, "best_step": best[0] if best else None, "checkpoint": saved,
            "seconds_per_step": pace[0] if pace else per_step, "seconds_left": left}


def status_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of :func:`run_status`'s rows."""
    if not rows:
        return "the config has no methods"
    w = max([14, *(len(r["method"]) for r in rows)])
    header = (f"{'method':<{w}} {'state':<12} {'logged':>11} {'final/last %':>12} {'best % (step)':>15} "
              f"{'checkpoint':>10} {'s/step':>7} {'rest':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        total = r["total"]
        logged = f"{r['logged']}/{total}" if total else str(r["logged"])
        best = "-" if r["best"] is None else f"{r['best']:.2f}" + (f" ({r['best_step']})" if r["best_step"] else "")
        last = f"{r['last']:.2f}" if r["last"] is not None else "-"
        pace = r["seconds_per_step"]
        rest = f"{r['seconds_left'] / 60:.0f} min" if r.get("seconds_left") is not None else "-"
        lines.append(f"{r['method']:<{w}} {r['state']:<12} {logged:>11} "
                     f"{last:>12} {best:>15} {r['checkpoint'] if r['checkpoint'] is not None else '-':>10} "
                     f"{f'{pace:.1f}' if pace else '-':>7} {rest:>8}")
    return "\n".join(lines)
