"""Time one data-free synthesis (DENSE's recipe: ``teachers`` random cnn2 teachers and a cnn2 student,
``steps`` generator steps at batch ``batch``) two ways, interleaved, and compare the batches they keep.

``--compare frozen`` (default): the student's weights frozen during the generator's steps
(:func:`hetfl.fl.training.weights_frozen`, what the loop does) against not; the kept batches must be
equal to the bit. ``--compare compile``: the loop's
``compile: true`` against eager, both frozen; the kept uint8 batches may differ by a rounding step.
``--compare channels_last``: the loop's NHWC models (``channels_last: true``, the default) against
NCHW, both frozen and eager.

    python scripts/bench_synthesis_step.py --precision bf16 --threads 2 --steps 5 --repeats 5 [--compile]
    python scripts/bench_synthesis_step.py --compare compile --precision fp32 --threads 2

Prints one JSON line: milliseconds per generator step each way (median of ``--repeats`` interleaved
rounds after one warm-up round, which compiles), the speed-up of the second way over the first, and
whether the kept batches were equal to the bit (and their largest difference in uint8 levels).
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
from hetfl.fl.train_config import TrainConfig
from hetfl.fl.training import weights_frozen
from hetfl.methods.dense import DenseRecipe
from hetfl.models import build_model


def distiller(args: argparse.Namespace, out: Path, compile_guide: bool, nhwc: bool) -> DataFreeDistiller:
    torch.manual_seed(0)
    teachers = [build_model("cnn2", 1, 28, 10) for _ in range(args.teachers)]
    ctx = ServerContext(seed=0, num_classes=10, shape=(1, 28, 28), num_clients=args.teachers,
                        client_archs=["cnn2"] * args.teachers, server_arch="cnn2", train_cfg=TrainConfig(),
                        device=torch.device(args.device), out_dir=out, evaluate=lambda model: {"accuracy": 0.0},
                        log=lambda *a, **k: None, progress=lambda it, **k: it, pooled_train_data=lambda: None)
    cfg = DataFreeConfig(epochs=1, generator_steps=args.steps, batch_size=args.batch, precision=args.precision,
                         compile=compile_guide, channels_last=nhwc)
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
    ap.add_argument("--compile", action="store_true",
                    help="with --compare frozen: both ways with the loop's compile: true")
    ap.add_argument("--compare", default="frozen", choices=["frozen", "compile", "channels_last"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    unfrozen = lambda model: contextlib.nullcontext()  # noqa: E731
    # name: (how the student is held during G's steps, compile, channels_last); the second way is the new one
    ways = {"frozen": {"unfrozen": (unfrozen, args.compile, True), "frozen": (weights_frozen, args.compile, True)},
            "compile": {"eager": (weights_frozen, False, True), "compiled": (weights_frozen, True, True)},
            "channels_last": {"nchw": (weights_frozen, False, False), "nhwc": (weights_frozen, False, True)},
            }[args.compare]
    with tempfile.TemporaryDirectory() as tmp:
        engines = {name: distiller(args, Path(tmp) / name, *way[1:]) for name, way in ways.items()}
        kept = {}
        for name, engine in engines.items():  # warm-up round; the same epoch seed gives the same batches
            datafree.weights_frozen = ways[name][0]
            kept[name] = engine.synthesize(1)
        first, second = kept.values()
        pairs = [(a, b) for ka, kb in zip(first, second, strict=True) for a, b in zip(ka, kb, strict=True)]
        same = all(torch.equal(a, b) for a, b in pairs)
        levels = max(int((a.int() - b.int()).abs().max()) if not a.is_floating_point()
                     else float((a - b).abs().max()) for a, b in pairs)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.repeats):
            for name, engine in engines.items():
                datafree.weights_frozen = ways[name][0]
                start = time.perf_counter()
                engine.synthesize(r + 2)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                times[name].append((time.perf_counter() - start) / args.steps * 1000)
        datafree.weights_frozen = weights_frozen
    ms = {name: statistics.median(t) for name, t in times.items()}
    slow, fast = ms.values()
    print(json.dumps({"compare": args.compare, "precision": args.precision, "compile": args.compile,
                      "threads": args.threads, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "ms_per_step": ms, "speedup": slow / fast, "same_batches": same, "max_diff": levels,
                      "rounds": {n: [round(x, 1) for x in t] for n, t in times.items()}}))


if __name__ == "__main__":
    main()
