"""Generative clients and the server's synthetic-data stage (FedMHO, FedCVAE).

Client side: the ``train_cvae`` task trains a conditional VAE on the client's data (Adam, the
loss of FedMHO Eq. 3) and uploads **only the decoder** tensors plus ``cvae`` and ``latent_dim`` in
the metadata; :func:`hetfl.fl.client.handle` adds the sample count and label histogram.

Server side, shared by the methods:

* allocation of N synthetic samples to (decoder, class) cells: :func:`allocate_per_class`
  (FedMHO's code: N/C per class, split among decoders by squared label counts) and
  :func:`allocate_by_share` (FedCVAE: by data share, then by each client's label distribution).
  Both split with the largest-remainder rule, so the totals are exact.
* :func:`generate`: every decoder decodes its cell counts (``z ~ N(0, I)``, optionally truncated).
* :func:`kmeans_filter`: FedMHO's Alg. 2, per class 1-cluster K-means in flattened pixel space.
* :func:`train_on_synthetic`: Adam over the in-memory synthetic set with CE (Eq. 5) and optional
  KD towards precomputed teacher logits (Eq. 6-8), evaluating and logging per epoch;
  :func:`teacher_stats` says what such a teacher tells the synthetic set (entropy, agreement with
  the labels per class), which FedMHO-MD/SD record in their summaries.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.fl.checkpoint import Resumed, StageCheckpoint, stop_deferred
from hetfl.fl.client import ClientEnv, client_task
from hetfl.fl.datafree import kl_div
from hetfl.fl.payload import Payload, PayloadError
from hetfl.fl.precision import autocast, check_precision
from hetfl.fl.training import accuracy_report, count_sample_passes, minibatches, prepare
from hetfl.models.cvae import CVAE, build_cvae, decoder_state


# ---- client side --------------------------------------------------------------------------------
def check_loop(epochs: object, batch_size: object, lr: object, prefix: str = "") -> None:
    """Shared checks of a training loop's settings; messages name the key (with ``prefix``)."""
    if not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"{prefix}epochs must be a non-negative integer, got {epochs!r}")
    if not isinstance(batch_size, int) or batch_size < 2:
        raise ValueError(f"{prefix}batch_size must be an integer >= 2, got {batch_size!r}")
    if not isinstance(lr, (int, float)) or lr <= 0:
        raise ValueError(f"{prefix}lr must be positive, got {lr!r}")


@dataclass(frozen=True)
class CVAETrain:
    """Local CVAE optimiser settings (FedMHO Table 3: Adam, batch 64; lr and epochs per dataset)."""

    epochs: int = 30
    batch_size: int = 64
    lr: float = 5e-2

    def __post_init__(self) -> None:
        check_loop(self.epochs, self.batch_size, self.lr, "cvae ")


def cvae_message(arch: str, shape: tuple[int, int, int], num_classes: int, latent_dim: int, cfg: CVAETrain,
                 init_seed: int, seed: int) -> Payload:
    """A request to train a CVAE locally and upload its decoder."""
    return Payload({}, dict(task="train_cvae", cvae=arch, in_channels=shape[0], image_size=shape[1],
                            num_classes=num_classes, latent_dim=latent_dim, init_seed=init_seed, seed=seed,
                            train=asdict(cfg)))


def train_cvae_model(model: CVAE, data: Any, cfg: CVAETrain, device: torch.device, seed: int,
                     progress: Callable[[int, float], None] | None = None) -> dict[str, float]:
    """Adam on Eq. 3 for ``cfg.epochs`` epochs; returns the last epoch's mean losses."""
    g = torch.Generator().manual_seed(seed)
    model.to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    stats = {"recon": float("nan"), "kl": float("nan")}
    for epoch in range(cfg.epochs):
        sums, count = torch.zeros(2), 0
        for idx in minibatches(len(data), cfg.batch_size, g):
            x, y = data.batch(idx, device)
            recon, kl = model.loss(x, y, generator=g)
            opt.zero_grad(set_to_none=True)
            (recon + kl).backward()
            opt.step()
            count_sample_passes(len(idx))
            sums += torch.stack([recon.detach(), kl.detach()]).cpu() * len(idx)
            count += len(idx)
        stats = {"recon": float(sums[0] / max(count, 1)), "kl": float(sums[1] / max(count, 1))}
        if progress is not None:
            progress(epoch + 1, stats["recon"] + stats["kl"])
    return stats


def cvae_from_meta(meta: dict[str, Any]) -> CVAE:
    return build_cvae(str(meta["cvae"]), int(meta["in_channels"]), int(meta["image_size"]),
                      int(meta["num_classes"]), int(meta["latent_dim"]))


