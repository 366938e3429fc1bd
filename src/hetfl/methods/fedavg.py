"""FedAvg (McMahan et al., 2017): weighted parameter averaging, one-shot or over T rounds.

* One-shot (``rounds: 1``, the default): every client trains from the same initialisation for
  E local epochs; the server averages the uploads weighted by sample count,
  ``theta = sum_k n_k / n * theta_k``. With heterogeneous architectures it averages within each
  architecture and reports each group (as FedMHO's baselines do); the headline model is the
  group of the server architecture, else the group holding most samples. It also reports
  ``fedavg[vote]``, FedMHO's protocol for model-heterogeneous FedAvg ("the voting results of each
  model prototype", Sec. 5.1): the uniform mean of the group averages' logits, as the authors'
  ``federated_average_ensemble.py`` computes it. (Their groups are uniform averages; ours weigh by
  sample count, McMahan's FedAvg.) The vote is evaluated but not saved: its members are.
* Multi-round (``rounds: T > 1``): each round samples ``max(1, round(C * N))`` clients
  (``sample_ratio`` C), sends them the global weights, and averages their updates by sample
  count. Needs every client on the server architecture.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hetfl.fl.aggregate import vote, weighted_average
from hetfl.fl.client import train_message
from hetfl.fl.method import OneShotMethod, RoundMethod, ServerContext, derive_seed, register
from hetfl.fl.payload import Payload
from hetfl.methods.common import client_models, group_by_arch, require_one_architecture

DEFAULTS: dict[str, Any] = {"rounds": 1, "sample_ratio": 1.0, "init": "seed"}


class FedAvgOneShot(OneShotMethod):
    name = "fedavg"
    defaults = DEFAULTS
    ranges = {"init": {"choices": ("seed", "weights")}}

    def server(self, uploads: dict[int, Payload], ctx: ServerContext) -> dict[str, nn.Module]:
        models = client_models(uploads, ctx)
        groups = group_by_arch(uploads)
        averaged: dict[str, nn.Module] = {}
        for arch, ids in groups.items():
            state = weighted_average([models[c].state_dict() for c in ids],
                                     [uploads[c].meta["num_samples"] for c in ids])
            model = ctx.build(arch, purpose="fedavg")
            model.load_state_dict(state)
            averaged[arch] = model
        if ctx.server_arch in averaged:
            head = ctx.server_arch
        else:
            head = max(groups, key=lambda a: sum(uploads[c].meta["num_samples"] for c in groups[a]))
        out = {self.name: averaged[head]}
        if len(averaged) > 1:
            out.update({f"{self.name}[{arch}]": m for arch, m in averaged.items() if arch != head})
            out[f"{self.name}[vote]"] = vote([averaged[head], *(m for arch, m in averaged.items() if arch != head)])
        return out


class FedAvgRounds(RoundMethod):
    """Multi-round FedAvg, and the base of the parameter-averaging baselines (FedProx, FedAvgM, MOON,
    FedDisco): each overrides one hook, :meth:`terms` (the clients' extra loss terms),
    :meth:`weights` (the aggregation weights) or :meth:`server_update` (the new global weights).

    ``init: seed`` (default): round 1 sends the initialisation seed instead of the weights; the clients
    rebuild the server's initial model bit for bit. ``init: weights`` sends the weights every round."""

    name = "fedavg"
    defaults = DEFAULTS
    ranges = {"init": {"choices": ("seed", "weights")}}

    def check(self, ctx: ServerContext) -> None:
        require_one_architecture(ctx, f"multi-round {self.method} averages parameters")

    def setup(self, ctx: ServerContext) -> None:
        self.check(ctx)
        self.global_model = ctx.build(ctx.server_arch, purpose="global")

    def client_message(self, client_id: int, round_: int, ctx: ServerContext) -> Payload:
        from_seed = round_ == 1 and self.params["init"] == "seed"
        weights = None if from_seed else {k: v.detach().cpu() for k, v in self.global_model.state_dict().items()}
        terms = self.terms(client_id, round_, ctx)
        return train_message(ctx.server_arch, ctx.shape, ctx.num_classes, self.local_config(ctx),
                             init_seed=derive_seed(ctx.seed, "global", ctx.server_arch) if from_seed else 0,
                             seed=derive_seed(ctx.seed, "client-train", client_id, round_),
                             weights=weights, round=round_, **({"terms": terms} if terms else {}))

    def terms(self, client_id: int, round_: int, ctx: ServerContext) -> dict[str, dict[str, Any]]:
        """The clients' extra loss terms (hetfl.fl.objectives); FedAvg: none."""
        return {}

    def weights(self, uploads: dict[int, Payload], ctx: ServerContext) -> list[float]:
        """Aggregation weights, in ``uploads`` order; FedAvg: the sample counts n_k."""
        return [float(uploads[c].meta["num_samples"]) for c in uploads]

    def server_update(self, averaged: dict[str, torch.Tensor], ctx: ServerContext) -> dict[str, torch.Tensor]:
        """The new global weights from this round's average; FedAvg: the average itself."""
        return averaged

    def aggregate(self, round_: int, uploads: dict[int, Payload], ctx: ServerContext) -> None:
        models = client_models(uploads, ctx)
        averaged = weighted_average([models[c].state_dict() for c in uploads], self.weights(uploads, ctx))
        self.global_model.load_state_dict(self.server_update(averaged, ctx))

    def models(self) -> dict[str, nn.Module]:
        return {self.name: self.global_model}


ROUND_DEFAULTS: dict[str, Any] = {"rounds": 200, "sample_ratio": 0.1, "init": "seed"}  # KDIA's Sec. 6
ROUND_RANGES: dict[str, dict[str, Any]] = {"rounds": {"ge": 1}, "init": {"choices": ("seed", "weights")}}


@register("fedavg")
def make_fedavg(params: dict[str, Any], label: str | None = None) -> OneShotMethod | RoundMethod:
    rounds = params.get("rounds", 1)
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"fedavg: rounds must be a positive integer, got {rounds!r}")
    return FedAvgRounds(params, label) if rounds > 1 else FedAvgOneShot(params, label)


