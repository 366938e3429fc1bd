"""Time K clients' local training one at a time against one vectorised batch
(:func:`hetfl.fl.training.local_train_group`, the simulator's ``batch_clients``), on random images of
the task's shape, so that a device call can decide whether a budget should batch its clients.

    python scripts/bench_batch_clients.py --arch vgg9 --clients 5 --steps 40 --precision bf16 --device cuda

Each way trains every client for one epoch of ``steps`` batches after one warm-up epoch (kernel choice,
allocator), and the result is the median of ``--repeats`` timed epochs. Prints one JSON line: seconds
per epoch each way, milliseconds per client step, and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from hetfl.data.base import ImageDataset
from hetfl.fl.train_config import TrainConfig
from hetfl.fl.training import local_train, local_train_group
from hetfl.models import build_model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="vgg9")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40, help="batches per client per timed epoch")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--size", type=int, default=28, help="image side (1 channel)")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--channels-last", action="store_true", help="for the one-at-a-time loop")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    n = args.steps * args.batch_size
    g = torch.Generator().manual_seed(0)
    datas = [ImageDataset(torch.randint(0, 256, (n, 1, args.size, args.size), dtype=torch.uint8, generator=g),
                          torch.randint(0, args.classes, (n,), generator=g), args.classes, f"random {k}")
             for k in range(args.clients)]
    models = [build_model(args.arch, 1, args.size, args.classes) for _ in range(args.clients)]
    one = TrainConfig(epochs=1, batch_size=args.batch_size, lr=0.005, precision=args.precision,
                      channels_last=args.channels_last)
    seeds = list(range(args.clients))
    alone = timed(lambda: [local_train(m, d, one, device, seed=s) for m, d, s in zip(models, datas, seeds)],
                  device, args.repeats)
    grouped = timed(lambda: local_train_group(models, datas, one, device, seeds), device, args.repeats)
    steps = args.clients * args.steps
    alone, grouped = round(alone, 5), round(grouped, 5)  # the speed-up is the ratio of the printed times
    print(json.dumps({"arch": args.arch, "clients": args.clients, "steps": args.steps, "batch_size": args.batch_size,
                      "precision": args.precision, "device": str(device),
                      "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                      "threads": torch.get_num_threads(), "alone_s": alone, "grouped_s": grouped,
                      "alone_ms_per_client_step": round(1000 * alone / steps, 2),
                      "grouped_ms_per_client_step": round(1000 * grouped / steps, 2),
                      "speedup": round(alone / grouped, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