@client_task("train_cvae")
def train_cvae(message: Payload, env: ClientEnv) -> Payload:
    """Train a CVAE on the client's data; upload the decoder only."""
    m = message.meta
    torch.manual_seed(int(m["init_seed"]))
    model = cvae_from_meta(m)
    stats = train_cvae_model(model, env.data, CVAETrain(**m["train"]), env.device, int(m["seed"]), env.progress)
    return Payload(decoder_state(model.cpu()), dict(cvae=m["cvae"], latent_dim=int(m["latent_dim"]),
                                                     train_recon=stats["recon"], train_kl=stats["kl"]))


# ---- server side --------------------------------------------------------------------------------
def decoder_from_upload(upload: Payload, client_id: int, arch: str, latent_dim: int,
                        shape: tuple[int, int, int], num_classes: int, device: torch.device) -> CVAE:
    """Validate a decoder upload (architecture, latent size, tensor names/shapes, finite values,
    label histogram) and load it into a CVAE whose encoder is left untrained."""
    got = (upload.meta.get("cvae"), upload.meta.get("latent_dim"))
    if got != (arch, latent_dim):
        raise PayloadError(f"client {client_id}: uploaded cvae/latent {got}, expected {(arch, latent_dim)}")
    model = build_cvae(arch, shape[0], shape[1], num_classes, latent_dim)
    upload.validate({k: v.shape for k, v in model.decoder.state_dict().items()},
                    required_meta=("num_samples", "label_counts"))
    if len(upload.meta["label_counts"]) != num_classes:
        raise PayloadError(f"client {client_id}: label histogram has {len(upload.meta['label_counts'])} "
                           f"classes, expected {num_classes}")
    model.decoder.load_state_dict(upload.tensors)
    return model.to(device).eval()


