"""Resumable server loops: one safetensors file per loop, keyed by what determines its result.

:class:`StageCheckpoint` keeps what a server-side training loop needs to go on where it stopped:
the model's state, the optimiser's state, the loop's batch generator, the default random streams
(dropout draws from them: VGG-9's classifier), the steps (or epochs) done, the evaluations so far and
the wall seconds spent. It is written atomically (:meth:`Payload.write`), without pickle, and read
back only when its ``key`` matches: a file of another configuration, or one that cannot be read, is
ignored with a warning and the loop starts over. On the same device and thread count a resumed loop
ends with the same bits as one that was never stopped (FedDF's and FedMHO's tests).

FedDF's distillation steps and FedMHO's / FedCVAE's training on the synthetic set use it; the
generator family's loop (:mod:`hetfl.fl.datafree`) keeps its own checkpoint, which also holds the
synthetic pool and the generator.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hetfl.fl.payload import Payload, PayloadError
from hetfl.fl.training import load_optimizer_tensors, optimizer_tensors


def load_matching(path: Path, key: str) -> Payload | None:
    """The payload at ``path`` if it was written for ``key``; None (with a warning for a file that
    cannot be read or belongs to another run) otherwise."""
    if not path.is_file():
        return None
    try:
        saved = Payload.from_bytes(path.read_bytes())
    except PayloadError as err:
        warnings.warn(f"{path} not used ({err}); starting over", stacklevel=3)
        return None
    if saved.meta.get("key") != key:
        warnings.warn(f"{path} not used (written for another configuration); starting over", stacklevel=3)
        return None
    return saved


@dataclass
class Resumed:
    """Where a loop stands after :meth:`StageCheckpoint.load`: nothing done yet, or a saved state."""

    done: int = 0  # steps or epochs finished before this run
    history: list[float] = field(default_factory=list)  # the evaluations so far
    seconds: float = 0.0  # wall seconds spent on them


@dataclass
class StageCheckpoint:
    """A loop's state at ``path``, written for ``key``, at most every ``every_s`` seconds (module
    docstring). ``due(final)`` says when to :meth:`save`; :meth:`clear` removes the file once the
    loop's result is safe."""

    path: Path
    key: str
    every_s: float = 120.0
    _saved_at: float = field(default_factory=time.monotonic, init=False, repr=False)

    def due(self, final: bool = False) -> bool:
        return final or time.monotonic() - self._saved_at >= self.every_s

    def save(self, model: nn.Module, opt: torch.optim.Optimizer, batches: torch.Generator, done: int,
             history: list[float], seconds: float) -> None:
        tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
        tensors |= optimizer_tensors(opt, "opt.")
        tensors |= {"rng.batches": batches.get_state(), "rng.cpu": torch.get_rng_state()}
        device = next(model.parameters()).device
        if device.type == "cuda":
            tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        Payload(tensors, {"key": self.key, "done": done, "history": list(history), "seconds": seconds}).write(self.path)
        self._saved_at = time.monotonic()

    def load(self, model: nn.Module, opt: torch.optim.Optimizer, batches: torch.Generator) -> Resumed:
        """Restore a saved state into ``model``, ``opt``, ``batches`` and the default random streams;
        :class:`Resumed` () when there is none for this key."""
        saved = load_matching(self.path, self.key)
        if saved is None:
            return Resumed()
        t = saved.tensors
        weights = {k[len("model."):]: v for k, v in t.items() if k.startswith("model.")}
        problem = None
        if "rng.batches" not in t or not {"done", "history"} <= set(saved.meta):
            problem = "it lacks the loop's progress (an older format)"
        elif {k: v.shape for k, v in weights.items()} != {k: v.shape for k, v in model.state_dict().items()}:
            problem = "its model state has other names or shapes"
        if problem is not None:
            warnings.warn(f"{self.path} not used ({problem}); starting over", stacklevel=2)
            return Resumed()
        try:
            load_optimizer_tensors(opt, t, "opt.")  # first: it raises on a mismatch before anything changed
        except ValueError as err:
            warnings.warn(f"{self.path} not used ({err}); starting over", stacklevel=2)
            return Resumed()
        model.load_state_dict(weights)
        batches.set_state(t["rng.batches"])
        if "rng.cpu" in t:
            torch.set_rng_state(t["rng.cpu"])
        device = next(model.parameters()).device
        if "rng.cuda" in t and device.type == "cuda":
            torch.cuda.set_rng_state(t["rng.cuda"], device)
        self._saved_at = time.monotonic()
        return Resumed(int(saved.meta["done"]), [float(a) for a in saved.meta["history"]],
                       float(saved.meta.get("seconds", 0.0)))

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
