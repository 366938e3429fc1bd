"""FedDF (Lin et al., NeurIPS 2020), one-shot: ensemble distillation on unlabeled auxiliary data.

The global model starts from the FedAvg (by sample count) of the uploads of its architecture, from
scratch where no client has it (``init: random`` always starts from scratch), and is distilled from
the uniform average of all the client logits, ``KL(softmax(P/T) || softmax(s/T)) T^2`` with T = 1, on
images of an auxiliary dataset whose labels are never used: Fashion-MNIST for MNIST, MNIST for
Fashion-MNIST (FedHydra's setting), CIFAR-100 for CIFAR-10 and the reverse, CIFAR-10 for
SVHN/CINIC-10; ``aux_dataset`` overrides.
Auxiliary images are resized and converted to the task's shape when they differ.

Model-heterogeneous clients (FedDF's Sec. 3 and FedMHO's baselines, Sec. 5.1): with ``prototypes:
all`` every client architecture gets its own student, initialised from its group's FedAvg and
distilled from the same ensemble of all clients; the outcome FedMHO reports is "the voting results
of each model prototype", ``feddf[vote]`` = the uniform mean of the students' logits (as FedMHO's
code votes for FedAvg). The headline stays the server architecture's student; the others are
reported as ``feddf[<arch>]``. ``prototypes: server`` (the default) distils the server's alone.

Defaults from the public code: Adam lr 1e-3 with cosine decay, batch 128. Budget: ``steps``
server batches (the README uses 10,000; default 2,000 here). The public code early-stops on a
held-out validation split; we report the final model and the best test accuracy over
evaluations (every ``eval_every`` steps), as the other one-shot methods do.
Teacher logits on the auxiliary set are computed once (the teachers are fixed and there is no
augmentation), not per step, with the teachers in channels_last; that pass has its own progress
bar and its seconds are recorded (``teacher_seconds``, then ``distill_seconds``).

Checkpoints (ours; the public code has none): the teachers' logits are kept in
``teacher-logits.safetensors`` once computed, and each student's distillation saves its state
(:class:`~hetfl.fl.checkpoint.StageCheckpoint`) every ``CHECKPOINT_EVERY_S`` seconds, at its last
step, and on SIGINT or SIGTERM after the step under way. The same run again goes on from there and
ends where an uninterrupted one does (bitwise, on the same device and thread count); the files go once
the method is done. A resumed run's seconds count the interrupted run's work too (``seconds_before_resume``).

``precision: bf16`` (ours, default fp32): bf16 autocast for the teachers' pass and the students'
training forwards, with the students in channels_last too. The teachers' logits are averaged and
kept in fp32 (:class:`Ensemble`), the KL is taken in fp32, Adam's state and the weights stay fp32,
and the engine's evaluations stay fp32.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetfl.data import ImageDataset
from hetfl.data.auxiliary import AUXILIARY
from hetfl.data.auxiliary import auxiliary_images as load_auxiliary
from hetfl.fl.aggregate import Ensemble, vote, weighted_average
from hetfl.fl.checkpoint import Resumed, StageCheckpoint, load_matching, stop_deferred
from hetfl.fl.datafree import kl_div
from hetfl.fl.method import OneShotMethod, ServerContext, derive_seed, register
from hetfl.fl.payload import Payload
from hetfl.fl.precision import autocast, check_precision
from hetfl.fl.training import predict_logits, prepare
from hetfl.methods.common import client_models, group_by_arch

CHECKPOINT_EVERY_S = 120.0  # a student's distillation saves its state this often (and at its end)


def auxiliary_images(name: str, ctx: ServerContext, size: int) -> ImageDataset:
    return load_auxiliary(name, ctx.data_root, ctx.shape, ctx.num_classes, size, ctx.seed,
                          derive_seed(ctx.seed, "feddf-aux"))


@register("feddf")
class FedDF(OneShotMethod):
    name = "feddf"
    defaults: dict[str, Any] = {"steps": 2000, "batch_size": 128, "lr": 1e-3, "temperature": 1.0,
                                "aux_dataset": None, "aux_size": 0, "eval_every": 100, "init": "fedavg",
                                "prototypes": "server", "precision": "fp32"}

    def check(self, ctx: ServerContext) -> None:
        p = self.params
        check_precision(p["precision"])
        if p["init"] not in ("fedavg", "random"):
            raise ValueError(f"init must be fedavg (each student from its architecture's FedAvg) or random, "
                             f"got {p['init']!r}")
        if p["prototypes"] not in ("server", "all"):
            raise ValueError(f"prototypes must be server (one student) or all (one per client architecture, "
                             f"and their vote), got {p['prototypes']!r}")

    def server(self, uploads: dict[int, Payload], ctx: ServerContext) -> dict[str, nn.Module]:
        p = self.params
        models = client_models(uploads, ctx)
        aux_name = p["aux_dataset"] or AUXILIARY.get(ctx.dataset)
        if aux_name is None:
            raise ValueError(f"feddf: no default auxiliary dataset for {ctx.dataset!r}; set aux_dataset")
        aux = auxiliary_images(aux_name, ctx, int(p["aux_size"]))
        key = json.dumps({"params": p, "seed": ctx.seed, "server": ctx.server_arch, "aux": aux_name,
                          "clients": [uploads[c].meta.get("client_id") for c in sorted(uploads)]}, sort_keys=True)
        start = time.perf_counter()
        teacher_logits, teacher_prior = self._teacher_logits(models, aux, aux_name, key, ctx)
        teacher_now = time.perf_counter() - start
        ctx.record["teacher_seconds"] = round(teacher_now + teacher_prior, 1)
        distill_prior = 0.0  # seconds the students' distillations ran before this run (resumed)
        groups = group_by_arch(uploads)
        archs = [ctx.server_arch] + ([a for a in groups if a != ctx.server_arch] if p["prototypes"] == "all" else [])
        students: dict[str, nn.Module] = {}
        for arch in archs:
            student = ctx.build(arch, purpose="feddf-student")
            init = "fedavg" if p["init"] == "fedavg" and arch in groups else "random"
            if init == "fedavg":
                student.load_state_dict(weighted_average([models[c].state_dict() for c in groups[arch]],
                                                         [uploads[c].meta["num_samples"] for c in groups[arch]]))
            ctx.record["init" if arch == ctx.server_arch else f"init[{arch}]"] = init
            head = arch == ctx.server_arch  # the headline keeps the batch seed of single-student runs
            seed = derive_seed(ctx.seed, "feddf-batches", *(() if head else (arch,)))
            distill_prior += self._distil(student, aux, teacher_logits, ctx, track=head, seed=seed,
                                          desc=f"{self.name}: distillation" + ("" if head else f" [{arch}]"),
                                          checkpoint=self._checkpoint_path(ctx, arch), key=f"{key} {arch}")
            students[arch] = student
        for path in [self._checkpoint_path(ctx, a) for a in archs] + [ctx.out_dir / "teacher-logits.safetensors"]:
            path.unlink(missing_ok=True)  # done: the engine stores the result
        ctx.record["aux_dataset"] = aux_name
        ctx.record["distill_seconds"] = round(time.perf_counter() - start - teacher_now + distill_prior, 1)
        out: dict[str, nn.Module] = {self.name: students[ctx.server_arch]}
        if len(students) > 1:
            out.update({f"{self.name}[{arch}]": m for arch, m in students.items() if arch != ctx.server_arch})
            out[f"{self.name}[vote]"] = vote(list(students.values()))
        return out

    @staticmethod
    def _checkpoint_path(ctx: ServerContext, arch: str) -> Path:
        return ctx.out_dir / f"checkpoint-{arch}.safetensors"

    def _teacher_logits(self, models: dict[int, nn.Module], aux: ImageDataset, aux_name: str, key: str,
                        ctx: ServerContext) -> tuple[torch.Tensor, float]:
        """The average teacher logits on the auxiliary set: one pass of every teacher (long with VGG-9s),
        or the logits kept by an interrupted run of the same configuration; and the seconds that earlier
        run's pass took (0 for a pass run now), counted as work before the resume."""
        path = ctx.out_dir / "teacher-logits.safetensors"
        saved = load_matching(path, key) if ctx.resume else None
        if saved is not None and saved.tensors.get("logits") is not None and len(saved.tensors["logits"]) == len(aux):
            seconds = float(saved.meta.get("seconds", 0.0))  # files written before it was kept: unknown, 0
            ctx.add_prior_seconds(seconds)
            return saved.tensors["logits"].to(ctx.device), seconds
        start = time.perf_counter()
        teachers = [prepare(m, ctx.device, channels_last=True) for m in models.values()]  # NHWC: faster convs
        with autocast(ctx.device, self.params["precision"]):
            logits = predict_logits(
                Ensemble(teachers), aux, ctx.device,
                progress=lambda starts: ctx.progress(starts, desc=f"feddf: teacher logits on {len(aux)} {aux_name} "
                                                     "images", unit="batch"))
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        Payload({"logits": logits}, {"key": key, "seconds": time.perf_counter() - start}).write(path)
        return logits, 0.0

    def _distil(self, student: nn.Module, aux: ImageDataset, teacher_logits: torch.Tensor, ctx: ServerContext,
                track: bool, seed: int, desc: str, checkpoint: Path, key: str) -> float:
        """``steps`` Adam steps (cosine decay) of KL to the teacher logits on random auxiliary batches;
        evaluated every ``eval_every`` steps (only the headline student counts towards best accuracy).
        Resumes from, and saves to, ``checkpoint`` (module docstring). Returns the wall seconds this
        distillation ran before its checkpoint (0 without one), which it counts as work before the resume."""
        p = self.params
        bf16 = p["precision"] == "bf16"
        if bf16:  # NHWC: oneDNN's fast bf16 convolutions; handed back contiguous below
            prepare(student, ctx.device, channels_last=True)
        opt = torch.optim.Adam(student.parameters(), lr=p["lr"])
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=p["steps"])
        g = torch.Generator().manual_seed(seed)
        ckpt = StageCheckpoint(checkpoint, key, CHECKPOINT_EVERY_S)
        state = ckpt.load(student, opt, g) if ctx.resume else Resumed()
        with warnings.catch_warnings():  # fast-forwarding the schedule: no optimiser step is due
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            for _ in range(state.done):
                schedule.step()
        done, history, prior = state.done, state.history, state.seconds
        ctx.add_prior_seconds(prior)
        began = time.perf_counter()
        if done:  # per student: {architecture: steps done before this run}
            ctx.record.setdefault("resumed_from_step", {})[checkpoint.stem.removeprefix("checkpoint-")] = done
        if track:
            ctx.trim_log(done if done else -1)  # -1: a fresh start drops every old row
            ctx.restore_history(history)
        bar = ctx.progress(range(done + 1, p["steps"] + 1), desc=desc, unit="step", initial=done, total=p["steps"])
        with stop_deferred() as stop:
            for step in bar:
                idx = torch.randint(0, len(aux), (p["batch_size"],), generator=g)
                student.train()
                x, _ = aux.batch(idx, ctx.device)
                with autocast(ctx.device, p["precision"]):
                    out = student(x)
                loss = kl_div(teacher_logits[idx.to(teacher_logits.device)], out.float(), p["temperature"])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                schedule.step()
                if track and (step % p["eval_every"] == 0 or step == p["steps"]):
                    acc = ctx.evaluate(student)["accuracy"]
                    history.append(acc)
                    ctx.log(step, accuracy=acc, kd_loss=float(loss.detach()))
                    bar.set_postfix(acc=f"{acc:.2f}")
                if (got := stop()) or ckpt.due(final=step == p["steps"]):
                    ckpt.save(student, opt, g, step, history, prior + time.perf_counter() - began)
                    if got:
                        raise KeyboardInterrupt  # leaves the block, which delivers the signal
        if bf16:  # hand the student back contiguous (as the uploads were built)
            student.to(memory_format=torch.contiguous_format)
        return prior
