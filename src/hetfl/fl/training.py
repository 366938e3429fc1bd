"""Local training and evaluation loops shared by every method.

``local_train`` is plain seeded minibatch SGD over an in-memory :class:`ImageDataset`; methods that
change the local objective (FedProx, MOON, KD terms, ...) pass ``loss_fn`` instead of copying the
loop. ``local_train_group`` trains several clients of one architecture at once as one vectorised
network. ``evaluate`` gives top-1 and per-class accuracy on a test split (``predict_logits``, the
logits alone). :func:`counting_sample_passes` counts the samples the client loops train on (a
machine-independent measure of client compute).

The settings are a :class:`~hetfl.fl.train_config.TrainConfig`; bf16 autocast comes from
:mod:`hetfl.fl.precision` and a local training's resumable state from :mod:`hetfl.fl.checkpoint`.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.data.base import ImageDataset
from hetfl.fl.checkpoint import TrainCheckpoint, TrainState, stop_deferred
from hetfl.fl.precision import autocast
from hetfl.fl.train_config import TrainConfig, steps_per_epoch

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


_METERS = threading.local()


@contextlib.contextmanager
def counting_sample_passes() -> Iterator[Counter[int]]:
    """Count, inside the block, the samples of the optimiser steps a client's loops take: one a sample
    a step, in :func:`local_train` (the steps of a resumed training's earlier part too),
    :func:`local_train_group` (under each client's index in the group; else under 0), the CVAE loop, and
    the synthesis steps of KIP (support set and target batch) and FedCOG (its synthetic batch). A loss
    term's extra forward passes (frozen teachers, MOON's models) are not counted. Nested blocks add
    their count to the enclosing one."""
    stack: list[Counter[int]] = _METERS.__dict__.setdefault("stack", [])
    meter: Counter[int] = Counter()
    stack.append(meter)
    try:
        yield meter
    finally:
        stack.pop()
        if stack:
            stack[-1].update(meter)


def count_sample_passes(samples: int, slot: int = 0) -> None:
    """Add ``samples`` to the innermost :func:`counting_sample_passes` block of this thread (none: no-op)."""
    stack = _METERS.__dict__.get("stack")
    if stack:
        stack[-1][slot] += int(samples)


def prepare(model: nn.Module, device: torch.device, channels_last: bool) -> nn.Module:
    model = model.to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def minibatches(n: int, batch_size: int, generator: torch.Generator | None, shuffle: bool = True,
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
    """Train ``model`` in place on ``data`` for ``cfg.epochs`` epochs (or ``cfg.steps`` mini-batch steps in
    all, the last epoch cut short); returns the last epoch's mean loss.
    With ``checkpoint``, go on from a saved step if there is one, save every ``every_s`` seconds, and
    on SIGINT or SIGTERM save before stopping (:class:`~hetfl.fl.checkpoint.TrainCheckpoint`)."""
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
        per_epoch = steps_per_epoch(len(data), cfg.batch_size)
        if state.epoch:  # whole epochs of a resumed training's earlier part
            count_sample_passes(state.epoch * sum(len(i) for i in minibatches(len(data), cfg.batch_size, None,
                                                                                  shuffle=False)))
        for epoch in range(state.epoch, cfg.epochs_needed(len(data))):
            if epoch > state.epoch or state.batches is None:
                state = TrainState(epoch, 0, generator.get_state(), loss=state.loss, seconds=state.seconds)
            # the loss sum stays on the device: no host-device sync per step on a GPU, one per epoch
            total = torch.full((), state.total, dtype=torch.float64, device=device)
            for step, idx in enumerate(minibatches(len(data), cfg.batch_size, generator)):
                if cfg.steps is not None and epoch * per_epoch + step >= cfg.steps:
                    break
                count_sample_passes(len(idx))
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
    if cfg.steps is not None:
        raise ValueError("local_train_group trains whole epochs: client.steps needs the one-client loop "
                         "(simulator.batch_clients: false)")
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
                for c in group:
                    count_sample_passes(size, slot=c)
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
                   progress: Callable[[Iterable[int]], Iterable[int]] | None = None,
                   channels_last: bool = True) -> torch.Tensor:
    """Logits (fp32) of ``model`` on every sample of ``data``, in order; ``progress`` wraps the batch
    starts (e.g. a progress bar for a long pass). ``channels_last`` runs a copy of the model on NHWC
    batches (oneDNN's faster convolutions; the caller's model keeps its layout)."""
    model = model.to(device).eval()
    layout = torch.contiguous_format
    if channels_last:
        model, layout = copy.deepcopy(model).to(memory_format=torch.channels_last), torch.channels_last
    starts: Iterable[int] = range(0, len(data), batch_size)
    outs = [model(data.batch(torch.arange(s, min(s + batch_size, len(data))), device)[0]
                  .contiguous(memory_format=layout)).float()
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
