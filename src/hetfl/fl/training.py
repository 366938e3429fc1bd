"""Local training and evaluation shared by every method.

``local_train`` is plain seeded minibatch SGD over an in-memory :class:`ImageDataset`; methods that
change the local objective (FedProx, MOON, KD terms, ...) pass ``loss_fn`` instead of copying the
loop. ``evaluate`` gives top-1 and per-class accuracy on a test split.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.data.base import ImageDataset
from hetfl.fl.payload import Payload, PayloadError

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainConfig:
    """Local optimiser settings (the paper defaults of DENSE/FedHydra client training)."""

    epochs: int = 20
    batch_size: int = 128
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    grad_clip: float | None = None
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    channels_last: bool = True  # 1.7x faster cnn2 training on AVX-512 CPUs, same accuracy

    def __post_init__(self) -> None:
        if self.epochs < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"bad local training config: {self}")
        check_precision(self.precision)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRECISIONS = ("fp32", "bf16")


def check_precision(precision: object, key: str = "precision") -> None:
    """The one check of a precision setting (named ``key`` in the message), shared by every loop that
    autocasts."""
    if precision not in PRECISIONS:
        raise ValueError(f"{key} must be fp32 or bf16, got {precision!r}")


def check_compile(device: torch.device) -> None:
    """``torch.compile`` on a CPU generates C++: fail before any training where no compiler is found."""
    compilers = (os.environ.get("CXX"), "g++", "c++", "clang++")
    if device.type == "cpu" and not any(c and shutil.which(c) for c in compilers):
        raise ValueError("compile: true needs a C++ compiler (g++, c++ or clang++ on the PATH, or $CXX) for "
                         "torch.compile on a CPU; set compile: false")


@functools.cache
def bf16_native(device_type: str) -> bool:
    """Whether bf16 convolutions and matmuls run on native kernels on this kind of device. A CPU needs
    oneDNN's bf16 instructions (AVX-512 or AMX); without them torch emulates bf16, many times slower
    than fp32 (measured on a 2-core AVX2 EPYC: a VGG-9 training step at batch 128 took 71-82 s in
    bf16 autocast against 1.9-2.0 s in fp32, inference on 1,000 images 18.0 s against 2.7 s)."""
    if device_type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # private op: fall back on the reported ISA
            return torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX"))
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return True


_WARNED_EMULATED: set[str] = set()


def warn_if_bf16_emulated(device: torch.device) -> None:
    """One ``RuntimeWarning`` per process and device kind when bf16 is asked of a device that only
    emulates it: the run is correct but may take tens of times longer than in fp32."""
    if device.type in _WARNED_EMULATED or bf16_native(device.type):
        return
    _WARNED_EMULATED.add(device.type)
    isa = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else device.type
    warnings.warn(f"precision bf16 on a {device.type} without native bf16 kernels ({isa}): torch emulates "
                  "them, many times slower than fp32 (a VGG-9 training step 37x slower on an AVX2 CPU). "
                  "Use precision fp32 on this machine; bf16 results compare only with bf16 runs.",
                  RuntimeWarning, stacklevel=3)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``precision == "bf16"`` (warning once where bf16 is emulated), else nothing."""
    if precision == "bf16":
        warn_if_bf16_emulated(device)
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def prepare(model: nn.Module, device: torch.device, channels_last: bool) -> nn.Module:
    model = model.to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def minibatches(n: int, batch_size: int, generator: torch.Generator, shuffle: bool = True,
                min_batch: int = 2) -> Iterator[torch.Tensor]:
    """Index batches over ``range(n)``; a trailing batch smaller than ``min_batch`` is dropped
    (BatchNorm cannot train on one sample)."""
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    for start in range(0, n, batch_size):
        idx = order[start : start + batch_size]
        if len(idx) >= min(min_batch, n):
            yield idx


