"""A Ray node dies in the middle of a grid: its cell is retried on the other node and the grid completes.

    python scripts/ray_node_loss.py [--cells 4] [--rounds 40]

Starts a two-node Ray cluster on this machine (a head and a worker, ``ray start``, one CPU each), runs
``hetfl run`` of ``--cells`` small configs with ``--ray``, and kills the worker node (SIGKILL to every process
of its session, as a machine that loses power) while it runs a cell: when two cells are under way, one on
each node. Prints the driver's output and, per cell, the node that finished it and the rounds its method
ran after the retry; exits non-zero if the grid did not complete. Every process it started is stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from hetfl.engine.flower_local import free_port

CONFIG = {
    "seed": 0, "dataset": "synthetic",
    "data": {"train_per_class": 100, "test_per_class": 20, "size": 16, "classes": 4, "noise": 0.2},
    "partition": {"kind": "iid"}, "clients": 4,
    "client": {"model": "cnn2", "epochs": 2, "batch_size": 16, "lr": 0.05},
    "server": {"model": "cnn2"},
}


def start_node(*args: str) -> subprocess.Popen:
    ray_cli = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    return subprocess.Popen([ray_cli, "start", "--block", "--num-cpus=1", "--node-ip-address=127.0.0.1", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)


def node_ids(address: str) -> tuple[str, list[str]]:
    """The head's node id and the alive nodes' ids."""
    import ray

    ray.init(address=address, log_to_driver=False, configure_logging=False)
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]
        head = next(n["NodeID"] for n in nodes if "node:__internal_head__" in n["Resources"])
        return head, [n["NodeID"] for n in nodes]
    finally:
        ray.shutdown()


def stop(node: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.pid, sig)
    node.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hetfl-node-loss-"))
    paths = []
    for i in range(args.cells):
        cfg = {**CONFIG, "name": f"cell{i}", "seed": i, "methods": {"fedavg": {"rounds": args.rounds}}}
        paths.append(work / f"cell{i}.yaml")
        paths[-1].write_text(yaml.safe_dump(cfg))
    port = free_port()
    head = start_node("--head", f"--port={port}", "--include-dashboard=false",
                      f"--temp-dir={tempfile.mkdtemp(prefix='/tmp/hetfl-ray-')}",
                      f"--ray-client-server-port={free_port()}", "--disable-usage-stats")
    time.sleep(2)
    worker = start_node(f"--address=127.0.0.1:{port}")
    address = f"127.0.0.1:{port}"
    driver = None
    try:
        deadline = time.monotonic() + 90
        while len((ids := node_ids(address))[1]) < 2:
            assert time.monotonic() < deadline, "the cluster did not reach two nodes"
            time.sleep(1)
        head_id = ids[0]
        out = work / "runs"
        hetfl = str(Path(sys.executable).with_name("hetfl"))
        driver = subprocess.Popen([hetfl, "run", *map(str, paths), "--out", str(out), "--no-cache", "--quiet",
                                   "--ray", address], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        start = time.monotonic()
        while True:  # two cells under way (a folder, no summary yet): one on each one-CPU node
            running = [d.name for d in out.glob("cell*") if d.is_dir() and not (d / "summary.json").exists()]
            if len(running) >= 2:
                break
            assert driver.poll() is None and time.monotonic() - start < 300, "no two cells ran at once"
            time.sleep(0.2)
        time.sleep(3)
        print(f"{time.monotonic() - start:.1f} s: cells {sorted(running)} under way; killing the worker node",
              flush=True)
        stop(worker, signal.SIGKILL)
        output, _ = driver.communicate(timeout=900)
        print(output.rstrip())
        finished = []
        for path in paths:
            name = path.stem
            summary_path = out / name / "summary.json"
            if not summary_path.is_file():
                print(f"{name}: not finished")
                continue
            summary = json.loads(summary_path.read_text())
            node = summary["ray"]["node_id"]
            print(f"{name}: finished on the {'head' if node == head_id else 'worker'} node; fedavg "
                  f"{summary['results']['fedavg']['accuracy']:.2f} %")
            finished.append(name)
        print(f"{len(finished)} of {len(paths)} cells finished in {time.monotonic() - start:.1f} s; driver exit "
              f"code {driver.returncode}")
        return 0 if driver.returncode == 0 and len(finished) == len(paths) else 1
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        stop(worker)
        stop(head)


if __name__ == "__main__":
    sys.exit(main())
