"""OT fusion (Singh & Jaggi, NeurIPS 2020): align neurons layer by layer with optimal transport,
then average.

For every client model but the anchor (client ``anchor``), layer by layer in forward order:
first re-index the layer's incoming weights with the previous layer's transport map ``T``; then
take the ground cost between its neurons' weight vectors (and biases) and the anchor's
(squared Euclidean, the reference's ``wts`` mode), solve exact OT with uniform marginals
(``ot.emd``, POT), and rescale ``T`` by the inverse marginals (the reference's "correction": a
permutation when the solution is one). The aligned neurons, their biases and the BatchNorm
parameters and statistics that follow them are mapped through ``T``. The output layer (classes)
is never permuted. The aligned models are then averaged (uniformly, as in the reference, or by
sample count with ``weighting: samples``).

hetfl's clients of one architecture start from one shared initialisation (DENSE's choice,
:meth:`~hetfl.fl.method.ServerContext.init_seed`); where every neuron stays nearest its own initial
counterpart, every transport plan is the identity and OT fusion equals the uniform parameter average.
Singh & Jaggi's alignment matters for models trained from different initialisations.

Only homogeneous clients with chain architectures (each layer feeds the next: cnn2, cnn3, lenet5,
simplecnn, vgg9). Residual and branching networks (resnet18, googlenet, mobilenetv2,
shufflenetv2) need skip handling, which this implementation does not offer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from hetfl.fl.aggregate import weighted_average
from hetfl.fl.method import OneShotMethod, ServerContext, register
from hetfl.fl.payload import Payload
from hetfl.methods.common import client_models

CHAIN_ARCHS = ("cnn2", "cnn3", "lenet5", "simplecnn", "vgg9")


def chain_layers(model: nn.Module) -> list[tuple[str, nn.Module, str | None]]:
    """(name, conv/linear module, name of the BatchNorm that follows it or None), in order."""
    layers: list[tuple[str, nn.Module, str | None]] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            layers.append((name, module, None))
        elif isinstance(module, nn.BatchNorm2d) and layers:
            prev = layers[-1]
            layers[-1] = (prev[0], prev[1], name)
    return layers


def _apply_in(weight: torch.Tensor, T: torch.Tensor | None) -> torch.Tensor:
    """Re-index input neurons: ``W[:, j] <- sum_i T[i, j] W[:, i]`` (conv channels, linear features,
    or linear features that flatten C x H x W conv maps)."""
    if T is None:
        return weight
    n_in = T.shape[0]
    if weight.dim() == 4:
        return torch.einsum("oikl,ij->ojkl", weight, T)
    if weight.shape[1] == n_in:
        return weight @ T
    out, features = weight.shape
    w = weight.reshape(out, n_in, features // n_in)  # flattened conv maps: channel-major
    return torch.einsum("ois,ij->ojs", w, T).reshape(out, features)


def fuse(states: list[dict[str, torch.Tensor]], layers: list[tuple[str, nn.Module, str | None]],
         weights: list[float], anchor: int = 0) -> dict[str, torch.Tensor]:
    """Align every state to ``states[anchor]`` and return the weighted average."""
    import ot as pot  # POT imports scikit-learn (~3 s): only when OT fusion runs, not on import

    aligned = []
    for k, state in enumerate(states):
        if k == anchor:
            aligned.append(state)
            continue
        out = dict(state)
        T_prev: torch.Tensor | None = None
        for idx, (name, _module, bn) in enumerate(layers):
            W = _apply_in(state[f"{name}.weight"].double(), T_prev)
            b = state.get(f"{name}.bias")
            last = idx == len(layers) - 1
            if last:
                out[f"{name}.weight"] = W.to(state[f"{name}.weight"].dtype)
                continue
            A = states[anchor][f"{name}.weight"].double()
            rows_k = W.reshape(W.shape[0], -1)
            rows_a = A.reshape(A.shape[0], -1)
            if b is not None:
                rows_k = torch.cat([rows_k, b.double()[:, None]], dim=1)
                rows_a = torch.cat([rows_a, states[anchor][f"{name}.bias"].double()[:, None]], dim=1)
            n = rows_k.shape[0]
            cost = torch.cdist(rows_k, rows_a).pow(2).cpu().numpy()
            plan = pot.emd(np.full(n, 1.0 / n), np.full(n, 1.0 / n), cost)
            T = torch.from_numpy(plan).to(W.device) * n  # columns sum to 1: anchor neuron j <- sum_i T[i, j] neuron i
            mapped = torch.einsum("ij,i...->j...", T, W)
            out[f"{name}.weight"] = mapped.to(state[f"{name}.weight"].dtype)
            if b is not None:
                out[f"{name}.bias"] = (T.t() @ b.double()).to(b.dtype)
            if bn is not None:
                for key in ("weight", "bias", "running_mean", "running_var"):
                    v = state[f"{bn}.{key}"]
                    out[f"{bn}.{key}"] = (T.t() @ v.double()).to(v.dtype)
            T_prev = T
        aligned.append(out)
    return weighted_average(aligned, weights)


@register("ot")
class OTFusion(OneShotMethod):
    name = "ot"
    defaults: dict[str, Any] = {"anchor": 0, "weighting": "uniform"}

    def check(self, ctx: ServerContext) -> None:
        archs = sorted(set(ctx.client_archs))
        if len(archs) > 1:
            raise ValueError(
                f"ot: OT fusion aligns neurons of models of one architecture; clients use {archs}. "
                "For heterogeneous clients use fedavg (per architecture), feddf, dense, coboosting or fedhydra."
            )
        if archs[0] not in CHAIN_ARCHS:
            raise ValueError(f"ot: supports chain architectures {CHAIN_ARCHS}, not {archs[0]!r} (skip connections)")
        if self.params["weighting"] not in ("uniform", "samples"):
            raise ValueError(f"ot: weighting must be 'uniform' or 'samples', got {self.params['weighting']!r}")

    def server(self, uploads: dict[int, Payload], ctx: ServerContext) -> dict[str, nn.Module]:
        archs = sorted(set(ctx.client_archs))
        models = client_models(uploads, ctx)
        ids = sorted(models)
        anchor = int(self.params["anchor"])
        if anchor not in ids:
            raise ValueError(f"ot: anchor must be one of the clients {ids}, got {anchor}")
        weights = ([uploads[c].meta["num_samples"] for c in ids] if self.params["weighting"] == "samples"
                   else [1.0] * len(ids))
        states = [{k: v.detach().cpu() for k, v in models[c].state_dict().items()} for c in ids]
        fused = fuse(states, chain_layers(models[ids[0]]), weights, anchor=ids.index(anchor))
        model = ctx.build(archs[0], purpose="ot")
        model.load_state_dict(fused)
        return {self.name: model}