def cross_entropy_loss(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


CHECKPOINT_FORMAT = "hetfl-local-train/2"
_PROGRESS = ("epoch", "step", "count", "loss", "seconds")  # what a checkpoint's metadata adds to its description


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
    """Where :func:`local_train` keeps a resumable state of a long local training, and how often.

    After a step, when ``every_s`` seconds have passed since the last save, and when the process was
    asked to stop (SIGINT or SIGTERM: :func:`stop_deferred`), one safetensors file at ``path`` receives
    the model's state, the SGD momentum buffers, the default CPU (and, on a GPU, the device's) random
    state that dropout draws from and the :class:`TrainState`: no pickle, written atomically. A later
    :func:`local_train` with the same checkpoint path goes on from that step, and on the same device
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


@contextlib.contextmanager
def weights_frozen(model: nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s trainable parameters do not require gradients, so a backward
    pass through it computes the gradient of its input only (the weight gradients of its layers are
    skipped; the input gradient is the same to the bit). They require gradients again on the way out."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in trainable:
            p.requires_grad_(True)


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


def local_train(
    model: nn.Module,
    data: ImageDataset,
    cfg: TrainConfig,
    device: torch.device,
    seed: int,
    loss_fn: LossFn = cross_entropy_loss,
    progress: Callable[[int, float], None] | None = None,
    checkpoint: TrainCheckpoint | None = None,
) -> dict[str, float]:
    """Train ``model`` in place on ``data`` for ``cfg.epochs`` epochs; returns the last epoch's mean loss.
    With ``checkpoint``, go on from a saved step if there is one, save every ``every_s`` seconds, and
    on SIGINT or SIGTERM save before stopping (:class:`TrainCheckpoint`)."""
    generator = torch.Generator().manual_seed(seed)
    model = prepare(model, device, cfg.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    state = (checkpoint.load(model, opt, device, cfg, seed) if checkpoint is not None else None) or TrainState()
    if state.batches is not None:
        generator.set_state(state.batches)
    with stop_deferred() if checkpoint is not None else contextlib.nullcontext(lambda: None) as stop:
        began = saved_at = time.monotonic()
        done_before = state.seconds
        for epoch in range(state.epoch, cfg.epochs):
            if epoch > state.epoch or state.batches is None:
                state = TrainState(epoch, 0, generator.get_state(), loss=state.loss, seconds=state.seconds)
            # the loss sum stays on the device: no host-device sync per step on a GPU, one per epoch
            total = torch.full((), state.total, dtype=torch.float64, device=device)
            for step, idx in enumerate(minibatches(len(data), cfg.batch_size, generator)):
                if step < state.step:
                    continue  # done before the resume
                x, y = data.batch(idx, device)
                if cfg.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                with autocast(device, cfg.precision):
                    loss = loss_fn(model, x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip:
                    nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                total += loss.detach().double() * len(idx)
                state.step, state.count = step + 1, state.count + len(idx)
                if checkpoint is not None and ((got := stop()) or time.monotonic() - saved_at >= checkpoint.every_s):
                    saved_at = time.monotonic()
                    state.total, state.seconds = float(total), done_before + saved_at - began
                    checkpoint.save(state, model, opt, device, cfg, seed)
                    if got:
                        raise KeyboardInterrupt  # leaves the block, which delivers the signal
            state.loss = float(total) / max(state.count, 1)
            if progress is not None:
                progress(epoch + 1, state.loss)
    return {"loss": state.loss}


def local_train_group(
    models: list[nn.Module],
    datasets: list[ImageDataset],
    cfg: TrainConfig,
    device: torch.device,
    seeds: list[int],
    progress: Callable[[int, float], None] | None = None,
) -> list[dict[str, float]]:
    """:func:`local_train` of several clients at once: each model on its own data with its own batch
    order (``seeds``), as one vectorised network (``torch.func.vmap`` over the stacked parameters, so a
    convolution runs as one grouped convolution over the clients). Client k's loss, gradient, BN
    statistics and SGD update are its own: a step minimises the sum of the clients' losses, whose
    gradient with respect to client k's parameters is client k's alone. On a GPU, where one client's
    small kernels leave most of the device idle, this trades K launches for one; on a CPU it does not
    pay (docs/BENCHMARKS.md). The models are updated in place and handed back in the default layout.

    The clients run their epochs in lockstep. Step t of an epoch takes every client that still has a
    t-th batch; clients whose batches differ in size at that step (a last, smaller batch) run as
    separate vmapped groups, and a client without a batch is left as it is. So clients of different
    data sizes train exactly as alone; the largest sets the number of steps. The SGD step is
    torch's (momentum buffer started from the first gradient, weight decay added to the gradient),
    applied to the clients that took that step only.

    Needs one architecture (the same parameter and buffer names and shapes). The cross-entropy loss
    only; ``channels_last`` is not applied (the stacked input is 5-d). Compared with the one-client
    loop the updates are equal up to float summation order (tested); randomness inside the model
    (dropout) draws from another stream, so a model with dropout gets other, equally likely, bits."""
    if not models or len(models) != len(datasets) or len(models) != len(seeds):
        raise ValueError(f"local_train_group needs one dataset and one seed per model, got {len(models)} "
                         f"models, {len(datasets)} datasets and {len(seeds)} seeds")
    if any(len(d) == 0 for d in datasets):
        raise ValueError("local_train_group needs a non-empty dataset per client")
    shapes = [{k: tuple(v.shape) for k, v in m.state_dict().items()} for m in models]
    if any(s != shapes[0] for s in shapes[1:]) or len({type(m) for m in models}) != 1:
        raise ValueError("local_train_group needs models of one architecture (the same state names and shapes)")
    from torch.func import functional_call, stack_module_state, vmap

    models = [m.to(device).train() for m in models]
    params, buffers = stack_module_state(models)  # leaves of shape (K, ...)
    skeleton = copy.deepcopy(models[0]).to("meta")

    def client_loss(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor,
                    y: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(lambda inputs: functional_call(skeleton, (p, b), (inputs,)), x, y)

    losses_of = vmap(client_loss, randomness="different")
    k = len(models)
    sgd = _MaskedSGD(list(params.values()), cfg)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    mean_loss = torch.full((k,), float("nan"))
    for epoch in range(cfg.epochs):
        total = torch.zeros(k, dtype=torch.float64, device=device)  # on the device: one sync per epoch
        batches = [list(minibatches(len(d), cfg.batch_size, g)) for d, g in zip(datasets, generators)]
        for step in range(max(len(b) for b in batches)):
            by_size: dict[int, list[int]] = {}
            for c in range(k):
                if step < len(batches[c]):
                    by_size.setdefault(len(batches[c][step]), []).append(c)
            losses = []
            for size, group in by_size.items():
                pairs = [datasets[c].batch(batches[c][step], device) for c in group]
                x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
                idx = torch.tensor(group, device=device)
                with autocast(device, cfg.precision):
                    loss = _group_losses(losses_of, params, buffers, idx if len(group) < k else None, x, y)
                losses.append(loss)
                total.index_add_(0, idx, loss.detach().double() * size)
            sgd.zero_grad()
            torch.cat(losses).sum().backward()
            if cfg.grad_clip:
                clip_per_client(list(params.values()), cfg.grad_clip)
            stepped = [c for g in by_size.values() for c in g]
            sgd.step(None if len(stepped) == k else torch.isin(torch.arange(k, device=device),
                                                               torch.tensor(stepped, device=device)))
        samples = torch.tensor([sum(len(i) for i in b) for b in batches], dtype=torch.float64)
        mean_loss = total.cpu() / samples.clamp(min=1)
        if progress is not None:
            progress(epoch + 1, float(mean_loss.mean()))
    with torch.no_grad():
        for i, model in enumerate(models):
            for name, tensor in model.named_parameters():
                tensor.copy_(params[name][i])
            for name, tensor in model.named_buffers():
                tensor.copy_(buffers[name][i])
    return [{"loss": float(v)} for v in mean_loss]


def _group_losses(losses_of: Callable[..., torch.Tensor], params: dict[str, torch.Tensor],
                  buffers: dict[str, torch.Tensor], idx: torch.Tensor | None, x: torch.Tensor,
                  y: torch.Tensor) -> torch.Tensor:
    """The vmapped losses of the clients ``idx`` (None: all). All clients: on the stacked tensors,
    whose buffers (BN statistics) update in place; a subset: on gathered copies, whose updated buffers
    are written back."""
    if idx is None:
        return losses_of(params, buffers, x, y)
    some = {n: b.index_select(0, idx) for n, b in buffers.items()}
    losses = losses_of({n: p.index_select(0, idx) for n, p in params.items()}, some, x, y)
    with torch.no_grad():
        for n, b in buffers.items():
            b.index_copy_(0, idx, some[n])
    return losses


class _MaskedSGD:
    """torch's SGD (momentum, dampening 0, weight decay on the gradient, no Nesterov) on stacked
    parameters, stepping only the clients (dimension 0) marked ``active`` (None: all, in place with no
    mask, the common step): the others keep their parameters and momentum buffers."""

    def __init__(self, params: list[torch.Tensor], cfg: TrainConfig) -> None:
        self.params, self.lr, self.momentum, self.weight_decay = params, cfg.lr, cfg.momentum, cfg.weight_decay
        self.buffers: list[torch.Tensor | None] = [None] * len(params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, active: torch.Tensor | None = None) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            mask = None if active is None else active.view(-1, *([1] * (p.dim() - 1)))
            d_p = p.grad.add(p, alpha=self.weight_decay) if self.weight_decay else p.grad
            if self.momentum:
                buf = self.buffers[i]
                if buf is None:  # torch starts the buffer at the first gradient (every client steps first)
                    buf = self.buffers[i] = d_p.clone()
                elif mask is None:
                    buf.mul_(self.momentum).add_(d_p)
                else:
                    buf.copy_(torch.where(mask, buf * self.momentum + d_p, buf))
                d_p = buf
            if mask is None:
                p.sub_(d_p, alpha=self.lr)
            else:
                p.sub_(torch.where(mask, d_p * self.lr, 0.0))


def clip_per_client(stacked: list[torch.Tensor], max_norm: float) -> None:
    """``clip_grad_norm_`` for each client k of stacked parameters (dimension 0): client k's gradients
    are scaled by ``max_norm / norm_k`` where their joint norm exceeds ``max_norm``."""
    grads = [p.grad for p in stacked if p.grad is not None]
    if not grads:
        return
    norms = torch.stack([g.flatten(1).float().pow(2).sum(1) for g in grads]).sum(0).sqrt()
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.view(-1, *([1] * (g.dim() - 1))).to(g.dtype))


@torch.no_grad()
def predict_logits(model: nn.Module, data: ImageDataset, device: torch.device, batch_size: int = 1000,
                   progress: Callable[[Iterable[int]], Iterable[int]] | None = None) -> torch.Tensor:
    """Logits (fp32) of ``model`` on every sample of ``data``, in order; ``progress`` wraps the batch
    starts (e.g. a progress bar for a long pass)."""
    model = model.to(device).eval()
    starts: Iterable[int] = range(0, len(data), batch_size)
    outs = [model(data.batch(torch.arange(s, min(s + batch_size, len(data))), device)[0]).float()
            for s in (progress(starts) if progress is not None else starts)]
    return torch.cat(outs) if outs else torch.zeros(0, data.num_classes)


def accuracy_report(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict[str, Any]:
    """Top-1 accuracy (%) overall and per class; ``per_class`` is None for absent classes."""
    labels = labels.to(logits.device)
    correct = logits.argmax(dim=1) == labels
    hits = torch.bincount(labels[correct], minlength=num_classes).float()
    totals = torch.bincount(labels, minlength=num_classes).float()
    per_class = [None if t == 0 else round(100.0 * float(h / t), 4) for h, t in zip(hits, totals)]
    return {"accuracy": 100.0 * float(correct.float().mean()), "per_class": per_class}


def evaluate(model: nn.Module, data: ImageDataset, device: torch.device) -> dict[str, Any]:
    """Top-1 accuracy (%), per-class accuracy and mean CE loss of ``model`` on ``data``."""
    logits = predict_logits(model, data, device)
    report = accuracy_report(logits, data.y, data.num_classes)
    report["loss"] = float(F.cross_entropy(logits, data.y.to(logits.device)))
    return report
