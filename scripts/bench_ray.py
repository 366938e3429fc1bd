"""Ray benchmarks: grids of cells on a two-node cluster, and a round's clients on Ray workers.

    python scripts/bench_ray.py grid [--seeds 8]     # --ray on two one-CPU nodes against --jobs 2
    python scripts/bench_ray.py sim [--rounds 5]     # hetfl flower sim (2 workers) against hetfl run (1, 2 threads)

``grid``: starts a head and a worker node (``ray start``, one CPU each) on this machine, runs
``hetfl reproduce kdia --budget smoke`` over ``--seeds`` cells once with ``--jobs 2`` and once with
``--ray ADDRESS``, and prints the wall seconds, cells per hour and their ratio, the nodes that ran cells
and whether the two results pages are equal (measured times blanked).

``sim``: FedAvg and MOON on MNIST, 100 clients, 10 sampled per round, ``--rounds`` rounds: ``hetfl run``
at 1 and at 2 torch threads, and ``hetfl flower sim --workers 1`` and ``--workers 2`` (one CPU each). Prints
seconds per round (the server's evaluations between consecutive rounds, round 1 excluded: it pays for process
and data start) and the command's wall seconds.
"""

from __future__ import annotations

import argparse
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

BIN = Path(sys.executable).parent


def start_node(*args: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    return subprocess.Popen([str(BIN / "ray"), "start", "--block", "--num-cpus=1", "--node-ip-address=127.0.0.1",
                             *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=env)


def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, **(env or {})})
    return time.perf_counter() - start


def bench_grid(seeds: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.test_ray import wait_for_nodes, without_timings

    work = Path(tempfile.mkdtemp(prefix="hetfl-bench-ray-"))
    grid = [str(BIN / "hetfl"), "reproduce", "kdia", "--budget", "smoke", "--seeds",
            ",".join(map(str, range(seeds))), "--no-cache", "--quiet"]
    local = timed([*grid, "--jobs", "2", "--out", str(work / "jobs"), "--results", str(work / "jobs.md")])
    port = free_port()
    nodes = [start_node("--head", f"--port={port}", "--include-dashboard=false",
                        f"--temp-dir={tempfile.mkdtemp(prefix='/tmp/hetfl-ray-')}",
                        f"--ray-client-server-port={free_port()}", "--disable-usage-stats")]
    try:
        time.sleep(2)
        nodes.append(start_node(f"--address=127.0.0.1:{port}"))
        wait_for_nodes(f"127.0.0.1:{port}", 2)
        on_ray = timed([*grid, "--ray", f"127.0.0.1:{port}", "--out", str(work / "ray"),
                        "--results", str(work / "ray.md")])
    finally:
        for node in nodes:
            os.killpg(node.pid, signal.SIGTERM)
            node.wait(60)
    ran_on = {json.loads(p.read_text())["ray"]["node_id"][:8] for p in (work / "ray").glob("*/summary.json")}
    same = without_timings((work / "jobs.md").read_text()) == without_timings((work / "ray.md").read_text())
    print(f"{seeds} cells: --jobs 2 {local:.1f} s ({3600 * seeds / local:.0f} cells/h); --ray on 2 one-CPU nodes "
          f"{on_ray:.1f} s ({3600 * seeds / on_ray:.0f} cells/h); ratio {local / on_ray:.2f}; nodes used "
          f"{len(ran_on)} {sorted(ran_on)}; pages equal (times blanked): {same}")


SIM_CONFIG = {
    "name": "bench-sim", "seed": 0, "dataset": "mnist",
    "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 10}, "clients": 100,
    "client": {"model": "simplecnn", "epochs": 2, "batch_size": 64, "lr": 0.01, "momentum": 0.9},
    "server": {"model": "simplecnn"},
}


def round_seconds(folder: Path, method: str) -> tuple[float, float]:
    """Mean seconds between consecutive evaluated rounds (round 2 on) and the method's seconds."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    times = [r["logged_at"] for r in rows if r.get("method") == method and r.get("step", -1) >= 1]
    summary = json.loads((folder / "summary.json").read_text())
    return (times[-1] - times[0]) / (len(times) - 1), float(summary["results"][method]["seconds"])


def bench_sim(rounds: int, data_root: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="hetfl-bench-sim-"))
    cfg = {**SIM_CONFIG, "methods": {m: {"rounds": rounds, "sample_ratio": 0.1} for m in ("fedavg", "moon")}}
    path = work / "sim.yaml"
    path.write_text(yaml.safe_dump(cfg))
    common = [str(path), "--data-root", data_root, "--quiet"]
    runs = {
        "hetfl run, 1 thread": ([str(BIN / "hetfl"), "run", *common, "--no-cache", "--out", str(work / "t1")],
                                {"OMP_NUM_THREADS": "1"}, work / "t1"),
        "hetfl run, 2 threads": ([str(BIN / "hetfl"), "run", *common, "--no-cache", "--out", str(work / "t2")],
                                 {"OMP_NUM_THREADS": "2"}, work / "t2"),
        **{f"flower sim, {w} worker(s) x 1 CPU": ([str(BIN / "hetfl"), "flower", "sim", str(path), "--data-root",
                                                  data_root, "--workers", str(w), "--out", str(work / f"sim{w}")],
                                                 {}, work / f"sim{w}") for w in (1, 2)},
    }
    results = {}
    for label, (cmd, env, folder) in runs.items():
        wall = timed(cmd, env)
        results[label] = {m: round_seconds(folder, m) for m in ("fedavg", "moon")}
        print(f"{label}: wall {wall:.1f} s; " + "; ".join(
            f"{m} {per:.2f} s/round (rounds 2-{rounds}), {total:.1f} s in all" for m, (per, total)
            in results[label].items()), flush=True)
    base = results["hetfl run, 1 thread"]
    for label, res in results.items():
        print(f"{label}: speed-up over 1 thread " + ", ".join(f"{m} {base[m][0] / res[m][0]:.2f}x" for m in res))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["grid", "sim"])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data-root", default="data")
    args = parser.parse_args()
    if args.what == "grid":
        bench_grid(args.seeds)
    else:
        bench_sim(args.rounds, args.data_root)


if __name__ == "__main__":
    main()
