"""FedDisco (Ye et al., ICML 2023): discrepancy-aware aggregation weights.

``p_k ∝ ReLU(n_k / n - a d_k + b)`` over the round's accepted uploads, ``n`` their total samples and
``d_k = KL(h_k || uniform)`` of client k's label histogram ``h_k`` (from its upload), normalised to sum
to 1 over the round as in the authors' ``disco.py``; ``a`` 0.5, ``b`` 0.1. Where every weight is 0 the
round falls back to ``n_k / n``. The weights are computed multiplied through by ``n``
(``ReLU(n_k - a d_k n + b n)``, the same after normalisation), so that ``a = b = 0`` gives FedAvg's
weights bit for bit. Clients train as in FedAvg.
"""

from __future__ import annotations

import torch

from hetfl.fl.method import ServerContext, register
from hetfl.fl.payload import Payload, PayloadError
from hetfl.methods.fedavg import ROUND_DEFAULTS, ROUND_RANGES, FedAvgRounds


def discrepancy(histograms: torch.Tensor) -> torch.Tensor:
    """``KL(h_k || uniform)`` per row of label counts, normalised to sum 1 (all zeros stay zero)."""
    p = histograms.double() / histograms.double().sum(dim=1, keepdim=True).clamp(min=1)
    kl = torch.where(p > 0, p * torch.log(p * histograms.shape[1]), torch.zeros_like(p)).sum(dim=1)
    return kl / kl.sum() if float(kl.sum()) > 0 else kl


def disco_weights(samples: list[float], histograms: torch.Tensor, a: float, b: float) -> list[float]:
    """The round's unnormalised weights ``ReLU(n_k - a d_k n + b n)`` (module docstring)."""
    n_k = torch.tensor(samples, dtype=torch.float64)
    n = float(n_k.sum())
    w = torch.relu(n_k - a * discrepancy(histograms) * n + b * n)
    return (w if float(w.sum()) > 0 else n_k).tolist()


@register("feddisco")
class FedDisco(FedAvgRounds):
    name = "feddisco"
    defaults = {**ROUND_DEFAULTS, "a": 0.5, "b": 0.1}
    ranges = {**ROUND_RANGES, "a": {"ge": 0}, "b": {"ge": 0}}

    def validate_upload(self, client_id: int, message: Payload, upload: Payload, ctx: ServerContext) -> None:
        super().validate_upload(client_id, message, upload, ctx)
        counts = upload.meta.get("label_counts")
        if (not isinstance(counts, list) or len(counts) != ctx.num_classes
                or not all(isinstance(c, int) and c >= 0 for c in counts) or sum(counts) != upload.meta["num_samples"]):
            raise PayloadError(f"label_counts must be {ctx.num_classes} non-negative counts summing to num_samples")

    def weights(self, uploads: dict[int, Payload], ctx: ServerContext) -> list[float]:
        histograms = torch.tensor([uploads[c].meta["label_counts"] for c in uploads])
        return disco_weights(super().weights(uploads, ctx), histograms, float(self.params["a"]),
                             float(self.params["b"]))
