"""Time Co-Boosting's KD steps (ODS through the teachers, then the student's step) with
``distill_precision`` fp32 and bf16, interleaved: ``teachers`` random cnn2 teachers, a cnn2 student,
``steps`` KD batches of ``batch`` random uint8 images per round, through the loop's own
:meth:`DataFreeDistiller.distill` and :meth:`CoBoostingRecipe.kd_batch`.

    python scripts/bench_coboosting_kd.py --threads 2 --steps 20 --repeats 5

Prints one JSON line: milliseconds per KD step for each precision (median of ``--repeats``
interleaved rounds after one warm-up round), the speed-up of bf16 over fp32, and the share of a
fp32 step spent in the ODS passes through the teachers (the same steps with the student's update
alone subtracted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hetfl.fl.datafree import DataFreeConfig, DataFreeDistiller
from hetfl.fl.method import ServerContext
from hetfl.fl.train_config import TrainConfig
from hetfl.methods.coboosting import CoBoosting, CoBoostingRecipe
from hetfl.models import build_model


def distiller(args: argparse.Namespace, out: Path, precision: str) -> DataFreeDistiller:
    torch.manual_seed(0)
    teachers = [build_model("cnn2", 1, 28, 10) for _ in range(args.teachers)]
    ctx = ServerContext(seed=0, num_classes=10, shape=(1, 28, 28), num_clients=args.teachers,
                        client_archs=["cnn2"] * args.teachers, server_arch="cnn2", train_cfg=TrainConfig(),
                        device=torch.device(args.device), out_dir=out, evaluate=lambda model: {"accuracy": 0.0},
                        log=lambda *a, **k: None, progress=lambda it, **k: it, pooled_train_data=lambda: None)
    cfg = DataFreeConfig(epochs=1, batch_size=args.batch, distill_precision=precision, grad_clip=10.0,
                         temperature=4.0)
    recipe = CoBoostingRecipe(args.teachers, ctx.device, CoBoosting.method_defaults, seed=0)
    return DataFreeDistiller(teachers, build_model("cnn2", 1, 28, 10), recipe, cfg, ctx, "coboosting")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--teachers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    dev = torch.device(args.device)
    batches = [(torch.randint(0, 256, (args.batch, 1, 28, 28), dtype=torch.uint8, generator=g).to(dev),
                torch.randint(0, 10, (args.batch,), generator=g).to(dev),
                torch.zeros(args.teachers, args.batch, 10, device=dev)) for _ in range(args.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        engines = {p: distiller(args, Path(tmp) / p, p) for p in ("fp32", "bf16")}
        student_only = distiller(args, Path(tmp) / "student", "fp32")
        student_only.recipe.kd_batch = lambda engine, b: (b[0].float().div(255.0), b[2].mean(0))  # no ODS
        times: dict[str, list[float]] = {"fp32": [], "bf16": [], "student": []}
        for r in range(args.repeats + 1):
            for name, engine in (*engines.items(), ("student", student_only)):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.distill(batches)  # its float() of the loss syncs
                if r:
                    times[name].append((time.perf_counter() - t0) / args.steps * 1000)
    ms = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"threads": args.threads, "batch": args.batch, "teachers": args.teachers,
                      "ms_per_kd_step": {k: round(v, 1) for k, v in ms.items()},
                      "bf16_speedup": round(ms["fp32"] / ms["bf16"], 2),
                      "ods_share_fp32": round(1 - ms["student"] / ms["fp32"], 2)}))


if __name__ == "__main__":
    main()
