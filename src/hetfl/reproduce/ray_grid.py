"""Grids of cells as Ray tasks: ``hetfl reproduce PAPER --ray [ADDRESS]`` and ``hetfl run CONFIG... --ray``.

Each unfinished cell is one Ray task (``num_cpus`` = its torch threads, one GPU with ``--device cuda``) that
runs the same :func:`~hetfl.reproduce.runner.run_cell` as ``--jobs``. Ray places the tasks on the cluster's
nodes; nothing here schedules or opens a socket.

Where a task writes: the driver leaves a marker file in the runs folder; a node that sees it shares the
folder (one machine, NFS) and runs the cell in place, so a retried cell resumes from its checkpoints. A
node that does not see it runs the cell in a temporary folder (seeded with the cell's summary so far) and
returns the folder's files (summary, metrics, communication, partition, figures; models and checkpoints
only with ``keep_models``), which the driver writes under the runs folder as each cell arrives.

A cell whose worker or node dies is retried once by Ray (``max_retries=1``) and reported as failed after
that; an error in the cell itself (a missing dataset on a node) is not retried and reaches the driver with
its message. Ctrl-C cancels the outstanding tasks; a local Ray instance this process started is stopped.
Every node needs hetfl installed and the datasets under the same ``data_root``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

RAY_EXTRA = "pip install 'hetfl[ray]'"
MODEL_SUFFIXES = (".safetensors",)  # models and checkpoints: returned only with keep_models


def require_ray(option: str = "--ray") -> Any:
    """The ``ray`` module, or a clear error naming the extra to install."""
    try:
        import ray
    except ImportError as err:
        raise ValueError(f"{option} needs Ray: install the extra with {RAY_EXTRA}") from err
    return ray


def connect(ray: Any, address: str | None, num_cpus: int) -> bool:
    """Join the cluster at ``address`` (``auto``: the one running on this machine, found by Ray; ``local``: none,
    a new instance); without a cluster, start a local instance with ``num_cpus`` CPUs. Returns whether this
    process started it."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    quiet = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if address == "local":  # a new instance of our own, even where a cluster runs on this machine
        ray.init(address="local", num_cpus=num_cpus, **quiet)
        return True
    if address and address != "auto":
        ray.init(address=address, **{k: v for k, v in quiet.items() if k != "include_dashboard"})
        return False
    try:
        ray.init(address="auto", log_to_driver=False, configure_logging=False)
        return False
    except ConnectionError:
        ray.init(address="local", num_cpus=num_cpus, **quiet)
        return True


def node_info() -> dict[str, str]:
    """Which node runs this task (recorded in the cell's summary)."""
    import ray

    if not ray.is_initialized():  # called outside a task (tests)
        return {"node_id": "", "node_ip": "", "hostname": socket.gethostname()}
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname()}


def folder_files(folder: Path, keep_models: bool) -> dict[str, bytes]:
    """A finished cell's files by relative path; models and checkpoints only with ``keep_models``."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and (keep_models or not p.name.endswith(MODEL_SUFFIXES)) and not p.name.endswith(".tmp")}


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    """The driver's copy of a cell a node ran in its own folder (each file written atomically)."""
    for rel, data in files.items():
        path = folder / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"a cell's file {rel!r} leaves its folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)


def cell_task(cfg: dict[str, Any], root: str, marker: str, prior: str | None, cache: str | None,
              data_root: str | None, device: str | None, threads: int, keep_models: bool) -> dict[str, Any]:
    """One cell on whichever node Ray chose: in the shared runs folder when this node sees ``marker``
    there, else in a temporary folder whose files come back to the driver."""
    from hetfl.reproduce.runner import run_cell, write_summary

    node = node_info()
    shared = (Path(root) / marker).is_file()
    base = Path(root) if shared else Path(tempfile.mkdtemp(prefix="hetfl-cell-"))
    try:
        if not shared and prior:  # the methods the cell has finished already are not run again
            (base / cfg["name"]).mkdir(parents=True)
            (base / cfg["name"] / "summary.json").write_text(prior)
        run_cell(cfg, base, Path(cache) if cache else None, data_root, device, threads, True)
        folder = base / cfg["name"]
        summary = json.loads((folder / "summary.json").read_text())
        summary["ray"] = node
        write_summary(folder / "summary.json", summary)
        return {"name": cfg["name"], "node": node, "files": {} if shared else folder_files(folder, keep_models)}
    finally:
        if not shared:
            shutil.rmtree(base, ignore_errors=True)


