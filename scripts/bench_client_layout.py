"""Time the client-side passes whose frozen models follow the training layout, NCHW against NHWC
(channels_last), interleaved: MOON's simple CNN on 28 x 28 single-channel images.

* ``evaluate``: logits on ``--eval`` images at batch 1,000 (:func:`hetfl.fl.training.predict_logits`).
* ``fedcog``: one FedCOG synthesis step (256 images, CE on the global model + JS against the previous
  local model, backward to the pixels, Adam).
* ``kd``: one local training step at batch 64 with a frozen teacher's forward (FedGKD, KDIA), the
  student NHWC both ways: the teacher NCHW (mixed layouts) against NHWC.

    python scripts/bench_client_layout.py --threads 1 --repeats 5

Prints one JSON line: milliseconds per pass each way (median of ``--repeats`` interleaved rounds after a
warm-up) and the speed-up of NHWC, and the largest logit difference of the two evaluations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hetfl.data.base import ImageDataset
from hetfl.fl.objectives import js_divergence
from hetfl.fl.training import predict_logits
from hetfl.methods.common import frozen
from hetfl.models import build_model

NHWC = torch.channels_last


def frozen_model(nhwc: bool) -> torch.nn.Module:
    """A fresh simple CNN, frozen, in NHWC or NCHW."""
    (model,) = frozen([build_model("simplecnn", 1, 28, 10)], "cpu")
    return model.to(memory_format=NHWC) if nhwc else model


def timed(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def fedcog_step(nhwc: bool) -> Callable[[], None]:
    g, p = frozen_model(nhwc), frozen_model(nhwc)
    y = torch.randint(0, 10, (256,))
    x = torch.randn(256, 1, 28, 28).contiguous(memory_format=NHWC if nhwc else torch.contiguous_format)
    x.requires_grad_(True)
    opt = torch.optim.Adam([x], lr=1e-2)

    def step() -> None:
        out = g(x)
        loss = F.cross_entropy(out, y) + 0.1 * (1 - js_divergence(p(x), out))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def kd_step(nhwc_teacher: bool) -> Callable[[], None]:
    student = build_model("simplecnn", 1, 28, 10).to(memory_format=NHWC)
    teacher = frozen_model(nhwc_teacher)
    opt = torch.optim.SGD(student.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 1, 28, 28).contiguous(memory_format=NHWC)
    y = torch.randint(0, 10, (64,))

    def step() -> None:
        out = student(x)
        with torch.no_grad():
            target = F.softmax(teacher(x) / 2, dim=1)
        loss = F.cross_entropy(out, y) + F.kl_div(F.log_softmax(out / 2, dim=1), target, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--eval", type=int, default=10_000, help="images in the evaluation pass")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = ImageDataset(torch.randint(0, 256, (args.eval, 1, 28, 28), dtype=torch.uint8),
                        torch.randint(0, 10, (args.eval,)), 10, "random")
    model = build_model("simplecnn", 1, 28, 10)
    cpu = torch.device("cpu")
    passes = {
        "evaluate": ({False: lambda: predict_logits(model, data, cpu, channels_last=False),
                      True: lambda: predict_logits(model, data, cpu, channels_last=True)}, 1),
        "fedcog": ({False: fedcog_step(False), True: fedcog_step(True)}, 10),
        "kd": ({False: kd_step(False), True: kd_step(True)}, 50),
    }
    out: dict[str, object] = {"threads": args.threads, "torch": torch.__version__}
    for name, (fns, calls) in passes.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.repeats + 1):
            for nhwc, fn in fns.items():
                ms = timed(fn, calls)
                if round_:
                    times[nhwc].append(ms)
        nchw, nhwc = statistics.median(times[False]), statistics.median(times[True])
        out[name] = {"nchw_ms": round(nchw, 2), "nhwc_ms": round(nhwc, 2), "speedup": round(nchw / nhwc, 2)}
    diff = (predict_logits(model, data, cpu, channels_last=False) - predict_logits(model, data, cpu)).abs().max()
    out["evaluate"]["max_logit_diff"] = float(diff)  # type: ignore[index]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
