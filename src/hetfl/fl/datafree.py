"""Data-free distillation engine shared by DENSE, Co-Boosting and FedHydra.

One loop, written once (DENSE's Alg. / FedHydra's Alg. 1): for each of ``T_g`` epochs, a generator
``G`` is trained for ``T_G`` steps so that the aggregated teacher logits ``P`` of its images fit
sampled labels; the global (student) model is then distilled from ``P`` on the synthetic batches.
A method supplies a :class:`Recipe`: how to aggregate the client logits into ``P``, the generator
loss, the student loss, which batches to keep and whether the generator is reset every epoch.

Shared pieces: :class:`BNStatsLoss` (DeepInversion hooks on the teachers' BatchNorm layers),
:func:`kl_div`, a bounded in-memory replay pool (uint8 images + teacher logits, never on disk),
evaluation and metric logging through the :class:`~hetfl.fl.method.ServerContext`, and a
checkpoint after every ``checkpoint_every`` epochs or ``checkpoint_every_s`` seconds, whichever comes
first, so an interrupted server stage resumes. Each epoch logs the mean KD loss; ``kd_grad_max``, the
largest gradient norm of the student's KD steps (before the optional ``grad_clip``, which
Co-Boosting's code sets to 10 and DENSE's and FedHydra's do not use; a student collapsed to one class
shows as a drop of it to the last layer's gradient alone); ``dead_units``, the fraction of the student's ReLU
channels that output zero on every sample of the epoch's last KD batch (:class:`DeadUnits`; a layer
at 1.0 passes no signal); and ``kd_loss_new``, the KD loss of the epoch's fresh batches met before
their own step (high when the generator finds batches on which the student is confidently wrong).

Speed options: ``channels_last`` (default) runs the generator, teachers and student in NHWC, where
oneDNN's CPU convolutions are faster; the arithmetic is the same up to float summation order
(:meth:`~hetfl.models.generator.Generator.reset_parameters` draws the same weights in either
layout). ``precision: bf16`` autocasts the forwards of synthesis (fp32 by default), for CPUs with
native bf16 and GPUs. ``distill_precision: bf16`` autocasts the student's forward in the KD steps as
well (fp32 weights and loss), and Co-Boosting's ODS passes through the teachers. ``compile: true`` runs
the part of each generator step after G (:meth:`DataFreeDistiller.guide`: the teachers with their BN
hooks, the aggregate, the student) and the test pass through ``torch.compile``, which fuses the
memory-bound BatchNorm, ReLU, pooling and statistics passes around the convolutions, forward and
backward: the same values up to float summation order, after a compilation at the first step (G stays
eager). ``distill_precision`` and ``compile`` are off by default; docs/BENCHMARKS.md has the timings.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hetfl.fl.checkpoint import (
    load_momentum,
    load_optimizer_tensors,
    momentum_tensors,
    optimizer_tensors,
    stop_deferred,
)
from hetfl.fl.method import ServerContext, derive_seed
from hetfl.fl.precision import autocast, check_precision
from hetfl.fl.training import weights_frozen
from hetfl.models.generator import Generator


def kl_div(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0,
           reduction: str = "batchmean") -> torch.Tensor:
    """``T^2 * KL(softmax(t/T) || softmax(s/T))`` (batch mean, or per sample with ``reduction='none'``)."""
    t = F.log_softmax(teacher_logits / temperature, dim=1)
    s = F.log_softmax(student_logits / temperature, dim=1)
    per_sample = (t.exp() * (t - s)).sum(dim=1) * temperature**2
    return per_sample.mean() if reduction == "batchmean" else per_sample


class DeadUnits:
    """Which ReLU channels of ``model`` output zero on every sample while attached (forward hooks
    on its ``nn.ReLU`` modules; a channel is dim 1, all other dims are pooled). ``fraction()`` is
    the share of channels, over all hooked ReLUs, that were never positive; kept on the device
    until read. A model without ``nn.ReLU`` modules gives ``None``."""

    def __init__(self, model: nn.Module) -> None:
        self.alive: list[torch.Tensor] = []
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, nn.ReLU)]

    def _hook(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        dims = [d for d in range(output.dim()) if d != 1]
        self.alive.append((output.detach() > 0).any(dim=dims) if dims else output.detach() > 0)

    def fraction(self) -> torch.Tensor | None:
        if not self.alive:
            return None
        return 1.0 - torch.cat([a.flatten() for a in self.alive]).float().mean()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class ChannelMeanVar(torch.autograd.Function):
    """Per-channel mean and biased variance of a (b, C, H, W) batch, in fp32 whatever the input's
    precision, with a one-pass backward: ``dx = g_mean / n + g_var * 2 (x - mean) / n`` as one
    ``addcmul``. Autograd's own backward of ``mean`` and ``var`` makes four passes over x, and
    ``torch.var`` (Welford) reduces channels_last input several times slower than two plain sums."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        xf = x.float()
        mean = xf.mean(dim=(0, 2, 3))
        centred = xf - mean.view(1, -1, 1, 1)  # two passes of plain sums: torch.var is slower here
        var = (centred * centred).mean(dim=(0, 2, 3))
        ctx.save_for_backward(x, mean)
        return mean, var

    @staticmethod
    def backward(ctx, g_mean: torch.Tensor, g_var: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x, mean = ctx.saved_tensors
        n = x.numel() // x.shape[1]
        slope = g_var * (2.0 / n)
        offset = g_mean / n - mean * slope
        return torch.addcmul(offset.view(1, -1, 1, 1), x, slope.view(1, -1, 1, 1)).to(x.dtype)


class BNStatsLoss:
    """DeepInversion BN-statistics loss on a list of models.

    Forward hooks on every ``BatchNorm2d`` record, for the batch that went through it,
    ``||mu_batch - running_mean||_2 + ||var_batch - running_var||_2``; :meth:`per_model` sums
    these over each model's layers (the value is 0 exactly when the batch statistics equal the
    stored ones). Use with the models in eval mode.
    """

    def __init__(self, models: list[nn.Module]) -> None:
        self.values: list[list[torch.Tensor]] = [[] for _ in models]
        self.recording = True  # False: the hooks do nothing (forwards whose statistics no loss uses)
        self.handles = []
        for k, model in enumerate(models):
            for module in model.modules():
                if isinstance(module, nn.BatchNorm2d) and module.running_mean is not None:
                    self.handles.append(module.register_forward_hook(self._hook(k)))

    def _hook(self, k: int):
        def hook(module: nn.BatchNorm2d, inputs: tuple[torch.Tensor], _out: torch.Tensor) -> None:
            if not self.recording:
                return
            mean, var = ChannelMeanVar.apply(inputs[0])
            self.values[k].append(torch.linalg.vector_norm(mean - module.running_mean)
                                  + torch.linalg.vector_norm(var - module.running_var))
        return hook

    def clear(self) -> None:
        for v in self.values:
            v.clear()

    def per_model(self) -> torch.Tensor:
        """(m,) summed BN loss of each model for the last forward (0 for models without BN)."""
        sums = [torch.stack(v).sum() if v else None for v in self.values]
        device = next((s.device for s in sums if s is not None), None)
        return torch.stack([s if s is not None else torch.zeros((), device=device) for s in sums])

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class DataFreeConfig:
    """Keys shared by the generator family (names as in the configs)."""

    epochs: int = 200  # T_g
    generator_steps: int = 30  # T_G
    batch_size: int = 256  # b, synthetic batch
    lr: float = 0.01  # student SGD learning rate (eta_g)
    momentum: float = 0.9
    weight_decay: float = 0.0
    generator_lr: float = 1e-3  # eta_G (Adam, betas 0.5 / 0.999 as in DENSE)
    lambda_bn: float = 1.0
    lambda_adv: float = 1.0
    temperature: float = 1.0
    nz: int = 256
    pool_size: int = 0  # batches kept for replay (0: no replay; -1: unbounded, DENSE)
    replay: int = 0  # replayed pool batches per epoch (-1: the whole pool, DENSE)
    pool_shuffle: bool = False  # KD batches drawn afresh each epoch from the samples of the batches distilled
    precision: str = "fp32"  # fp32 | bf16 autocast for the generator, teacher and student forwards of synthesis
    channels_last: bool = True  # generator, teachers and student in NHWC (oneDNN's faster CPU convolutions)
    distill_precision: str = "fp32"  # fp32 | bf16 autocast for the KD forwards (student, Co-Boosting's ODS teachers)
    compile: bool = False  # torch.compile the generator step's teacher and student forwards (guide) and the test pass
    cosine: bool = False  # cosine-anneal the student lr over the epochs (Co-Boosting)
    grad_clip: float = 0.0  # clip the student's gradient norm in each KD step (0: off; Co-Boosting's code: 10)
    generator_grad_clip: float = 0.0  # clip the generator's gradient norm in each step (0: off; Co-Boosting's code: 10)
    eval_every: int = 1
    checkpoint_every: int = 10  # epochs between checkpoints
    checkpoint_every_s: float = 600.0  # ... or seconds, whichever comes first (0: after every epoch)

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.generator_steps < 1 or self.batch_size < 2:
            raise ValueError("epochs, generator_steps >= 1 and batch_size >= 2 are required")
        if self.grad_clip < 0 or self.generator_grad_clip < 0:
            raise ValueError(f"grad_clip and generator_grad_clip must be >= 0 (0: off), "
                             f"got {self.grad_clip} and {self.generator_grad_clip}")
        if self.checkpoint_every < 1 or not self.checkpoint_every_s >= 0:
            raise ValueError(f"checkpoint_every must be >= 1 and checkpoint_every_s >= 0 (0: after every epoch), "
                             f"got {self.checkpoint_every} and {self.checkpoint_every_s}")
        check_precision(self.precision)
        check_precision(self.distill_precision, "distill_precision")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true or false, got {self.compile!r}")


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # uint8 images, labels y, (m, b, c) client logits


class Recipe:
    """The method-specific pieces of the loop (defaults: DENSE's average ensemble)."""

    keep: str = "best"  # which synthetic batches of an epoch are distilled: 'best' | 'all'
    reset_generator: bool = True  # re-initialise G (and z) every epoch, as DENSE does
    optimize_z: bool = True  # Adam over [G, z] (DENSE) or over G only

    def aggregate(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(m, b, c) client logits -> (b, c) teacher logits P."""
        return logits.mean(dim=0)

    def generator_loss(self, P: torch.Tensor, s: torch.Tensor, y: torch.Tensor, bn: torch.Tensor,
                       cfg: DataFreeConfig) -> torch.Tensor:
        raise NotImplementedError

    def student_loss(self, P: torch.Tensor, s: torch.Tensor, cfg: DataFreeConfig) -> torch.Tensor:
        return kl_div(P, s, cfg.temperature)

    def kd_batch(self, engine: DataFreeDistiller, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The (images, teacher logits) the student is distilled on for one pool batch."""
        x8, y, logits = batch
        return x8.float().div_(255.0), self.aggregate(logits, y)

    def on_epoch_end(self, engine: DataFreeDistiller, epoch: int) -> None:
        """Hook for per-epoch updates of the recipe's own state (Co-Boosting's weights)."""

    def state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state` returned (for resuming)."""


class DataFreeDistiller:
    """Runs the loop for one method; see the module docstring."""

    def __init__(self, teachers: list[nn.Module], student: nn.Module, recipe: Recipe,
                 cfg: DataFreeConfig, ctx: ServerContext, name: str) -> None:
        self.teachers = [t.to(ctx.device).eval() for t in teachers]
        for t in self.teachers:
            t.requires_grad_(False)
        self.student = student.to(ctx.device)
        self.recipe, self.cfg, self.ctx, self.name = recipe, cfg, ctx, name
        c, h, _ = ctx.shape
        torch.manual_seed(derive_seed(ctx.seed, name, "generator"))
        self.generator = Generator(cfg.nz, 64, h, c).to(ctx.device)
        if cfg.channels_last:  # same arithmetic, another memory layout: oneDNN's fast NHWC kernels
            self._layout(torch.channels_last)
        self.gen_opt = self._generator_optimizer(None)
        self.opt = torch.optim.SGD(self.student.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                   weight_decay=cfg.weight_decay)
        self.bn = BNStatsLoss(self.teachers)
        self.pool: deque[Batch] = deque(
            maxlen=None if cfg.pool_size < 0 else max(cfg.pool_size, 0) or 1)
        self.schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=cfg.epochs)
                         if cfg.cosine else None)
        self.history: list[float] = []
        self.timing = {"generation": 0.0, "distillation": 0.0, "evaluation": 0.0}
        self.loop_seconds = 0.0  # wall seconds of the epochs run before this run (from a checkpoint)
        self.began = time.perf_counter()  # when this run's epochs began
        self.last_batch: Batch | None = None
        self._guide = torch.compile(self.guide, dynamic=False) if cfg.compile else self.guide
        # With compile, the per-epoch test pass runs the student (eval mode, fp32) through torch.compile
        # too: BatchNorm, ReLU and max-pooling fused after each convolution; logits equal to eager's up
        # to float summation order
        self._eval_model = torch.compile(self.student, dynamic=False) if cfg.compile else self.student

    # -- pieces ---------------------------------------------------------------------------------
    def _layout(self, memory_format: torch.memory_format) -> None:
        for model in [*self.teachers, self.student, self.generator]:
            model.to(memory_format=memory_format)

    def _generator_optimizer(self, z: torch.Tensor | None) -> torch.optim.Adam:
        params = list(self.generator.parameters()) + ([z] if z is not None else [])
        return torch.optim.Adam(params, lr=self.cfg.generator_lr, betas=(0.5, 0.999))

    def teacher_logits(self, x: torch.Tensor, record_stats: bool = False) -> torch.Tensor:
        """(m, b, c) logits of every client model on ``x``; with ``record_stats`` (the generator's
        step, whose loss has L_BN) the BN hooks record their statistics for
        :meth:`BNStatsLoss.per_model`; without, they skip their passes over every BatchNorm input."""
        self.bn.clear()
        self.bn.recording = record_stats
        return torch.stack([t(x).float() for t in self.teachers])

    def guide(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The forwards of a generator step after G: the (m, b, c) client logits on ``x`` (with their
        BN statistics), their aggregate P, the student's logits and the (m,) BN-statistics losses.
        With ``compile`` this runs through ``torch.compile``, which fuses the memory-bound passes
        around the convolutions (BatchNorm, ReLU, pooling, the BN hooks' sums) forward and backward;
        G and the loss stay eager."""
        logits = self.teacher_logits(x, record_stats=True)
        bn = self.bn.per_model()
        self.bn.clear()  # empty between steps: one compiled graph, not one per list length
        return logits, self.recipe.aggregate(logits, y), self.student(x).float(), bn

    def synthesize(self, epoch: int) -> list[Batch]:
        """Train the generator for T_G steps; return the kept (images, labels, client logits)."""
        cfg, dev = self.cfg, self.ctx.device
        g = torch.Generator().manual_seed(derive_seed(self.ctx.seed, self.name, "z", epoch))
        z = torch.randn(cfg.batch_size, cfg.nz, generator=g).to(dev)
        y = torch.randint(0, self.ctx.num_classes, (cfg.batch_size,), generator=g).to(dev)
        if self.recipe.reset_generator:
            torch.manual_seed(derive_seed(self.ctx.seed, self.name, "generator", epoch))
            self.generator.reset_parameters()  # layout-independent draws (see Generator)
            if self.recipe.optimize_z:
                z.requires_grad_(True)
            self.gen_opt = self._generator_optimizer(z if self.recipe.optimize_z else None)
        self.generator.train()
        self.student.eval()
        kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (x, client logits, loss)
        # The generator's loss reaches G through the student too (adversarial term): the student's own
        # weight gradients are not needed, so its backward computes only the gradient of x.
        with weights_frozen(self.student):
            for _ in range(cfg.generator_steps):
                with autocast(dev, cfg.precision):
                    x = self.generator(z)
                    logits, P, s, bn = self._guide(x, y)
                loss = self.recipe.generator_loss(P, s, y, bn, cfg)
                self.gen_opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.generator_grad_clip > 0:  # the generator's weights only, not z (Co-Boosting's code)
                    torch.nn.utils.clip_grad_norm_(self.generator.parameters(), cfg.generator_grad_clip)
                self.gen_opt.step()
                kept.append((x.detach(), logits.detach(), loss.detach()))  # no host-device sync per step
        if self.recipe.keep == "best":
            kept = [kept[int(torch.stack([item[2] for item in kept]).argmin())]]
        # Images are kept as uint8 (as DENSE's PNG pool); the client logits are the ones computed in
        # the generator step on the unquantised images (at most 1/255 apart), not a second forward.
        # Each kept batch owns its labels: batches sharing one y tensor cannot be checkpointed
        # (safetensors refuses shared storage).
        return [(to_uint8(x), y.detach().clone(), logits) for x, logits, _ in kept]

    def distill(self, batches: list[Batch], new: int = 0) -> dict[str, float]:
        """One SGD step per batch. Returns the epoch's log fields: ``kd_loss``, the mean KD loss;
        ``kd_grad_max``, the largest gradient norm of the student (before clipping); with ``new``
        > 0, ``kd_loss_new``, the mean KD loss of the first ``new`` batches (this epoch's fresh ones,
        each met before its own step: how adversarial the new data is to the student); and
        ``dead_units`` on the last batch (:class:`DeadUnits`, when the student has ReLU modules).
        Sums stay on the device until the end (no host-device sync per step)."""
        self.student.train()
        params = [p for p in self.student.parameters() if p.requires_grad]
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)  # summed on the device
        total_new = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        peak = torch.zeros((), device=self.ctx.device)
        dead: torch.Tensor | None = None
        for i, batch in enumerate(batches):
            x, P = self.recipe.kd_batch(self, batch)
            probe = DeadUnits(self.student) if i == len(batches) - 1 else None
            with autocast(self.ctx.device, self.cfg.distill_precision):
                s = self.student(x).float()
            if probe is not None:
                probe.remove()
                dead = probe.fraction()
            loss = self.recipe.student_loss(P, s, self.cfg)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            grads = [p.grad for p in params if p.grad is not None]
            norm = (torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip) if self.cfg.grad_clip > 0
                    else torch.nn.utils.get_total_norm(grads))
            peak = torch.maximum(peak, norm.detach().float())
            self.opt.step()
            total += loss.detach().double()
            if i < new:
                total_new += loss.detach().double()
        out = {"kd_loss": float(total) / max(len(batches), 1), "kd_grad_max": float(peak)}
        if new > 0 and batches:
            out["kd_loss_new"] = float(total_new) / min(new, len(batches))
        if dead is not None:
            out["dead_units"] = float(dead)
        return out

    def shuffled(self, batches: list[Batch], epoch: int) -> list[Batch]:
        """``pool_shuffle``: the samples of ``batches`` in a seeded random order, cut into batches of
        ``batch_size`` (the last one shorter), as DENSE's and Co-Boosting's code draw their KD
        batches from a shuffled DataLoader over the whole pool each epoch."""
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        logits = torch.cat([b[2] for b in batches], dim=1)
        g = torch.Generator().manual_seed(derive_seed(self.ctx.seed, self.name, "shuffle", epoch))
        order = torch.randperm(len(y), generator=g).to(y.device)
        return [(x[i], y[i], logits[:, i]) for i in order.split(self.cfg.batch_size)]

    def replay_batches(self, epoch: int) -> list[Batch]:
        pool = list(self.pool)
        if self.cfg.replay < 0 or self.cfg.replay >= len(pool):
            return pool
        if self.cfg.replay == 0:
            return []
        g = torch.Generator().manual_seed(derive_seed(self.ctx.seed, self.name, "replay", epoch))
        return [pool[i] for i in torch.randperm(len(pool), generator=g)[: self.cfg.replay].tolist()]

    # -- checkpoints ----------------------------------------------------------------------------
    def _ckpt_paths(self) -> tuple[Path, Path]:
        return self.ctx.out_dir / "checkpoint.safetensors", self.ctx.out_dir / "checkpoint.json"

    def save_checkpoint(self, epoch: int, config_key: str) -> None:
        tensors = {f"student.{k}": v for k, v in self.student.state_dict().items()}
        tensors.update({f"generator.{k}": v for k, v in self.generator.state_dict().items()})
        tensors.update({f"recipe.{k}": v for k, v in self.recipe.state().items()})
        for i, (x, y, logits) in enumerate(self.pool):
            tensors[f"pool.{i}.x"], tensors[f"pool.{i}.y"], tensors[f"pool.{i}.L"] = x, y, logits
        tensors.update(momentum_tensors(self.opt, "opt."))
        # the generator's Adam states (G persists in FedHydra); a z optimised with it is drawn anew each epoch
        tensors.update(optimizer_tensors(self.gen_opt, "gen_opt.", list(self.generator.parameters())))
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        blob, info = self._ckpt_paths()
        # Atomic: each file is written beside its target and renamed over it, and the blob carries its
        # epoch, so a stop between (or during) the two writes leaves a pair that load_checkpoint rejects.
        save_file(tensors, str(blob) + ".tmp", metadata={"epoch": str(epoch), "config": config_key})
        os.replace(str(blob) + ".tmp", blob)
        text = json.dumps({"epoch": epoch, "config": config_key, "history": self.history,
                           "pool": len(self.pool), "timing": self.timing,
                           "loop_seconds": self.loop_seconds + time.perf_counter() - self.began})
        Path(str(info) + ".tmp").write_text(text)
        os.replace(str(info) + ".tmp", info)

    def load_checkpoint(self, config_key: str) -> int:
        """Restore the last checkpoint of the same config; return the next epoch to run."""
        blob, info_path = self._ckpt_paths()
        if not (blob.is_file() and info_path.is_file()):
            return 1
        info = json.loads(info_path.read_text())
        if info.get("config") != config_key:
            return 1
        with safe_open(str(blob), framework="pt", device=str(self.ctx.device)) as f:  # one read of the blob
            meta = f.metadata() or {}
            if meta.get("epoch") != str(info["epoch"]) or meta.get("config") != config_key:
                warnings.warn(f"{blob}: checkpoint files disagree (blob epoch {meta.get('epoch')}, info epoch "
                              f"{info['epoch']}); starting the server stage afresh", stacklevel=2)
                return 1
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        pick = lambda prefix: {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)}  # noqa: E731
        self.student.load_state_dict(pick("student."))
        self.generator.load_state_dict(pick("generator."))
        self.recipe.load_state(pick("recipe."))
        self.pool.clear()
        for i in range(info["pool"]):
            self.pool.append((t[f"pool.{i}.x"], t[f"pool.{i}.y"], t[f"pool.{i}.L"]))
        load_momentum(self.opt, t, "opt.")
        if not self.recipe.reset_generator:
            load_optimizer_tensors(self.gen_opt, t, "gen_opt.", list(self.generator.parameters()))
        if self.schedule is not None:
            with warnings.catch_warnings():  # fast-forwarding the schedule: no optimizer step is due
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                for _ in range(info["epoch"]):
                    self.schedule.step()
        self.history = info["history"]
        self.ctx.restore_history(self.history)  # best-over-epochs also covers the epochs before the checkpoint
        self.timing = info["timing"]
        self.loop_seconds = float(info.get("loop_seconds", sum(self.timing.values())))  # older files: the stages' sum
        self.ctx.add_prior_seconds(self.loop_seconds)
        return info["epoch"] + 1

    # -- the loop -------------------------------------------------------------------------------
    def epoch(self, epoch: int) -> dict[str, Any]:
        """One epoch of Alg. 1: synthesise, distil (fresh batches and replay), evaluate when due;
        returns the epoch's metrics row."""
        cfg = self.cfg
        t0 = time.perf_counter()
        fresh = self.synthesize(epoch)
        t1 = time.perf_counter()
        batches = fresh + self.replay_batches(epoch)
        if cfg.pool_shuffle:
            row: dict[str, Any] = self.distill(self.shuffled(batches, epoch))
        else:
            row = self.distill(batches, new=len(fresh))
        if cfg.pool_size != 0:
            self.pool.extend(fresh)
        self.last_batch = fresh[-1]
        self.recipe.on_epoch_end(self, epoch)
        if self.schedule is not None:
            self.schedule.step()
        t2 = time.perf_counter()
        self.timing["generation"] += t1 - t0
        self.timing["distillation"] += t2 - t1
        if epoch % cfg.eval_every == 0 or epoch == cfg.epochs:
            row["accuracy"] = self.ctx.evaluate(self._eval_model)["accuracy"]
            self.history.append(row["accuracy"])
        self.timing["evaluation"] += time.perf_counter() - t2
        return row

    def run(self, config_key: str = "", resume: bool = True) -> nn.Module:
        cfg, ctx = self.cfg, self.ctx
        start = self.load_checkpoint(config_key) if resume else 1
        ctx.trim_log(start - 1 if start > 1 else -1)  # -1: a fresh start drops every old row
        if start > 1:
            ctx.record["resumed_from_epoch"] = start - 1
        bar = ctx.progress(range(start, cfg.epochs + 1), desc=f"{self.name}: distillation", unit="epoch",
                           initial=start - 1, total=cfg.epochs)
        self.began = saved = time.perf_counter()
        # A stop (Ctrl-C, or the SIGINT a parallel parent sends at a deadline) lets the epoch under way
        # finish and saves it, instead of losing the epochs since the last periodic checkpoint.
        with stop_deferred(notice=f"{self.name}: stopping after this epoch, to save a checkpoint") as stop:
            for epoch in bar:
                row = self.epoch(epoch)
                if "accuracy" in row:
                    bar.set_postfix(acc=f"{row['accuracy']:.2f}", best=f"{max(self.history):.2f}")
                ctx.log(epoch, **row)
                due = epoch % cfg.checkpoint_every == 0 or time.perf_counter() - saved >= cfg.checkpoint_every_s
                if (got := stop()) or due or epoch == cfg.epochs:
                    self.save_checkpoint(epoch, config_key)
                    saved = time.perf_counter()
                    if got:
                        raise KeyboardInterrupt  # leaves the block, which delivers the signal
        self.bn.remove()
        if cfg.channels_last:  # hand the models back contiguous (as the uploads were built)
            self._layout(torch.contiguous_format)
        ctx.record["timing_seconds"] = dict(self.timing)
        return self.student


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Quantise [0, 1] images to uint8 for the pool (as DENSE's PNG pool does)."""
    return (x.clamp(0, 1) * 255).round().to(torch.uint8).contiguous()  # one pool layout whatever G's


NOT_IN_KEY = {"checkpoint_every_s"}  # settings that do not change the trained model


def config_key(cfg: DataFreeConfig, **extra: Any) -> str:
    """What a checkpoint must match to be resumed: every setting of the loop and ``extra`` (a
    method's ``params`` included), less the :data:`NOT_IN_KEY` settings."""
    keys = {k: v for k, v in asdict(cfg).items() if k not in NOT_IN_KEY}
    if isinstance(extra.get("params"), dict):  # a method's params repeat the loop's keys, defaults filled in
        extra["params"] = {k: v for k, v in extra["params"].items() if k not in NOT_IN_KEY}
    return json.dumps({**keys, **extra}, sort_keys=True, default=str)
