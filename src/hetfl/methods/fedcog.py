"""FedCOG (Ye et al., ICLR 2024): consensus-oriented generation of complementary data on the clients.

Before ``start_round`` (0: round(0.7 T) + 1, as KDIA's comparison) the rounds are FedAvg's, the clients
keeping their trained model (the ``remember`` term). From ``start_round`` each sampled client first
optimises ``g_size`` (256) images directly (Adam ``g_lr`` 1e-2, ``g_steps`` 500) for labels in proportion
to ``max_count - count_c`` of its histogram: CE on the received global model (``oh`` 1) + ``adv`` (0.1)
x (1 - JS) between its previous local model (client state; the received model at a first
participation) and the global model; then trains on ``real`` x CE on its data + ``syn`` x KL(global ||
local) on a synthetic batch per step, with FedCOG's shares ``real = n/(n + n_syn)``, ``syn = n_syn/(n +
n_syn)``; ``kd_weight >= 0`` makes it CE + kd_weight x KL (KDIA's comparison: 0.01).
(:class:`hetfl.fl.objectives.FedCOGTerm`.) The authors' BN-statistics term (weight 0 by default) and
generator option are left out. Aggregation is FedAvg's.
"""

from __future__ import annotations

from typing import Any

from hetfl.fl.method import ServerContext, register
from hetfl.methods.fedavg import ROUND_DEFAULTS, ROUND_RANGES, FedAvgRounds


@register("fedcog")
class FedCOG(FedAvgRounds):
    name = "fedcog"
    defaults = {**ROUND_DEFAULTS, "start_round": 0, "g_steps": 500, "g_lr": 1e-2, "g_size": 256, "adv": 0.1,
                "kd_weight": -1.0}
    ranges = {**ROUND_RANGES, "start_round": {"ge": 0}, "g_steps": {"ge": 0}, "g_lr": {"gt": 0},
              "g_size": {"ge": 1}, "adv": {"ge": 0}}

    @property
    def start_round(self) -> int:
        start = int(self.params["start_round"])
        return start if start > 0 else int(round(0.7 * self.rounds)) + 1

    def check(self, ctx: ServerContext) -> None:
        super().check(ctx)
        if self.start_round > self.rounds:
            raise ValueError(f"start_round {self.start_round} is past the last round ({self.rounds})")

    def terms(self, client_id: int, round_: int, ctx: ServerContext) -> dict[str, dict[str, Any]]:
        if round_ < self.start_round:
            return {"remember": {}}
        p = self.params
        return {"fedcog": {"steps": p["g_steps"], "lr": p["g_lr"], "size": p["g_size"], "adv": p["adv"],
                           "kd_weight": p["kd_weight"]}}
