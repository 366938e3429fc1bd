"""Time KDIA's feature generator (noise 100 + label -> 16 x 5 x 5 maps for MOON's simple CNN) with its
transposed convolutions as the library's ``nn.ConvTranspose2d`` against
:func:`hetfl.models.generator.conv_transpose2x2` (one GEMM each), interleaved:

* ``train``: one server step (Eq. 3 + 4): a batch of 64 through the generator and the ``classify`` part of
  ``--heads`` frozen client models, backward, Adam (the library's per-tensor loop against ``fused``).
* ``generate``: a client's frozen generator making one batch of 64 feature maps (eval mode, no grad).

    python scripts/bench_feature_generator.py --threads 1 --repeats 5

Prints one JSON line: milliseconds per pass each way (median of ``--repeats`` interleaved rounds after a
warm-up), the speed-up, and the largest output difference of the two forms on the same weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.methods.common import frozen
from hetfl.methods.kdia import diversity_loss
from hetfl.models import build_model
from hetfl.models.generator import FeatureGenerator


def library_forward(gen: FeatureGenerator, noise: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The generator's layers run as they are (``nn.ConvTranspose2d``)."""
    return gen.net(torch.cat([noise, gen.embed(labels)], dim=1)[:, :, None, None])


def passes(gemm: bool, heads: list[nn.Module], batch: int) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    gen = FeatureGenerator(100, 10, (16, 5, 5))
    forward: Callable[..., torch.Tensor] = gen if gemm else (lambda n, y: library_forward(gen, n, y))
    opt = torch.optim.Adam(gen.parameters(), lr=1e-3, weight_decay=1e-5, fused=gemm)
    noise, labels = torch.randn(batch, 100), torch.randint(0, 10, (batch,))
    weights = torch.full((len(heads),), 1 / len(heads))

    def train() -> None:
        gen.train()
        features = forward(noise, labels)
        mixed = torch.tensordot(weights, torch.stack([h.classify(features) for h in heads]), dims=1)
        loss = F.cross_entropy(mixed, labels) + diversity_loss(noise, features)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def generate() -> None:
        gen.eval()
        with torch.no_grad():
            forward(noise, labels)
    return {"train": train, "generate": generate}


def timed(fn: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--heads", type=int, default=10, help="client models in the server step (KDIA: 10)")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    heads = frozen([build_model("simplecnn", 1, 28, 10) for _ in range(args.heads)], "cpu")
    ways = {False: passes(False, heads, args.batch), True: passes(True, heads, args.batch)}
    out: dict[str, object] = {"threads": args.threads, "torch": torch.__version__}
    for name, calls in (("train", 10), ("generate", 20)):
        times: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.repeats + 1):
            for gemm, fns in ways.items():
                ms = timed(fns[name], calls)
                if round_:
                    times[gemm].append(ms)
        lib, gemm_ms = statistics.median(times[False]), statistics.median(times[True])
        out[name] = {"library_ms": round(lib, 2), "gemm_ms": round(gemm_ms, 2), "speedup": round(lib / gemm_ms, 2)}
    torch.manual_seed(1)
    gen = FeatureGenerator(100, 10, (16, 5, 5)).eval()
    noise, labels = torch.randn(args.batch, 100), torch.randint(0, 10, (args.batch,))
    with torch.no_grad():
        out["max_diff"] = float((gen(noise, labels) - library_forward(gen, noise, labels)).abs().max())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
