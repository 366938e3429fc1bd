"""Resumable training loops: one safetensors file per loop, keyed by what determines its result.

Every checkpoint here is written atomically (:meth:`Payload.write`), without pickle, and read back
only when it was written for the same training: a file of another configuration, or one that cannot
be read, is ignored with a warning and the loop starts over. On the same device and thread count a
resumed loop ends with the same bits as one that was never stopped (tested for each).

:class:`TrainCheckpoint` is a client's local training (:func:`hetfl.fl.training.local_train`): the
model, the SGD momentum buffers, the random streams and the :class:`TrainState` (epoch, step, loss so
far), saved every ``every_s`` seconds and when the process is asked to stop.

:class:`StageCheckpoint` keeps what a server-side training loop needs to go on where it stopped:
the model's state, the optimiser's state, the loop's batch generator, the default random streams
(dropout draws from them: VGG-9's classifier), the steps (or epochs) done, the evaluations so far and
the wall seconds spent. FedDF's distillation steps and FedMHO's / FedCVAE's training on the synthetic
set use it; the generator family's loop (:mod:`hetfl.fl.datafree`) keeps its own checkpoint, which
also holds the synthetic pool and the generator.

Shared pieces: an optimiser's per-parameter states as named tensors (:func:`optimizer_tensors`,
:func:`momentum_tensors` and their loaders) and :func:`stop_deferred`, which holds SIGINT and SIGTERM
back until a loop has finished its step and saved.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetfl.fl.payload import Payload, PayloadError
from hetfl.fl.train_config import TrainConfig


# ---- optimiser states as tensors -----------------------------------------------------------------
def momentum_tensors(opt: torch.optim.Optimizer, prefix: str) -> dict[str, torch.Tensor]:
    """An SGD optimiser's momentum buffers as ``{prefix + parameter index: buffer}`` (for a checkpoint;
    parameters without one yet are left out)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    return {f"{prefix}{i}": opt.state[p]["momentum_buffer"] for i, p in enumerate(params)
            if opt.state.get(p, {}).get("momentum_buffer") is not None}


def load_momentum(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    """Set the buffers :func:`momentum_tensors` wrote (other keys are ignored); raises ValueError, before
    changing anything, for a buffer that does not fit its parameter."""
    params = [p for group in opt.param_groups for p in group["params"]]
    found = {int(k[len(prefix):]): v for k, v in tensors.items()
             if k.startswith(prefix) and k[len(prefix):].isdigit()}
    bad = [i for i, v in found.items() if i >= len(params) or v.shape != params[i].shape]
    if bad:
        raise ValueError(f"momentum buffers {bad} do not fit the optimiser's parameters")
    for i, buf in found.items():
        opt.state[params[i]]["momentum_buffer"] = buf.to(params[i].device).clone()


def _params(opt: torch.optim.Optimizer, params: list[torch.Tensor] | None) -> list[torch.Tensor]:
    return params if params is not None else [p for group in opt.param_groups for p in group["params"]]


def optimizer_tensors(opt: torch.optim.Optimizer, prefix: str,
                      params: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every per-parameter state of an optimiser (Adam's ``step``, ``exp_avg``, ``exp_avg_sq``; SGD's
    momentum) as ``{prefix + parameter index + "." + name: tensor}``, for a checkpoint; ``params``: only
    these of its parameters, indexed in this order (default: all, in the optimiser's order)."""
    params = _params(opt, params)
    return {f"{prefix}{i}.{name}": torch.as_tensor(value) for i, p in enumerate(params)
            for name, value in opt.state.get(p, {}).items() if value is not None}


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], prefix: str,
                           params: list[torch.Tensor] | None = None) -> None:
    """Set the states :func:`optimizer_tensors` wrote (with the same ``params``; other keys are ignored);
    raises ValueError, before changing anything, for a state of a parameter that is not there or of
    another shape."""
    params = _params(opt, params)
    found: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        index, _, name = k[len(prefix):].partition(".")
        if k.startswith(prefix) and index.isdigit() and name:
            found.setdefault(int(index), {})[name] = v
    bad = [i for i, state in found.items() if i >= len(params)
           or any(v.dim() and v.shape != params[i].shape for v in state.values())]
    if bad:
        raise ValueError(f"optimiser states {bad} do not fit the optimiser's parameters")
    for i, state in found.items():
        # a scalar (Adam's step) stays on the CPU, where a non-fused, non-capturable Adam keeps it
        opt.state[params[i]] = {name: (v.to(params[i].device) if v.dim() else v.cpu()).clone()
                                for name, v in state.items()}


# ---- stopping at a step's end --------------------------------------------------------------------
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_deferred(notice: str | None = None) -> Iterator[Callable[[], signal.Signals | None]]:
    """Hold SIGINT and SIGTERM back inside the block: a signal that arrives is only recorded, and the
    function yielded returns it (None while none came), so that a loop can finish its step, save and
    leave the block (raising KeyboardInterrupt). On the way out the previous handlers come back and a
    recorded signal is delivered to them: Python's SIGINT handler raises KeyboardInterrupt, the default
    SIGTERM ends the process. Outside the main thread (where handlers cannot be set) and for a signal
    the process ignores, nothing changes. ``notice``, when given, is printed to stderr on the first
    signal (for a step long enough that a silent wait would look like a hang)."""
    got: list[signal.Signals] = []
    previous: dict[signal.Signals, Any] = {}

    def record(num: int, _frame: Any) -> None:
        if notice is not None and not got:
            print(f"\n{notice} ({signal.Signals(num).name})", file=sys.stderr, flush=True)
        got.append(signal.Signals(num))

    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, record)
    try:
        yield lambda: got[0] if got else None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if got:
            signal.raise_signal(got[0])


