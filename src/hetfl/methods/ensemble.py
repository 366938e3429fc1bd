"""Ensemble: the uniform average of the client models' logits, ``P(x) = 1/m sum_k F_k(x)``.

Not a deployable single model but the teacher that every distillation method (FedDF, DENSE,
Co-Boosting, FedHydra) chases: its accuracy is the reference those methods are judged against.
Works with any mix of architectures.
"""

from __future__ import annotations

from torch import nn

from hetfl.fl.aggregate import Ensemble
from hetfl.fl.method import OneShotMethod, ServerContext, register
from hetfl.fl.payload import Payload
from hetfl.methods.common import client_models


@register("ensemble")
class EnsembleMethod(OneShotMethod):
    name = "ensemble"
    defaults: dict = {}

    def server(self, uploads: dict[int, Payload], ctx: ServerContext) -> dict[str, nn.Module]:
        return {self.name: Ensemble(list(client_models(uploads, ctx).values())).to(ctx.device)}
