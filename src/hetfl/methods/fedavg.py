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

from torch import nn

from hetfl.fl.aggregate import vote, weighted_average
from hetfl.fl.client import train_message
from hetfl.fl.method import OneShotMethod, RoundMethod, ServerContext, derive_seed, register
from hetfl.fl.payload import Payload
from hetfl.methods.common import client_models, group_by_arch

DEFAULTS: dict[str, Any] = {"rounds": 1, "sample_ratio": 1.0}


class FedAvgOneShot(OneShotMethod):
    name = "fedavg"
    defaults = DEFAULTS

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
    name = "fedavg"
    defaults = DEFAULTS

    def check(self, ctx: ServerContext) -> None:
        mixed = sorted(set(ctx.client_archs) - {ctx.server_arch})
        if mixed:
            raise ValueError(
                f"multi-round fedavg needs every client on the server architecture "
                f"{ctx.server_arch!r}; clients use {mixed}"
            )

    def setup(self, ctx: ServerContext) -> None:
        self.check(ctx)
        self.global_model = ctx.build(ctx.server_arch, purpose="global")

    def client_message(self, client_id: int, round_: int, ctx: ServerContext) -> Payload:
        weights = {k: v.detach().cpu() for k, v in self.global_model.state_dict().items()}
        return train_message(ctx.server_arch, ctx.shape, ctx.num_classes, self.local_config(ctx),
                             init_seed=0, seed=derive_seed(ctx.seed, "client-train", client_id, round_),
                             weights=weights)

    def aggregate(self, round_: int, uploads: dict[int, Payload], ctx: ServerContext) -> None:
        models = client_models(uploads, ctx)
        state = weighted_average([m.state_dict() for m in models.values()],
                                 [uploads[c].meta["num_samples"] for c in models])
        self.global_model.load_state_dict(state)

    def models(self) -> dict[str, nn.Module]:
        return {self.name: self.global_model}


@register("fedavg")
def make_fedavg(params: dict[str, Any], label: str | None = None) -> OneShotMethod | RoundMethod:
    rounds = params.get("rounds", 1)
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"fedavg: rounds must be a positive integer, got {rounds!r}")
    return FedAvgRounds(params, label) if rounds > 1 else FedAvgOneShot(params, label)