def largest_remainder(total: int, weights: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Split ``total`` into integers proportional to ``weights`` (Hamilton's method: floors, then
    one more to the largest remainders, ties to the lower index). All-zero weights split evenly."""
    w = torch.as_tensor(weights, dtype=torch.float64).clone()
    if len(w) == 0 or bool((w < 0).any()):
        raise ValueError(f"weights must be non-empty and non-negative, got {w.tolist()}")
    if float(w.sum()) == 0:
        w = torch.ones_like(w)
    exact = total * w / w.sum()
    out = exact.floor().long()
    short = total - int(out.sum())
    if short > 0:
        order = sorted(range(len(w)), key=lambda i: (-(float(exact[i]) - int(out[i])), i))
        out[order[:short]] += 1
    return out


def allocate_per_class(counts: torch.Tensor, total: int, power: float = 2.0) -> torch.Tensor:
    """FedMHO's official allocation: ``total / C`` samples per class (largest remainder), each
    class split among the K decoders with weights ``count_kc ** power / sum_k count_kc ** power``
    (uniform for a class no client holds). Returns a (K, C) integer matrix."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    per_class = largest_remainder(total, torch.ones(counts.shape[1]))
    return torch.stack([largest_remainder(int(per_class[c]), counts[:, c] ** power)
                        for c in range(counts.shape[1])], dim=1)


def allocate_by_share(counts: torch.Tensor, total: int) -> torch.Tensor:
    """FedCVAE's allocation: client k gets ``total * n_k / n`` samples, labelled in proportion to
    its label histogram (both by largest remainder). Returns a (K, C) integer matrix."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    per_client = largest_remainder(total, counts.sum(dim=1))
    return torch.stack([largest_remainder(int(per_client[k]), counts[k]) for k in range(counts.shape[0])])


def allocate_uniform(num_classes: int, total: int) -> torch.Tensor:
    """``total`` samples, as even as possible over the classes (a 1 x C matrix)."""
    return largest_remainder(total, torch.ones(num_classes)).unsqueeze(0)


def cell_labels(row: torch.Tensor) -> torch.Tensor:
    """Labels ``[0]*row[0] + [1]*row[1] + ...``."""
    return torch.repeat_interleave(torch.arange(len(row)), row.long())


@torch.no_grad()
def generate(decoders: Sequence[CVAE], alloc: torch.Tensor, seed: int, z_range: float | None = None,
             chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder k decodes ``alloc[k, c]`` images of class c; returns images in [0, 1] and labels, on
    the decoders' device (z is drawn on the CPU from one seeded generator, in decoder order)."""
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for decoder, row in zip(decoders, alloc):
        labels = cell_labels(row)
        decoder.eval()
        for s in range(0, len(labels), chunk):
            part = labels[s : s + chunk]
            xs.append(decoder.sample(part, generator=g, z_range=z_range))
            ys.append(part.to(xs[-1].device))
    if not xs:
        raise ValueError("no synthetic samples requested")
    return torch.cat(xs), torch.cat(ys)


def keep_count(n: int, ratio: float) -> int:
    """``round(ratio * n)``, halves rounded up."""
    return int(torch.floor(torch.tensor(ratio * n, dtype=torch.float64) + 0.5))


def kmeans_filter(x: torch.Tensor, y: torch.Tensor, ratio: float) -> torch.Tensor:
    """Alg. 2: per class, cluster the flattened pixels into one K-means cluster (its centre is the
    class mean, where Lloyd's algorithm converges in one step) and keep the ``round(ratio * n)``
    samples closest to it (Euclidean). Returns the kept indices, sorted."""
    if not 0 < ratio <= 1:
        raise ValueError(f"R_th must be in (0, 1], got {ratio}")
    flat = x.flatten(1).float()
    keep = []
    for c in torch.unique(y):
        idx = torch.nonzero(y == c).squeeze(1)
        dist = (flat[idx] - flat[idx].mean(dim=0, keepdim=True)).norm(dim=1)
        k = keep_count(len(idx), ratio)
        keep.append(idx[torch.topk(dist, k, largest=False).indices])
    return torch.cat(keep).sort().values


# ---- server training on synthetic data ------------------------------------------------------------
@dataclass(frozen=True)
class FusionConfig:
    """Server-side training on the synthetic set (FedMHO Table 3: Adam, batch 64)."""

    epochs: int = 10
    batch_size: int = 64
    lr: float = 1e-5
    lam: float = 1.0  # weight of CE; 1 - lam weighs the KD term (Eq. 8)
    kl_reduction: str = "batchmean"  # batchmean: KL per sample; mean: torch KLDivLoss() default (/ C too)
    eval_every: int = 1
    freeze_bn: bool = False  # keep BatchNorm layers in eval mode: running statistics and normalisation fixed
    precision: str = "fp32"  # fp32 | bf16: autocast over the training steps and the per-epoch evaluations
    channels_last: bool = False  # NHWC model and batches (faster convolutions on AVX-512 CPUs)

    def __post_init__(self) -> None:
        check_loop(self.epochs, self.batch_size, self.lr)
        check_precision(self.precision)
        if not isinstance(self.channels_last, bool):
            raise ValueError(f"channels_last must be true or false, got {self.channels_last!r}")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"lambda must be in [0, 1], got {self.lam!r}")
        if self.kl_reduction not in ("batchmean", "mean"):
            raise ValueError(f"kl_reduction must be batchmean or mean, got {self.kl_reduction!r}")
        if not isinstance(self.eval_every, int) or self.eval_every < 1:
            raise ValueError(f"eval_every must be a positive integer, got {self.eval_every!r}")
        if not isinstance(self.freeze_bn, bool):
            raise ValueError(f"freeze_bn must be true or false, got {self.freeze_bn!r}")


def train_mode(model: nn.Module, freeze_bn: bool) -> None:
    """``model.train()``; with ``freeze_bn`` its BatchNorm layers stay in eval mode (they normalise
    with, and do not update, the running statistics), so the layer is a fixed affine map, as in a
    BatchNorm-free network."""
    model.train()
    if freeze_bn:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()


@torch.no_grad()
def teacher_logits(teachers: Sequence[nn.Module], x: torch.Tensor, chunk: int = 1000) -> torch.Tensor:
    """The plain average of the teachers' logits on ``x`` (Eq. 6; one teacher: Eq. 7), eval mode."""
    for t in teachers:
        t.eval()
    return torch.cat([torch.stack([t(x[s : s + chunk]).float() for t in teachers]).mean(dim=0)
                      for s in range(0, len(x), chunk)])


