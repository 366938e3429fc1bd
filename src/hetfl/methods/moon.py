"""MOON (Li et al., CVPR 2021): model-contrastive local training.

Local objective (Eq. 3-4): ``CE + mu * CE([cos(z, z_g), cos(z, z_prev)] / tau, 0)`` on the projection
``z`` (the 256-d output before the classifier of ``simplecnn``, MOON's CNN), ``z_g`` from the received
global model and ``z_prev`` from the client's previous local model, which lives in the client's state
(:class:`hetfl.fl.objectives.Contrastive`). ``mu`` 5, ``tau`` 0.5 (MOON's CIFAR-10 values, KDIA's
Sec. 6). At a client's first participation there is no previous local model and we add no term. This is
our choice: MOON's code (and KDIA's, built on it) has no term in round 1 either (an empty model pool), but
from round 2 on a client sampled for the first time contrasts against its own network as the code
initialised it (random, never trained), since the pool holds every party's network. One previous model
(MOON's ``model_buffer_size`` 1). Aggregation is FedAvg's.
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
