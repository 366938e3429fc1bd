"""`hetfl reproduce <paper>`: run a paper's grid of cells and write its results page.

A cell is one simulator run; a finished cell (its summary has every method asked for) is skipped and a
cell that stopped part-way resumes (each method from its own checkpoint), so the command can be
stopped and started again. ``--jobs N`` runs N cells at once, each with its share of the CPU threads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from hetfl.config import ConfigError
from hetfl.reproduce.paper import Paper, grid, load_paper
from hetfl.reproduce.report import ARCHIVE_SUFFIX, condense, merge_cell, missing_methods, runs_cells, write_results


def _choices(option: str, text: str | None, valid: list[str]) -> list[str]:
    if not text:
        return list(valid)
    chosen = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in valid]
    if unknown:
        raise ConfigError(f"{option}: unknown {unknown}; choose from: {', '.join(valid)}")
    return chosen


def _seeds(text: str | None, default: list[int]) -> list[int]:
    if not text:
        return list(default)
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise ConfigError(f"--seeds: expected integers such as 0,1,2, got {text!r}") from err


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write a cell's summary.json atomically (a stop mid-write never leaves half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, path)


def drop_results(out: Path, methods: list[str]) -> list[str]:
    """Forget the finished results of ``methods`` in the cell at ``out`` so that the grid runs them again
    (``--rerun``, e.g. after a fix to one method): their results leave summary.json, its minutes lose
    their seconds, and their folders go. A method with no result yet is left alone, so a stopped rerun
    resumes from its checkpoint. Returns the methods dropped."""
    path = out / "summary.json"
    if not path.is_file():
        return []
    summary = json.loads(path.read_text())
    dropped = [m for m in methods if m in summary.get("results", {})]
    if not dropped:
        return []
    seconds = sum(float(summary["results"].pop(m).get("seconds", 0.0)) for m in dropped)
    if "minutes" in summary:
        summary["minutes"] = max(0.0, summary["minutes"] - seconds / 60)
    write_summary(path, summary)
    for m in dropped:
        shutil.rmtree(out / m, ignore_errors=True)
    return dropped


def finished(out: Path, methods: list[str]) -> dict[str, Any] | None:
    """The cell's summary if it has a result for every one of ``methods``."""
    path = out / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    return None if missing_methods(summary, methods) else summary


def run_cell(cfg: dict[str, Any], root: Path, cache: Path | None, data_root: str | None, device: str | None,
             threads: int, quiet: bool) -> str:
    """Run the cell's methods that have no result yet into ``root/<name>``; merge them into its summary."""
    import torch

    from hetfl.engine.simulator import Simulator, prepare
    from hetfl.methods.checks import validate

    torch.set_num_threads(threads)
    out = root / cfg["name"]
    path = out / "summary.json"
    prior = json.loads(path.read_text()) if path.is_file() else {}
    done = prior.get("results", {})
    todo = {m: p for m, p in cfg["methods"].items() if m not in done}
    if not todo:
        return cfg["name"]
    if device:
        cfg = {**cfg, "device": device}
    start = time.perf_counter()
    sim = Simulator(prepare(validate({**cfg, "methods": todo}), data_root), out, cache, quiet=quiet)
    # a stop before the cell ends leaves every finished method and the minutes so far in summary.json
    # (written after every method, so a stop in a later one loses none of them)
    sim.prior_results, sim.prior_minutes = done, prior.get("minutes", 0.0)
    sim.prior_methods = prior.get("config", {}).get("methods", {})
    summary = sim.run()
    summary["minutes"] = prior.get("minutes", 0.0) + (time.perf_counter() - start) / 60
    write_summary(path, summary)
    return cfg["name"]


