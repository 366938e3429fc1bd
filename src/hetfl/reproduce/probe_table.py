"""The table of :mod:`hetfl.reproduce.filter_probe`'s results in FedMHO's report: what the K-means
filter keeps and drops, per (dataset, setting). Torch-free, like the report that reads it."""

from __future__ import annotations

import json
import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROBE_FIELDS = ("agreement", "entropy", "distance", "minority")


def probe_file(archive: Path, budget: str) -> Path:
    """Where the probes of one budget's cells are kept: beside the archived cells (not a cell: its
    name does not start with the paper's prefix)."""
    return archive / f"filter-probe-{budget}.json"


def mean_rows(probes: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per group (all, kept, dropped): each field's mean over the probes that have it."""
    out: dict[str, dict[str, float | None]] = {}
    for group in ("all", "kept", "dropped"):
        out[group] = {}
        for name in PROBE_FIELDS:
            values = [p[group][name] for p in probes if p[group][name] is not None]
            out[group][name] = statistics.fmean(values) if values else None
    return out


PROBE_INTRO = """What the filter drops, measured (`hetfl reproduce fedmho --filter-probe`): each Table 4 cell's
uploads from the upload cache, the {generated:,} samples `{method}` decodes from them (its own draw), split
by the filter at R_th = {r_th} into kept and dropped. "Recognised": % that a reference classifier trained
on the real training split ({references}) labels as their class (the paper's reason for the filter is
label confusion, Sec. 4.4: a sample decoded for one label that shows another class); "entropy": its mean softmax entropy
(nats); "spread": mean pixel distance to the class's mean (real training images: {spreads}); "other
decoders": % drawn by a decoder other than the class's main one. Means over the seeds probed (n)."""


def probe_lines(path: Path, datasets: Sequence[str] = ()) -> list[str]:
    """Markdown for the probes in ``path`` (:func:`run_probes`): one row per (dataset, setting) with
    the kept and the dropped samples side by side, the datasets in the order of ``datasets`` (others
    after them, by name); [] without the file."""
    if not path.is_file():
        return []
    saved = json.loads(path.read_text())
    probes, refs = saved["probes"], saved["reference"]
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in probes:
        rows.setdefault((p["dataset"], p["setting"]), []).append(p)
    references = "; ".join(f"{d.upper()}: {r['arch']}, {r['epochs']} epochs, {r['test_accuracy']:.2f} % on test"
                           for d, r in sorted(refs.items()))
    spreads = ", ".join(f"{d.upper()} {r['real_distance']:.2f}" for d, r in sorted(refs.items())
                        if "real_distance" in r)
    r_th = sorted({p["r_th"] for p in probes})
    lines = ["", f"#### What the filter drops ({saved['method']}'s synthetic set)", "",
             textwrap.fill(" ".join(PROBE_INTRO.format(
                 r_th=", ".join(f"{r:g}" for r in r_th), method=saved["method"],
                 generated=max(p["all"]["n"] for p in probes), references=references,
                 spreads=spreads or "not measured").split()), 104), "",
             "| dataset | setting | n | recognised % all / kept / dropped | entropy kept / dropped | "
             "spread kept / dropped | other decoders % kept / dropped |", "|---|---|---|---|---|---|---|"]
    rank = {d: i for i, d in enumerate(datasets)}
    for (dataset, setting), group in sorted(rows.items(), key=lambda kv: (rank.get(kv[0][0], len(rank)), kv[0][0],
                                                                         _order(kv[0][1]))):
        m = mean_rows(group)

        def pair(name: str, digits: int, m: dict = m) -> str:
            return " / ".join("-" if m[g][name] is None else f"{m[g][name]:.{digits}f}" for g in ("kept", "dropped"))

        lines.append(f"| {dataset.upper()} | Dir({setting}) | {len(group)} | {m['all']['agreement']:.2f} / "
                     f"{pair('agreement', 2)} | {pair('entropy', 3)} | {pair('distance', 2)} | {pair('minority', 1)} |")
    return lines


def _order(setting: str) -> tuple[int, float, str]:
    """Dirichlet settings from the mildest (largest alpha) down, then any other partition by name."""
    try:
        return (0, -float(setting), "")
    except ValueError:
        return (1, 0.0, setting)
