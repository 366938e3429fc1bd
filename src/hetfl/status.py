"""Where a run stands (``hetfl status RUN_DIR``): per method, the steps logged, the last and best
accuracy, the step its checkpoint holds and the seconds per step so far, read from the files a run
writes as it goes (``<method>/metrics.jsonl``, the checkpoints, ``summary.json`` once it is done).
For a server stage of hours that a session's end or a device deadline stopped: what a resume will
redo, and about how long the rest takes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetfl.fl.payload import Payload, PayloadError, jsonl_rows

TOTAL_KEYS = ("epochs", "steps", "rounds")  # what a method's length is called in its params


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
    """One row per method folder with a ``metrics.jsonl`` (module docstring); ValueError for a folder
    that is not a run's."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"{run_dir}: not a run folder (no config.json)")
    config = json.loads((run_dir / "config.json").read_text())
    summary = run_dir / "summary.json"
    finished = set(json.loads(summary.read_text()).get("results", {})) if summary.is_file() else set()
    out = []
    for metrics in sorted(run_dir.glob("*/metrics.jsonl")):
        folder, method = metrics.parent, metrics.parent.name
        rows = [r for r in jsonl_rows(metrics) if isinstance(r.get("step"), int) and r["step"] > 0]
        evals = [(r["step"], float(r["accuracy"])) for r in rows if "accuracy" in r]
        saved, per_step = _saved_at(folder)
        best = max(evals, key=lambda e: e[1]) if evals else None
        out.append({"method": method, "finished": method in finished,
                    "logged": max((r["step"] for r in rows), default=0), "total": _total(config, method),
                    "last": evals[-1][1] if evals else None, "best": best[1] if best else None,
                    "best_step": best[0] if best else None, "checkpoint": saved, "seconds_per_step": per_step})
    return out


def status_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of :func:`run_status`'s rows, with the time the rest takes at the mean pace
    to the checkpoint (a lower bound where steps grow slower, as the data-free loop's do)."""
    if not rows:
        return "no method has logged a step yet"
    w = max([14, *(len(r["method"]) for r in rows)])
    header = (f"{'method':<{w}} {'state':<12} {'logged':>11} {'last %':>7} {'best % (step)':>15} "
              f"{'checkpoint':>10} {'s/step':>7} {'rest':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        total = r["total"]
        logged = f"{r['logged']}/{total}" if total else str(r["logged"])
        best = f"{r['best']:.2f} ({r['best_step']})" if r["best"] is not None else "-"
        last = f"{r['last']:.2f}" if r["last"] is not None else "-"
        pace = r["seconds_per_step"]
        rest = "-"
        if pace and total and r["checkpoint"] is not None and not r["finished"]:
            rest = f"{pace * (total - r['checkpoint']) / 60:.0f} min"
        lines.append(f"{r['method']:<{w}} {'finished' if r['finished'] else 'not finished':<12} {logged:>11} "
                     f"{last:>7} {best:>15} {r['checkpoint'] if r['checkpoint'] is not None else '-':>10} "
                     f"{f'{pace:.1f}' if pace else '-':>7} {rest:>8}")
    return "\n".join(lines)
