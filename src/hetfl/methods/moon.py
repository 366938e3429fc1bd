"""MOON (Li et al., CVPR 2021): model-contrastive local training.

Local objective (Eq. 3-4): ``CE + mu * CE([cos(z, z_g), cos(z, z_prev)] / tau, 0)`` on the projection
``z`` (the 256-d output before the classifier of ``simplecnn``, MOON's CNN), ``z_g`` from the received
global model and ``z_prev`` from the client's previous local model, which lives in the client's state
(:class:`hetfl.fl.objectives.Contrastive`). ``mu`` 5, ``tau`` 0.5 (MOON's CIFAR-10 values, KDIA's
Sec. 6). At a client's first participation there is no previous model and no term (MOON's code uses
the global model there, whose term has zero gradient). One previous model (MOON's
``model_buffer_size`` 1). Aggregation is FedAvg's.
"""

from __future__ import annotations

from typing import Any

from hetfl.fl.method import ServerContext, register
from hetfl.methods.common import require_projection_head
from hetfl.methods.fedavg import ROUND_DEFAULTS, ROUND_RANGES, FedAvgRounds


@register("moon")
class Moon(FedAvgRounds):
    name = "moon"
    defaults = {**ROUND_DEFAULTS, "mu": 5.0, "tau": 0.5}
    ranges = {**ROUND_RANGES, "mu": {"ge": 0}, "tau": {"gt": 0}}

    def check(self, ctx: ServerContext) -> None:
        super().check(ctx)
        require_projection_head(ctx, "moon")

    def terms(self, client_id: int, round_: int, ctx: ServerContext) -> dict[str, dict[str, Any]]:
        return {"contrastive": {"mu": self.params["mu"], "tau": self.params["tau"]}}