def _reason(err: BaseException) -> str:
    """One line for a failed cell: the cell's own error, or what Ray says happened to its worker."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


def run_grid_on_ray(cells: list[dict[str, Any]], root: Path, cache: Path | None, data_root: str | None,
                    device: str | None, address: str | None, cell_cpus: int = 1, keep_models: bool = False,
                    after: Callable[[], None] | None = None, log: Callable[[str], None] = print) -> list[str]:
    """Run the cells as Ray tasks; write each finished cell under ``root`` as it arrives and call ``after``.
    Returns the names of the cells that failed."""
    from hetfl.reproduce.runner import usable_cpus

    ray = require_ray()
    if cell_cpus < 1:
        raise ValueError(f"--cell-cpus must be at least 1, got {cell_cpus}")
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    log(f"{len(cells)} cell(s) to run on Ray, {cell_cpus} CPU(s) each")
    if not cells:
        return []
    started = connect(ray, address, max(usable_cpus(), cell_cpus))
    resources = ray.cluster_resources()
    log(f"Ray: {'a local instance' if started else 'cluster ' + str(address or 'auto')}, "
        f"{len(ray.nodes())} node(s), {resources.get('CPU', 0):g} CPU(s), {resources.get('GPU', 0):g} GPU(s)")
    marker = f".hetfl-ray-{uuid.uuid4().hex}"
    (root / marker).write_text("runs in this folder are shared with the Ray nodes that see this file\n")
    gpus = 1 if device and device.startswith("cuda") else 0
    task = ray.remote(cell_task).options(num_cpus=cell_cpus, num_gpus=gpus, max_retries=1, retry_exceptions=False,
                                         scheduling_strategy="SPREAD")  # cells over the nodes, not packed
    cache_arg = str(cache.resolve()) if cache else None
    refs: dict[Any, str] = {}
    for cfg in cells:
        # paths as this machine resolves them: a worker's own working folder is not the driver's
        data_arg = str(Path(data_root or cfg.get("data_root") or "data").expanduser().resolve())
        if isinstance(cfg.get("dataset"), dict) and "path" in cfg["dataset"]:
            path = str(Path(cfg["dataset"]["path"]).expanduser().resolve())
            cfg = {**cfg, "dataset": {**cfg["dataset"], "path": path}}
        prior = root / cfg["name"] / "summary.json"
        refs[task.remote(cfg, str(root), marker, prior.read_text() if prior.is_file() else None, cache_arg, data_arg,
                         device, cell_cpus, keep_models)] = cfg["name"]
    failed: list[str] = []
    pending = list(refs)
    try:
        done = 0
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                done += 1
                name = refs[ref]
                try:
                    result = ray.get(ref)
                except Exception as err:  # one cell's failure must not stop the grid: report it at the end
                    failed.append(name)
                    log(f"[{done}/{len(refs)}] {name} failed: {_reason(err)}")
                    continue
                if result["files"]:
                    write_files(root / name, result["files"])
                node = result["node"]
                log(f"[{done}/{len(refs)}] {name} finished on node {node['node_id'][:8]} ({node['hostname']})")
                if after:
                    after()
    except KeyboardInterrupt:
        for ref in pending:
            ray.cancel(ref, force=True)
        log(f"cancelled {len(pending)} cell(s) still running or queued")
        raise
    finally:
        (root / marker).unlink(missing_ok=True)
        ray.shutdown()
    return failed
