"""``hetfl flower sim``: hetfl's ServerApp and ClientApp through Flower's simulation runtime on Ray.

The apps are those of ``hetfl flower local`` (:mod:`hetfl.engine.flower_app`); ``run_simulation`` makes
one virtual SuperNode per client (``partition-id`` = the client id) and runs the messages of a round on
a pool of Ray actors, ``client_cpus`` (and ``client_gpus``) each, so the sampled clients of a round train
in parallel. A virtual node's ``context.state`` lives in the driver between its calls, so client state
(MOON's previous model, FedCOG's) behaves as on the deployment runtime; the ServerApp runs in this process.

``address=None`` starts a local Ray instance with ``workers * client_cpus`` CPUs; an address (``auto``
or ``HOST:PORT``) joins a running cluster, whose every node must have hetfl installed and the dataset
under the same ``data_root``. Flower starts and stops Ray (``ray.shutdown`` at the end of the run).

This module imports ``flwr`` and, when called, ``ray``: install the extra ``hetfl[ray]``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

RAY_EXTRA = "pip install 'hetfl[ray]'"
POLL = 0.02  # s between the ServerApp's pulls for replies: in-memory here, not a network round trip


def require_ray(option: str) -> None:
    """Fail with the extra to install when Ray is missing (before anything starts)."""
    if importlib.util.find_spec("ray") is None:
        raise ValueError(f"{option} needs Ray: install the extra with {RAY_EXTRA}")


def backend_config(workers: int, address: str | None, client_cpus: float, client_gpus: float) -> dict[str, Any]:
    """Flower's Ray backend settings: each ClientApp actor's resources and ``ray.init``'s arguments."""
    if address:
        init: dict[str, Any] = {"address": address}
    else:
        init = {"address": "local", "num_cpus": max(1, math.ceil(workers * client_cpus)),  # "local": a new
                "num_gpus": math.ceil(workers * client_gpus)}  # instance, even where a cluster runs
    init.update(include_dashboard=False, log_to_driver=False, configure_logging=False)
    return {"client_resources": {"num_cpus": client_cpus, "num_gpus": client_gpus}, "init_args": init}


def run_sim(cfg: dict[str, Any], out_dir: Path, *, data_root: str | None = None, workers: int = 2,
            address: str | None = None, client_cpus: float = 1.0, client_gpus: float = 0.0,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``cfg`` with ``cfg['clients']`` virtual SuperNodes; return the ServerApp's ``summary.json``."""
    from hetfl.engine.flower_local import remote_refusals

    require_ray("hetfl flower sim")
    if workers < 1 or client_cpus <= 0 or client_gpus < 0:
        raise ValueError(f"--workers {workers}, --client-cpus {client_cpus}, --client-gpus {client_gpus}: "
                         "need at least one worker and a positive CPU share")
    refused = remote_refusals(cfg)
    if refused:
        raise ValueError(f"methods {refused} read the clients' raw data on the server, which only the "
                         "in-process simulator (hetfl run) has; leave them out (--methods) to run on Flower")
    for key, value in {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                       "RAY_USAGE_STATS_ENABLED": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}.items():
        os.environ.setdefault(key, value)
    from flwr.simulation import run_simulation

    from hetfl.engine.flower_app import simulation_apps

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").unlink(missing_ok=True)
    root = str(Path(data_root or cfg["data_root"]).expanduser().resolve())  # the same path on every node
    if isinstance(cfg["dataset"], dict):
        cfg = {**cfg, "dataset": {**cfg["dataset"], "path": str(Path(cfg["dataset"]["path"]).expanduser().resolve())}}
    run_config = {"hetfl-config": json.dumps({**cfg, "data_root": root}), "out-dir": str(out_dir.resolve()),
                  "data-root": root, "poll": POLL}
    server, client = simulation_apps(run_config, threads=max(1, int(client_cpus)))
    where = f"the Ray cluster at {address}" if address else f"a local Ray instance, {workers} worker(s)"
    log(f"hetfl flower sim: {cfg['clients']} virtual SuperNodes on {where}, {client_cpus:g} CPU(s)"
        f"{f' and {client_gpus:g} GPU(s)' if client_gpus else ''} per ClientApp")
    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower's per-round INFO lines; hetfl's own stay
    run_simulation(server_app=server, client_app=client, num_supernodes=int(cfg["clients"]), backend_name="ray",
                   backend_config=backend_config(workers, address, client_cpus, client_gpus))
    path = out_dir / "summary.json"
    if not path.is_file():
        raise RuntimeError(f"the simulation ended without {path}; see the log above")
    summary = json.loads(path.read_text())
    summary.setdefault("engine", {}).update(runtime="simulation", backend="ray", workers=None if address else workers,
                                            address=address, client_cpus=client_cpus, client_gpus=client_gpus)
    path.write_text(json.dumps(summary, indent=1))
    return summary
