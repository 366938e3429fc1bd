"""Helpers shared by the paper reproductions: resumable cells, cell summaries, mean ± sd."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def cell_summaries(root: Path, prefix: str) -> list[dict[str, Any]]:
    """The finished cells ``root/<prefix>-*/summary.json``, sorted by name."""
    return [json.loads(p.read_text()) for p in sorted(root.glob(f"{prefix}-*/summary.json"))]


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
