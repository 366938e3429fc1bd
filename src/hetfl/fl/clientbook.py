"""The server's records over all N clients of a multi-round method.

Per client: the last round it took part in (``-1`` before), how often it took part, its sample
count and label histogram (from its accepted uploads' metadata), and, where the method asks, its
last accepted model. Only accepted uploads update it, so a rejected or missing client counts as
no participation. Everything is tensors, so it travels in the method's ``state_dict`` and with the
round checkpoint.

Kept models stay in memory up to ``memory_limit`` bytes; past it, a model goes to ``spill_dir`` as
one safetensors file per (client, round), written atomically and read back on demand. The round
checkpoint then names the file's round instead of holding the tensors. A file the latest
checkpoint may still name is deleted only at the next round's :meth:`ClientBook.update`, after that
round's checkpoint replaced it, so a run stopped anywhere resumes from files that exist; loading a
checkpoint deletes the files it does not name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from hetfl.fl.payload import Payload

DEFAULT_MEMORY_LIMIT = 2 * 2**30  # bytes of kept models held in memory before spilling to disk
SPILL_DIR = "clientbook"  # the spilled models' folder in a method's run folder (RoundMethod.start)


def _nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class ClientBook:
    """Records of ``num_clients`` clients over ``num_classes`` classes (module docstring)."""

    def __init__(self, num_clients: int, num_classes: int, keep_models: bool = False,
                 spill_dir: Path | None = None, memory_limit: int = DEFAULT_MEMORY_LIMIT) -> None:
        if memory_limit < 0:
            raise ValueError(f"memory_limit must be >= 0 bytes, got {memory_limit}")
        self.last_round = torch.full((num_clients,), -1, dtype=torch.int64)
        self.participations = torch.zeros(num_clients, dtype=torch.int64)
        self.samples = torch.zeros(num_clients, dtype=torch.int64)
        self.histograms = torch.zeros(num_clients, num_classes, dtype=torch.int64)
        self.keep_models = keep_models
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self.memory_limit = memory_limit
        self._memory: dict[int, dict[str, torch.Tensor]] = {}  # client -> its last accepted model state
        self._spilled = torch.full((num_clients,), -1, dtype=torch.int64)  # round of the client's file, -1: none
        self._obsolete: list[Path] = []  # files the latest checkpoint may still name

    # ---- records ----------------------------------------------------------------------------------
    def update(self, round_: int, uploads: Mapping[int, Payload]) -> None:
        """Record this round's accepted uploads."""
        for path in self._obsolete:  # the previous round's checkpoint no longer names them
            path.unlink(missing_ok=True)
        self._obsolete = []
        for cid, upload in uploads.items():
            self.last_round[cid] = round_
            self.participations[cid] += 1
            if "num_samples" in upload.meta:
                self.samples[cid] = int(upload.meta["num_samples"])
            if "label_counts" in upload.meta:
                self.histograms[cid] = torch.as_tensor(upload.meta["label_counts"], dtype=torch.int64)
            if self.keep_models:
                self._store(cid, round_, {k: v.detach().cpu().clone() for k, v in upload.tensors.items()})

    def seen(self) -> list[int]:
        """Clients with at least one accepted upload."""
        return torch.nonzero(self.participations > 0).flatten().tolist()

    # ---- kept models ------------------------------------------------------------------------------
    def model(self, cid: int) -> dict[str, torch.Tensor] | None:
        """Client ``cid``'s last accepted model (read from disk if spilled), None if none is kept."""
        if cid in self._memory:
            return self._memory[cid]
        if int(self._spilled[cid]) >= 0:
            return Payload.from_bytes(self._file(cid, int(self._spilled[cid])).read_bytes()).tensors
        return None

    def stored(self) -> list[int]:
        """Clients with a kept model, in memory or on disk."""
        return sorted(set(self._memory) | set(self.spilled()))

    def spilled(self) -> list[int]:
        """Clients whose kept model is on disk."""
        return torch.nonzero(self._spilled >= 0).flatten().tolist()

    def memory_bytes(self) -> int:
        return sum(_nbytes(s) for s in self._memory.values())

    def _file(self, cid: int, round_: int) -> Path:
        assert self.spill_dir is not None
        return self.spill_dir / f"client-{cid}-round-{round_}.safetensors"

    def _store(self, cid: int, round_: int, state: dict[str, torch.Tensor]) -> None:
        self._memory.pop(cid, None)
        if int(self._spilled[cid]) >= 0 and int(self._spilled[cid]) != round_:
            self._obsolete.append(self._file(cid, int(self._spilled[cid])))
        if self.spill_dir is None or self.memory_bytes() + _nbytes(state) <= self.memory_limit:
            self._memory[cid], self._spilled[cid] = state, -1
        else:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            Payload(state, {"client": cid, "round": round_}).write(self._file(cid, round_))
            self._spilled[cid] = round_

    # ---- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"last_round": self.last_round, "participations": self.participations,
               "samples": self.samples, "histograms": self.histograms, "spilled": self._spilled}
        for cid, state in self._memory.items():
            out.update({f"model.{cid}.{k}": v for k, v in state.items()})
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for key in ("last_round", "participations", "samples", "histograms"):
            getattr(self, key).copy_(state[key])
        self._spilled = (state["spilled"].clone() if "spilled" in state
                         else torch.full_like(self.last_round, -1))
        for cid in self.spilled():
            if self.spill_dir is None or not self._file(cid, int(self._spilled[cid])).is_file():
                raise ValueError(f"client {cid}'s kept model (round {int(self._spilled[cid])}) is not in "
                                 f"{self.spill_dir}")
        self._memory, self._obsolete = {}, []
        if self.spill_dir is not None and self.spill_dir.is_dir():  # files this checkpoint does not name go
            named = {self._file(cid, int(self._spilled[cid])) for cid in self.spilled()}
            for path in self.spill_dir.glob("client-*.safetensors"):
                if path not in named:
                    path.unlink(missing_ok=True)
        for key, value in state.items():
            if key.startswith("model."):
                _, cid, name = key.split(".", 2)
                self._memory.setdefault(int(cid), {})[name] = value.cpu()
