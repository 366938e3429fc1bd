"""FedGKD (Yao et al., 2021): global knowledge distillation from the recent global models.

The server keeps the last ``buffer_length`` (5) global models; from round 2 the clients receive their
uniform average as a teacher (under ``teacher/``, bytes counted) and add
``(gamma / 2) T^2 KL(teacher/T || student/T)`` to their cross-entropy (``gamma`` 0.2 as in KDIA's
Sec. 6, T 2; :class:`hetfl.fl.objectives.Distillation`). Round 1 has no term (the buffer is empty).
The paper's parameter-averaged teacher (``--avg_param True`` in the authors' code); aggregation is FedAvg's.
"""

from __future__ import annotations

from typing import Any

import torch

from hetfl.fl.aggregate import weighted_average
from hetfl.fl.method import ServerContext, register
from hetfl.fl.payload import Payload
from hetfl.methods.fedavg import ROUND_DEFAULTS, ROUND_RANGES, FedAvgRounds

BUFFER = "buffer."


@register("fedgkd")
class FedGKD(FedAvgRounds):
    name = "fedgkd"
    defaults = {**ROUND_DEFAULTS, "gamma": 0.2, "temperature": 2.0, "buffer_length": 5}
    ranges = {**ROUND_RANGES, "gamma": {"ge": 0}, "buffer_length": {"ge": 1}}

    def setup(self, ctx: ServerContext) -> None:
        super().setup(ctx)
        self.buffer: list[dict[str, torch.Tensor]] = []

    def teacher(self) -> dict[str, torch.Tensor] | None:
        """The uniform average of the buffered global models (None while the buffer is empty)."""
        return weighted_average(self.buffer, [1.0] * len(self.buffer)) if self.buffer else None

    def client_message(self, client_id: int, round_: int, ctx: ServerContext) -> Payload:
        message = super().client_message(client_id, round_, ctx)
        teacher = self.teacher()
        if teacher is not None and self.params["gamma"] > 0:
            message.tensors.update({f"teacher/{k}": v.detach().cpu() for k, v in teacher.items()})
        return message

    def terms(self, client_id: int, round_: int, ctx: ServerContext) -> dict[str, dict[str, Any]]:
        if not self.buffer or self.params["gamma"] <= 0:
            return {}
        return {"kd": {"weight": self.params["gamma"] / 2, "temperature": self.params["temperature"]}}

    def aggregate(self, round_: int, uploads: dict[int, Payload], ctx: ServerContext) -> None:
        super().aggregate(round_, uploads, ctx)
        self.buffer.append({k: v.detach().clone() for k, v in self.global_model.state_dict().items()})
        del self.buffer[: -int(self.params["buffer_length"])]

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = super().state_dict()
        for i, state in enumerate(self.buffer):
            out.update({f"{BUFFER}{i}.{k}": v for k, v in state.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        found: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            if key.startswith(BUFFER):
                index, _, name = key[len(BUFFER):].partition(".")
                found.setdefault(int(index), {})[name] = value.clone()
        self.buffer = [found[i] for i in sorted(found)]