def teacher_stats(logits: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict[str, Any]:
    """What a fixed KD teacher says about the synthetic set it teaches on: its mean softmax entropy
    (nats; ``log C`` is a uniform teacher, whose KL term is only a confidence penalty) and how often
    its argmax is the synthetic label, in %, overall and per class (:func:`accuracy_report`; ``None``
    for a class with no sample, entropy and agreement ``None`` for an empty set). A class the teacher
    never predicts pulls that class's samples away from their labels."""
    if logits.ndim != 2 or logits.shape[0] != len(y) or logits.shape[1] != num_classes:
        raise ValueError(f"teacher logits of shape {tuple(logits.shape)} do not match {len(y)} labels "
                         f"over {num_classes} classes")
    stats: dict[str, Any] = {"entropy": None, "max_entropy": round(math.log(num_classes), 4), "agreement": None,
                             "agreement_per_class": [None] * num_classes}
    if len(y):
        log_p = torch.log_softmax(logits.float(), dim=1)
        agreement = accuracy_report(logits, y.long(), num_classes)
        stats.update(entropy=round(float(-(log_p.exp() * log_p).sum(dim=1).mean()), 4),
                     agreement=round(agreement["accuracy"], 4), agreement_per_class=agreement["per_class"])
    return stats


def kd_term(teacher: torch.Tensor, student: torch.Tensor, reduction: str) -> torch.Tensor:
    kl = kl_div(teacher, student, 1.0)
    return kl / student.shape[1] if reduction == "mean" else kl


def train_on_synthetic(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: FusionConfig, seed: int,
                       teacher: torch.Tensor | None = None,
                       evaluate: Callable[[nn.Module], dict[str, Any]] | None = None,
                       log: Callable[..., None] | None = None, progress: Callable[..., Any] | None = None,
                       desc: str = "server training", checkpoint: StageCheckpoint | None = None,
                       on_resume: Callable[[Resumed], None] | None = None) -> list[float]:
    """``lam * CE(model(x), y) + (1 - lam) * KL(teacher || model(x))`` (Eq. 5 when ``teacher`` is
    None, else Eq. 8), Adam, shuffled minibatches; returns the accuracy after each evaluated epoch
    (epoch 0 = before training) and logs ``accuracy``, ``ce``, ``kd`` per epoch.

    ``cfg.precision == "bf16"`` runs the forward passes of the training steps and of the per-epoch
    evaluations under bf16 autocast (the loss terms, Adam and the weights stay fp32); the engine's
    evaluation of the returned model is its own (fp32), so a run's last curve point and its headline
    accuracy show what bf16 evaluation moves. ``cfg.channels_last`` trains in NHWC and hands the
    model back in the default layout.

    With a ``checkpoint`` the loop first restores the state saved there (``on_resume`` then hears
    where it stands, also when nothing was saved), saves after an epoch when the checkpoint is due,
    after the last epoch, and on SIGINT or SIGTERM after the epoch under way (then stops with
    KeyboardInterrupt); the curve so far travels with it. The caller clears it once the result is safe."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    layout = torch.channels_last if cfg.channels_last else torch.contiguous_format
    model = prepare(model, x.device, cfg.channels_last)
    state = checkpoint.load(model, opt, g) if checkpoint is not None else Resumed()
    if on_resume is not None:
        on_resume(state)
    curve: list[float] = list(state.history)
    began = time.perf_counter()

    def record(epoch: int, ce: float, kd: float) -> None:
        if evaluate is None or (epoch % cfg.eval_every and epoch != cfg.epochs):
            return
        with autocast(x.device, cfg.precision):
            acc = float(evaluate(model)["accuracy"])
        curve.append(acc)
        if log is not None:
            log(epoch, accuracy=acc, ce=ce, kd=kd)

    if state.done == 0:
        record(0, float("nan"), float("nan"))
    epochs = range(state.done + 1, cfg.epochs + 1)
    bar = progress(epochs, desc=desc, unit="epoch", initial=state.done, total=cfg.epochs) if progress else epochs
    with stop_deferred(notice=f"{desc}: stopping after this epoch, to save a checkpoint") if checkpoint \
            else contextlib.nullcontext(lambda: None) as stop:
        for epoch in bar:
            train_mode(model, cfg.freeze_bn)
            sums, count = torch.zeros(2), 0
            for idx in minibatches(len(x), cfg.batch_size, g):
                idx = idx.to(x.device)
                with autocast(x.device, cfg.precision):
                    out = model(x[idx].contiguous(memory_format=layout)).float()
                ce = F.cross_entropy(out, y[idx])
                if teacher is None:
                    kd, loss = torch.zeros((), device=out.device), ce
                else:
                    kd = kd_term(teacher[idx], out, cfg.kl_reduction)
                    loss = cfg.lam * ce + (1 - cfg.lam) * kd
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sums += torch.stack([ce.detach(), kd.detach()]).cpu() * len(idx)
                count += len(idx)
            record(epoch, float(sums[0] / max(count, 1)), float(sums[1] / max(count, 1)))
            if checkpoint is not None and ((got := stop()) or checkpoint.due(final=epoch == cfg.epochs)):
                checkpoint.save(model, opt, g, epoch, curve, state.seconds + time.perf_counter() - began)
                if got:
                    raise KeyboardInterrupt  # leaves the block, which delivers the signal
    if cfg.channels_last:
        model.to(memory_format=torch.contiguous_format)
    return curve