def usable_cpus() -> int:
    """The CPUs this process may run on (``taskset``, container limits), not all the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def run_grid(cells: list[dict[str, Any]], root: Path, cache: Path | None, data_root: str | None,
             device: str | None, jobs: int, quiet: bool, after: Any = None) -> list[str]:
    """Run the unfinished cells, ``jobs`` at a time; returns the names of the cells that failed."""
    todo = [c for c in cells if finished(root / c["name"], list(c["methods"])) is None]
    print(f"{len(cells) - len(todo)} of {len(cells)} cells finished; {len(todo)} to run", flush=True)
    failed: list[str] = []
    if jobs == 1:
        for i, cfg in enumerate(todo, 1):
            print(f"[{i}/{len(todo)}] {cfg['name']}", flush=True)
            run_cell(cfg, root, cache, data_root, device, usable_cpus(), quiet)
            if after:
                after()
        return failed
    threads = max(1, usable_cpus() // jobs)
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(run_cell, cfg, root, cache, data_root, device, threads, True): cfg["name"]
                   for cfg in todo}
        for i, future in enumerate(as_completed(futures), 1):
            name = futures[future]
            try:
                future.result()
                print(f"[{i}/{len(todo)}] {name} finished", flush=True)
            except Exception as err:  # one cell's failure must not stop the grid: report it at the end
                failed.append(name)
                print(f"[{i}/{len(todo)}] {name} failed: {err}", flush=True)
            if after:
                after()
    return failed


def save_archive(paper: Paper, root: Path, archive: Path) -> int:
    """Add the finished cells of the runs folder (a result for every method of their config) to the
    archived results (condensed, no models). A cell still running or stopped is left out, but for one the
    archive already holds whole: its finished methods replace the archived ones (a stopped re-run), the
    others stay as archived, so the archived cell stays whole."""
    saved = json.loads(archive.read_text()) if archive.is_file() else {}
    done, unfinished = runs_cells(root)
    for name, missing in unfinished.items():
        summary = json.loads((root / name / "summary.json").read_text())
        if name in saved and set(missing) <= set(saved[name]["results"]) and summary["results"]:
            done[name] = summary
            print(f"{name}: archived {', '.join(summary['results'])}; {', '.join(missing)} stay as archived")
        else:
            print(f"not archived: {name} has no result yet for {', '.join(missing)}")
    front = paper.spec.get("report") == "frontier"  # a frontier page draws each method's points
    for name, summary in done.items():
        saved[name] = merge_cell(saved.get(name), condense(summary, root / name, front))
        for label, figure in paper.spec.get("cell_figures", {}).items():  # e.g. HFLDD's clusters.png
            source = root / name / label / figure
            if source.is_file():
                shutil.copyfile(source, archive.with_name(f"{name}-{Path(figure).stem}.png"))
    archive.write_text(json.dumps(dict(sorted(saved.items())), indent=1, sort_keys=True) + "\n")
    return len(done)


def main(args: argparse.Namespace) -> int:
    paper = load_paper(args.paper)
    budget = "ablation" if getattr(args, "ablation", False) else (args.budget or paper.default_budget)
    if budget not in paper.budgets:
        raise ConfigError(f"--budget: unknown {budget!r}; choose from: {', '.join(paper.budgets)}")
    ray_address = getattr(args, "ray", None)
    if ray_address is not None:
        from hetfl.reproduce.ray_grid import require_ray

        require_ray()
        if args.jobs != 1:
            raise ConfigError("--jobs and --ray: choose one (with --ray, Ray places one cell per --cell-cpus CPUs)")
    if args.jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {args.jobs}")
    root = Path(args.out or f"runs/reproduce-{paper.name}")
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--out {root}: a file of that name exists; give a folder")
    results = Path(args.results or f"docs/results/{paper.name}.md")
    archive = results.with_name(results.stem + ARCHIVE_SUFFIX)
    if not args.report_only:
        cells = grid(paper, budget,
                     _choices("--datasets", args.datasets, list(paper.datasets)) if args.datasets
                     else paper.budget_grid(budget, "datasets"),
                     _choices("--settings", args.settings, list(paper.settings)) if args.settings
                     else paper.budget_grid(budget, "settings"),
                     _seeds(args.seeds, paper.budget_grid(budget, "seeds")),
                     _choices("--methods", args.methods, paper.budget_methods(budget)) if args.methods else None)
        if getattr(args, "rerun", None):
            again = _choices("--rerun", args.rerun, sorted({m for c in cells for m in c["methods"]}))
            for cell in cells:
                if dropped := drop_results(root / cell["name"], [m for m in again if m in cell["methods"]]):
                    print(f"{cell['name']}: running {', '.join(dropped)} again")
        cache = None if args.no_cache else Path(args.cache_dir)
        rewrite = lambda: write_results(paper, root, results, archive)  # noqa: E731
        if ray_address is not None:
            from hetfl.reproduce.ray_grid import run_grid_on_ray

            todo = [c for c in cells if finished(root / c["name"], list(c["methods"])) is None]
            print(f"{len(cells) - len(todo)} of {len(cells)} cells finished; {len(todo)} to run", flush=True)
            failed = run_grid_on_ray(todo, root, cache, args.data_root, args.device, ray_address, args.cell_cpus,
                                     args.keep_models, after=rewrite)
        else:
            failed = run_grid(cells, root, cache, args.data_root, args.device, args.jobs, args.quiet, after=rewrite)
        if failed:
            print(f"failed cells (run the command again to retry): {', '.join(failed)}")
    if args.save:
        print(f"archived {save_archive(paper, root, archive)} cells into {archive}")
    write_results(paper, root, results, archive)
    print(f"wrote {results}")
    if unfinished := runs_cells(root)[1]:
        print(f"left off the page until they finish: {', '.join(unfinished)}")
    return 0


def add_ray_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--ray [ADDRESS]``, ``--cell-cpus`` and ``--keep-models``: each ``what`` (a cell, a config) one Ray task."""
    parser.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                        help=f"run each {what} as a Ray task on the cluster at ADDRESS (default auto: the running "
                             "cluster, else a local instance; local: always a new one); needs hetfl[ray]")
    parser.add_argument("--cell-cpus", type=int, default=1, help=f"with --ray: CPUs (torch threads) per {what}")
    parser.add_argument("--keep-models", action="store_true",
                        help="with --ray: bring the models back from nodes that do not share the runs folder")


