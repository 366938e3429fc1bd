"""FedAvgM (Hsu et al., 2019): FedAvg with server momentum.

Per round, with ``Delta = w - avg`` (the global weights minus this round's sample-weighted average):
``v <- beta v + Delta``, ``w <- w - eta v``; ``beta`` 0.9 (KDIA's Sec. 6 default of {0.7, 0.9, 0.99}),
``server_lr`` eta 1, ``v`` starts at zero and is kept with the round checkpoint. The update is
computed in the algebraically equal form ``w <- (1 - eta) w + eta avg - eta beta v_prev``, so that
``beta: 0, server_lr: 1`` gives the average itself, bit for bit (FedAvg). The momentum moves the
parameters only; buffers (BatchNorm's running statistics and step count) take the average, as no paper
puts statistics under momentum (a running variance so moved can turn negative).

KDIA's authors run the damped form v <- beta v + (1 - beta) Delta, w <- w - v: with u = eta v it is this
one at ``server_lr`` eta = 1 - beta (0.1), which their comparison (``kdia.yaml``) sets.
"""

from __future__ import annotations

import torch
from torch import nn

from hetfl.fl.method import ServerContext, register
from hetfl.methods.fedavg import ROUND_DEFAULTS, ROUND_RANGES, FedAvgRounds

MOMENTUM = "momentum."  # state_dict prefix of the server momentum buffer


@register("fedavgm")
class FedAvgM(FedAvgRounds):
    name = "fedavgm"
    defaults = {**ROUND_DEFAULTS, "beta": 0.9, "server_lr": 1.0}
    ranges = {**ROUND_RANGES, "beta": {"ge": 0, "lt": 1}, "server_lr": {"gt": 0}}

    def setup(self, ctx: ServerContext) -> None:
        super().setup(ctx)
        self.velocity = {k: torch.zeros_like(v.detach()) for k, v in self.global_model.named_parameters()}

    def server_update(self, averaged: dict[str, torch.Tensor], ctx: ServerContext) -> dict[str, torch.Tensor]:
        beta, eta = float(self.params["beta"]), float(self.params["server_lr"])
        current = self.global_model.state_dict()
        out = dict(averaged)
        for key, v_prev in self.velocity.items():
            w, avg = current[key], averaged[key].to(current[key].device)
            out[key] = w * (1 - eta) + avg * eta - v_prev * (eta * beta)
            self.velocity[key] = v_prev * beta + (w - avg)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **{MOMENTUM + k: v for k, v in self.velocity.items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        for key in self.velocity:
            self.velocity[key] = state[MOMENTUM + key].to(self.velocity[key].device).clone()

    def models(self) -> dict[str, nn.Module]:
        return {self.name: self.global_model}
