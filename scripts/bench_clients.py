"""Client-count sweep: set-up seconds, seconds per round and peak memory against the number of clients.

    python scripts/bench_clients.py [--clients 100,1000,10000] [--methods fedavg,moon,kdia] [--dataset synthetic]

Every client holds ``--per-client`` samples (synthetic data of 10 classes, 28 x 28, sized N x per-client; or
MNIST's 60,000 split among N), 10 of them take part per round, so the sampled work per round is the same
at every N on synthetic data. Each (N, method) runs in a process of its own (its peak resident memory is
its own), one torch thread. Set-up: from the loaded dataset to the first round (partition, per-client
views, the simulator); rounds: the method's seconds over its rounds (one evaluation, at the end).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

METHOD_PARAMS = {"kdia": {"gen_epochs": 1, "gen_batches": 50}}  # KDIA's generator at a small budget


def one(clients: int, method: str, dataset: str, per_client: int, rounds: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from hetfl.data import load_dataset
    from hetfl.engine.simulator import Simulator, prepare
    from hetfl.host import peak_gib
    from hetfl.methods.checks import validate

    data = {"classes": 10, "channels": 1, "size": 28, "train_per_class": clients * per_client // 10,
            "test_per_class": 100} if dataset == "synthetic" else {}
    cfg = validate({"name": f"clients-{clients}-{method}", "seed": 0, "dataset": dataset, "data": data,
                    "partition": {"kind": "iid"}, "clients": clients, "eval_every": rounds,
                    "client": {"model": "simplecnn", "epochs": 1, "batch_size": 32, "lr": 0.01},
                    "methods": {method: {"rounds": rounds, "sample_ratio": 10 / clients,
                                         **METHOD_PARAMS.get(method, {})}}})
    splits = load_dataset(dataset, "data", data)
    start = time.perf_counter()
    sim = Simulator(prepare(cfg, "data", splits=splits), f"/tmp/bench-clients/{clients}-{method}", None, quiet=True,
                    resume=False)
    setup = time.perf_counter() - start
    result = sim.run()["results"][method]
    return {"clients": clients, "method": method, "setup_s": round(setup, 2),
            "round_s": round(result["seconds"] / rounds, 2),
            "peak_gb": round(peak_gib(), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="100,1000,10000")
    parser.add_argument("--methods", default="fedavg,moon,kdia")
    parser.add_argument("--dataset", default="synthetic", choices=("synthetic", "mnist"))
    parser.add_argument("--per-client", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(int(args.clients), args.methods, args.dataset, args.per_client, args.rounds)))
        return
    print("| clients | method | set-up s | s per round | peak GB |\n| --- | --- | --- | --- | --- |")
    for method in args.methods.split(","):
        for clients in args.clients.split(","):
            done = subprocess.run([sys.executable, __file__, "--one", "--clients", clients, "--methods", method,
                                   "--dataset", args.dataset, "--per-client", str(args.per_client),
                                   "--rounds", str(args.rounds)], capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"| {row['clients']:,} | {method} | {row['setup_s']} | {row['round_s']} | {row['peak_gb']} |",
                  flush=True)


if __name__ == "__main__":
    main()
