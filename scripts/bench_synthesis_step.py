"""Time one data-free synthesis (DENSE's recipe: ``teachers`` random cnn2 teachers and a cnn2 student,
``steps`` generator steps at batch ``batch``) with the student's weights frozen during the generator's
steps (:func:`hetfl.fl.training.weights_frozen`, what the loop does) and without (the loop before the
fifty-third session), interleaved, and check that both keep the same batches.

    python scripts/bench_synthesis_step.py --precision bf16 --threads 2 --steps 5 --repeats 5 [--compile]

Prints one JSON line: milliseconds per generator step each way (median of ``--repeats`` interleaved
rounds after one warm-up round), the speed-up, and whether the kept batches were equal to the bit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hetfl.fl import datafree
from hetfl.fl.datafree import DataFreeConfig, DataFreeDistiller
from hetfl.fl.method import ServerContext
from hetfl.fl.training import TrainConfig, weights_frozen
from hetfl.methods.dense import DenseRecipe
from hetfl.models import build_model


def distiller(args: argparse.Namespace, out: Path) -> DataFreeDistiller:
    torch.manual_seed(0)
    teachers = [build_model("cnn2", 1, 28, 10) for _ in range(args.teachers)]
    ctx = ServerContext(seed=0, num_classes=10, shape=(1, 28, 28), num_clients=args.teachers,
                        client_archs=["cnn2"] * args.teachers, server_arch="cnn2", train_cfg=TrainConfig(),
                        device=torch.device(args.device), out_dir=out, evaluate=lambda model: {"accuracy": 0.0},
                        log=lambda *a, **k: None, progress=lambda it, **k: it, pooled_train_data=lambda: None)
    cfg = DataFreeConfig(epochs=1, generator_steps=args.steps, batch_size=args.batch, precision=args.precision,
                         compile=args.compile)
    return DataFreeDistiller(teachers, build_model("cnn2", 1, 28, 10), DenseRecipe(), cfg, ctx, "dense")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--teachers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true", help="the loop's compile: true (the warm-up round compiles)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ways = {"frozen": weights_frozen, "unfrozen": lambda model: contextlib.nullcontext()}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {name: distiller(args, Path(tmp) / name) for name in ways}
        kept = {}
        for name, engine in engines.items():  # warm-up round; the same epoch seed gives the same batches
            datafree.weights_frozen = ways[name]
            kept[name] = engine.synthesize(1)
        same = all(torch.equal(a, b) for ka, kb in zip(kept["frozen"], kept["unfrozen"], strict=True)
                   for a, b in zip(ka, kb, strict=True))
        times: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.repeats):
            for name, engine in engines.items():
                datafree.weights_frozen = ways[name]
                start = time.perf_counter()
                engine.synthesize(r + 2)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                times[name].append((time.perf_counter() - start) / args.steps * 1000)
        datafree.weights_frozen = weights_frozen
    ms = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({"precision": args.precision, "compile": args.compile, "threads": args.threads, "ms_per_step": ms,
                      "speedup": ms["unfrozen"] / ms["frozen"], "same_batches": same,
                      "rounds": {n: [round(x, 1) for x in t] for n, t in times.items()}}))


if __name__ == "__main__":
    main()