def add_arguments(rep: argparse.ArgumentParser) -> None:
    from hetfl.reproduce.paper import paper_names

    rep.add_argument("paper", choices=paper_names())
    rep.add_argument("--budget", default=None, help="a budget of the paper's YAML (default: its default_budget)")
    rep.add_argument("--datasets", default=None, help="comma-separated (default: all of the paper's)")
    rep.add_argument("--settings", default=None, help="comma-separated, e.g. 0.5,0.1,2c/c (default: all)")
    rep.add_argument("--seeds", default=None, help="comma-separated (default: the paper's seeds)")
    rep.add_argument("--methods", default=None, help="comma-separated labels (default: the budget's methods)")
    rep.add_argument("--ablation", action="store_true", help="the paper's ablation budget (where it has one)")
    rep.add_argument("--rerun", default=None,
                     help="comma-separated labels: run these methods of the chosen cells again even where "
                          "finished (their old results and minutes are dropped)")
    rep.add_argument("--jobs", type=int, default=1, help="cells run at once (each gets cpus/jobs threads)")
    add_ray_arguments(rep, "cell")
    rep.add_argument("--report-only", action="store_true", help="only rewrite the results page")
    rep.add_argument("--save", action="store_true",
                     help="add the finished cells to the archived results beside the results page")
    rep.add_argument("--out", default=None, help="runs folder (default: runs/reproduce-<paper>)")
    rep.add_argument("--results", default=None, help="results page (default: docs/results/<paper>.md)")
    rep.add_argument("--data-root", default=None)
    rep.add_argument("--device", default=None, help="cpu, cuda, ... (default: auto)")
    rep.add_argument("--cache-dir", default=os.environ.get("HETFL_CACHE", "cache/uploads"))
    rep.add_argument("--no-cache", action="store_true", help="always retrain the clients")
    rep.add_argument("--quiet", action="store_true")
