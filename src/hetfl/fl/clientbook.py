"""The server's records over all N clients of a multi-round method.

Per client: the last round it took part in (``-1`` before), how often it took part, its sample
count and label histogram (from its accepted uploads' metadata), and, where the method asks, its
last accepted model. Only accepted uploads update it, so a rejected or missing client counts as
no participation. Everything is tensors, so it travels in the method's ``state_dict`` and with the
round checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hetfl.fl.payload import Payload


class ClientBook:
    """Records of ``num_clients`` clients over ``num_classes`` classes (module docstring)."""

    def __init__(self, num_clients: int, num_classes: int, keep_models: bool = False) -> None:
        self.last_round = torch.full((num_clients,), -1, dtype=torch.int64)
        self.participations = torch.zeros(num_clients, dtype=torch.int64)
        self.samples = torch.zeros(num_clients, dtype=torch.int64)
        self.histograms = torch.zeros(num_clients, num_classes, dtype=torch.int64)
        self.keep_models = keep_models
        self.models: dict[int, dict[str, torch.Tensor]] = {}  # client -> its last accepted model state

    def update(self, round_: int, uploads: Mapping[int, Payload]) -> None:
        """Record this round's accepted uploads."""
        for cid, upload in uploads.items():
            self.last_round[cid] = round_
            self.participations[cid] += 1
            if "num_samples" in upload.meta:
                self.samples[cid] = int(upload.meta["num_samples"])
            if "label_counts" in upload.meta:
                self.histograms[cid] = torch.as_tensor(upload.meta["label_counts"], dtype=torch.int64)
            if self.keep_models:
                self.models[cid] = {k: v.detach().cpu().clone() for k, v in upload.tensors.items()}

    def seen(self) -> list[int]:
        """Clients with at least one accepted upload."""
        return torch.nonzero(self.participations > 0).flatten().tolist()

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"last_round": self.last_round, "participations": self.participations,
               "samples": self.samples, "histograms": self.histograms}
        for cid, state in self.models.items():
            out.update({f"model.{cid}.{k}": v for k, v in state.items()})
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for key in ("last_round", "participations", "samples", "histograms"):
            getattr(self, key).copy_(state[key])
        self.models = {}
        for key, value in state.items():
            if key.startswith("model."):
                _, cid, name = key.split(".", 2)
                self.models.setdefault(int(cid), {})[name] = value.cpu()
