"""Clients' state kept by the engine for one method's run (MOON's and FedCOG's previous local model, ...).

In memory up to ``memory_limit`` bytes of tensors; beyond it, at the end of a round, the states used least
recently go to ``spill_dir`` (one safetensors file each, its non-tensor values as JSON) and come back when
their client is asked again. A spilled file is never rewritten: a client spilled again gets a new file
(named by the round), and the old one is deleted once a checkpoint that no longer names it is written
(:meth:`ClientStates.committed`), so a round checkpoint plus the files it names is always a whole state.
With 10,000 clients of which a few take part per round, memory then holds what the recent rounds touched.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch

from hetfl.fl.payload import Payload, PayloadError

STATE_DIR = "client_state"  # the spilled states' folder in a method's run folder


def state_bytes(state: Mapping[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


class ClientStates(MutableMapping[int, dict[str, Any]]):
    """``{client: state}`` whose states past ``memory_limit`` bytes live on disk (module docstring)."""

    def __init__(self, spill_dir: Path | None = None, memory_limit: int = 2048 * 2**20) -> None:
        if memory_limit < 0:
            raise ValueError(f"memory_limit must be >= 0 bytes, got {memory_limit}")
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self.memory_limit = memory_limit
        self._memory: dict[int, dict[str, Any]] = {}  # least recently used first
        self._files: dict[int, str] = {}  # spilled client -> its file in spill_dir
        self._obsolete: list[Path] = []  # files the latest checkpoint may still name

    # ---- the mapping ---------------------------------------------------------------------------------
    def __getitem__(self, cid: int) -> dict[str, Any]:
        if cid in self._memory:
            self._memory[cid] = self._memory.pop(cid)  # most recently used now
            return self._memory[cid]
        if cid in self._files:
            path = self._path(self._files.pop(cid))
            saved = Payload.from_bytes(path.read_bytes())
            self._obsolete.append(path)
            self._memory[cid] = {**saved.meta.get("values", {}), **saved.tensors}
            return self._memory[cid]
        raise KeyError(cid)

    def __setitem__(self, cid: int, state: dict[str, Any]) -> None:
        if cid in self._files:
            self._obsolete.append(self._path(self._files.pop(cid)))
        self._memory.pop(cid, None)
        self._memory[cid] = state

    def __delitem__(self, cid: int) -> None:
        if cid not in self:
            raise KeyError(cid)
        self[cid] = {}
        del self._memory[cid]

    def __contains__(self, cid: object) -> bool:
        return cid in self._memory or cid in self._files

    def __iter__(self) -> Iterator[int]:
        return iter(sorted({*self._memory, *self._files}))

    def __len__(self) -> int:
        return len({*self._memory, *self._files})

    # ---- memory and disk ------------------------------------------------------------------------------
    def _path(self, name: str) -> Path:
        assert self.spill_dir is not None
        return self.spill_dir / name

    @property
    def memory_bytes(self) -> int:
        return sum(state_bytes(s) for s in self._memory.values())

    def spill(self, round_: int) -> list[int]:
        """Write the least recently used states to disk until memory holds at most ``memory_limit`` bytes;
        returns the clients spilled. Without a ``spill_dir`` everything stays in memory."""
        if self.spill_dir is None:
            return []
        total, spilled = self.memory_bytes, []
        for cid in list(self._memory):
            if total <= self.memory_limit:
                break
            state = self._memory.pop(cid)
            total -= state_bytes(state)
            tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
            values = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
            name = f"state-{cid}-r{round_}.safetensors"
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            Payload(tensors, {"client": cid, "values": values}).write(self._path(name))
            self._files[cid] = name
            spilled.append(cid)
        return spilled

    def in_memory(self) -> dict[int, dict[str, Any]]:
        return dict(self._memory)

    def files(self) -> dict[str, str]:
        """``{client: file}`` of the spilled states (what a checkpoint names)."""
        return {str(c): n for c, n in sorted(self._files.items())}

    def committed(self) -> None:
        """A checkpoint naming :meth:`files` is written: the files it no longer names can go."""
        for path in self._obsolete:
            path.unlink(missing_ok=True)
        self._obsolete = []

    def restore(self, memory: Mapping[int, dict[str, Any]], files: Mapping[str, str]) -> None:
        """A checkpoint's states: those it held and the spilled files it names (PayloadError if one is gone)."""
        for name in files.values():
            if self.spill_dir is None or not self._path(name).is_file():
                raise PayloadError(f"the client state file {name} the checkpoint names is missing")
        self._memory = {int(c): dict(s) for c, s in memory.items()}
        self._files = {int(c): n for c, n in files.items()}
