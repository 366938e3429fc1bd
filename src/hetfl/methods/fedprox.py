"""FedProx (Li et al., MLSys 2020): FedAvg whose clients add a proximal term to their loss.

Local objective (Eq. 2): ``CE + mu/2 ||w - w_g||^2``, ``w_g`` the global weights the client received
(:class:`hetfl.fl.objectives.Proximal`); ``mu`` 0.01 as in KDIA's Sec. 6. The paper's inexact local
solvers and variable local work are left out: every client runs the configured epochs, as in the
comparisons we reproduce. ``mu: 0`` sends no term and equals FedAvg bit for bit.
"""

from __future__ import annotations

from typing import Any

from hetfl.fl.method import ServerContext, register
from hetfl.methods.fedavg import ROUND_DEFAULTS, ROUND_RANGES, FedAvgRounds


@register("fedprox")
class FedProx(FedAvgRounds):
    name = "fedprox"
    defaults = {**ROUND_DEFAULTS, "mu": 0.01}
    ranges = {**ROUND_RANGES, "mu": {"ge": 0}}

    def terms(self, client_id: int, round_: int, ctx: ServerContext) -> dict[str, dict[str, Any]]:
        return {"proximal": {"mu": self.params["mu"]}} if self.params["mu"] > 0 else {}