# ---- local training (hetfl.fl.training.local_train) ----------------------------------------------
CHECKPOINT_FORMAT = "hetfl-local-train/2"
_PROGRESS = ("epoch", "step", "count", "loss", "seconds")  # what a checkpoint's metadata adds to its description


@dataclass
class TrainState:
    """Where a local training stands: ``step`` batches of epoch ``epoch`` (0-based) done, ``batches``
    the batch-order generator's state at that epoch's start (its order is drawn again on a resume and
    the done batches skipped), ``total`` / ``count`` the epoch's loss sum so far, ``loss`` the last
    finished epoch's mean loss, ``seconds`` the training time so far, all resumed parts together."""

    epoch: int = 0
    step: int = 0
    batches: torch.Tensor | None = None
    total: float = 0.0
    count: int = 0
    loss: float = float("nan")
    seconds: float = 0.0


@dataclass(frozen=True)
class TrainCheckpoint:
    """Where :func:`~hetfl.fl.training.local_train` keeps a resumable state of a long local training,
    and how often.

    After a step, when ``every_s`` seconds have passed since the last save, and when the process was
    asked to stop (SIGINT or SIGTERM: :func:`stop_deferred`), one safetensors file at ``path`` receives
    the model's state, the SGD momentum buffers, the default CPU (and, on a GPU, the device's) random
    state that dropout draws from and the :class:`TrainState`: no pickle, written atomically. A later
    ``local_train`` with the same checkpoint path goes on from that step, and on the same device
    with the same thread count it ends with the same bits as a run that was never stopped (tested). The
    caller keys ``path`` by everything that determines the training (the simulator: the upload-cache
    key) and deletes it once the result is safe (:meth:`clear`). A file that cannot be read, or that was
    written for another model, optimiser or configuration, is ignored with a warning: training starts
    over."""

    path: Path
    every_s: float = 120.0

    def _describe(self, cfg: TrainConfig, seed: int) -> dict[str, Any]:
        return {"format": CHECKPOINT_FORMAT, "config": cfg.to_dict(), "seed": seed}

    def save(self, state: TrainState, model: nn.Module, opt: torch.optim.Optimizer, device: torch.device,
             cfg: TrainConfig, seed: int) -> None:
        tensors = {f"model.{k}": v for k, v in model.state_dict().items()} | momentum_tensors(opt, "momentum.")
        tensors["rng.batches"] = state.batches
        tensors["rng.cpu"] = torch.get_rng_state()
        tensors["epoch_loss"] = torch.tensor([state.total], dtype=torch.float64)
        if device.type == "cuda":
            tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
        meta = {**self._describe(cfg, seed), "epoch": state.epoch, "step": state.step, "count": state.count,
                "loss": state.loss, "seconds": state.seconds}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        Payload(tensors, meta).write(self.path)  # atomic: an interrupted save leaves the previous checkpoint

    def load(self, model: nn.Module, opt: torch.optim.Optimizer, device: torch.device, cfg: TrainConfig,
             seed: int) -> TrainState | None:
        """Restore a saved state into ``model``, ``opt`` and the default random streams and return
        where the training stands, or None where there is nothing usable (nothing is then changed)."""
        if not self.path.is_file():
            return None
        try:
            saved = Payload.from_bytes(self.path.read_bytes())
            if {k: v for k, v in saved.meta.items() if k not in _PROGRESS} != self._describe(cfg, seed):
                raise PayloadError("written for another training configuration or seed")
            weights = {k[len("model."):]: v for k, v in saved.tensors.items() if k.startswith("model.")}
            if {k: v.shape for k, v in weights.items()} != {k: v.shape for k, v in model.state_dict().items()}:
                raise PayloadError("its model state has other names or shapes")
            if "rng.cuda" in saved.tensors and device.type != "cuda":
                raise PayloadError("written on a GPU")
            if not {"rng.batches", "rng.cpu", "epoch_loss"} <= set(saved.tensors):
                raise PayloadError("it lacks the random states or the epoch's loss")
            m = saved.meta
            state = TrainState(int(m["epoch"]), int(m["step"]), saved.tensors["rng.batches"],
                               float(saved.tensors["epoch_loss"][0]), int(m["count"]), float(m["loss"]),
                               float(m["seconds"]))
            load_momentum(opt, saved.tensors, "momentum.")  # last: it changes the optimiser once it fits
        except (PayloadError, ValueError, KeyError, TypeError) as err:
            warnings.warn(f"local training checkpoint {self.path} not used ({err}); training starts over",
                          stacklevel=3)
            return None
        model.load_state_dict(weights)
        torch.set_rng_state(saved.tensors["rng.cpu"])
        if "rng.cuda" in saved.tensors:
            torch.cuda.set_rng_state(saved.tensors["rng.cuda"], device)
        return state

    def saved_seconds(self) -> float:
        """The training time the saved steps took, from the file's header alone (0 without a readable
        checkpoint)."""
        try:
            return float(Payload.read_meta(self.path).get("seconds", 0.0))
        except (OSError, PayloadError, ValueError, TypeError):
            return 0.0

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


# ---- server loops --------------------------------------------------------------------------------
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
