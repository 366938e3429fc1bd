"""Aggregation primitives: weighted parameter averages and logit ensembles."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


def normalise(weights: Sequence[float]) -> torch.Tensor:
    w = torch.as_tensor(list(weights), dtype=torch.float64)
    if len(w) == 0 or bool((w < 0).any()) or float(w.sum()) <= 0:
        raise ValueError(f"aggregation weights must be non-negative with a positive sum, got {w.tolist()}")
    return w / w.sum()


def weighted_average(states: Sequence[dict[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """``sum_k w_k * theta_k`` per tensor (weights normalised to 1). Integer buffers such as
    BatchNorm's ``num_batches_tracked`` are averaged and rounded."""
    if not states:
        raise ValueError("nothing to average")
    w = normalise(weights)
    keys = list(states[0])
    for s in states[1:]:
        if set(s) != set(keys):
            raise ValueError("cannot average models with different parameter names (heterogeneous architectures)")
    out = {}
    for key in keys:
        stacked = torch.stack([s[key].to(torch.float64) for s in states])
        mean = torch.tensordot(w.to(stacked.device), stacked, dims=1)
        dtype = states[0][key].dtype
        out[key] = (mean.round() if not dtype.is_floating_point else mean).to(dtype)
    return out


def streamed_average(states: Iterable[dict[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """:func:`weighted_average` over states read one at a time (e.g. from disk), so only one of them and
    the float64 sum are in memory; the states come in the order of ``weights``."""
    w = normalise(weights).tolist()
    acc: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    count = 0
    for k, state in enumerate(states):
        if acc and set(state) != set(acc):
            raise ValueError("cannot average models with different parameter names (heterogeneous architectures)")
        for key, value in state.items():
            term = value.to(torch.float64) * w[k]
            acc[key] = acc[key] + term if key in acc else term
            dtypes.setdefault(key, value.dtype)
        count += 1
    if count != len(w):
        raise ValueError(f"{count} states for {len(w)} weights")
    return {key: (v.round() if not dtypes[key].is_floating_point else v).to(dtypes[key]) for key, v in acc.items()}


class Ensemble(nn.Module):
    """Weighted average of member logits (uniform by default): ``sum_k w_k F_k(x)``, in fp32 even under
    bf16 autocast (the members may run in bf16; their average does not round to bf16)."""

    def __init__(self, members: Sequence[nn.Module], weights: Sequence[float] | None = None) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        w = normalise(weights if weights is not None else [1.0] * len(members)).float()
        self.register_buffer("weights", w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.stack([m(x).float() for m in self.members])  # (k, N, C)
        with torch.autocast(device_type=logits.device.type, enabled=False):  # tensordot would autocast to bf16
            return torch.tensordot(self.weights, logits, dims=1)


def vote(members: Sequence[nn.Module]) -> Ensemble:
    """FedMHO's "voting results of each model prototype" (Sec. 5.1): the uniform mean of the logits of
    one model per client architecture. Flagged ``save = False``: an engine saves its members (returned
    under their own names), not this copy of them."""
    ensemble = Ensemble(members)
    ensemble.save = False
    return ensemble
