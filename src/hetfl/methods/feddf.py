"""FedDF (Lin et al., NeurIPS 2020), one-shot: ensemble distillation on unlabeled auxiliary data.

The global model starts from FedAvg of the uploads when every client uses the server
architecture (otherwise from scratch) and is distilled from the uniform average of the client
logits, ``KL(softmax(P/T) || softmax(s/T)) T^2`` with T = 1, on images of an auxiliary dataset whose
labels are never used: Fashion-MNIST for MNIST, MNIST for Fashion-MNIST (FedHydra's setting),
CIFAR-100 for CIFAR-10 and the reverse, CIFAR-10 for SVHN/CINIC-10; ``aux_dataset`` overrides.
Auxiliary images are resized and converted to the task's shape when they differ.

Defaults from the public code: Adam lr 1e-3 with cosine decay, batch 128. Budget: ``steps``
server batches (the README uses 10,000; default 2,000 here). The public code early-stops on a
held-out validation split; we report the final model and the best test accuracy over
evaluations (every ``eval_every`` steps), as the other one-shot methods do.
Teacher logits on the auxiliary set are computed once (the teachers are fixed and there is no
augmentation), not per step; that pass has its own progress bar and its seconds are recorded
(``teacher_seconds``, then ``distill_seconds``): with five VGG-9 teachers on 60,000 images it is
most of the first evaluation interval (18.6 min against 1.9 s per student step on a 2-core AVX2 CPU).
The teachers run in channels_last for that pass (VGG-9 inference 2.5 s per 1,000 images against
3.2-3.7 s contiguous there; logits equal up to float summation order, 1.7e-8).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.data import ImageDataset, load_dataset
from hetfl.fl.aggregate import Ensemble, weighted_average
from hetfl.fl.datafree import kl_div
from hetfl.fl.method import OneShotMethod, ServerContext, derive_seed, register
from hetfl.fl.payload import Payload
from hetfl.fl.training import predict_logits, prepare
from hetfl.methods.common import client_models

AUXILIARY = {"mnist": "fmnist", "fmnist": "mnist", "emnist": "mnist", "cifar10": "cifar100",
             "cifar100": "cifar10", "svhn": "cifar10", "cinic10": "cifar100", "synthetic": "synthetic"}


def adapt(images: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """uint8 images to the task's (channels, size): resize bilinearly, average or repeat channels."""
    c, h, w = shape
    x = images
    if x.shape[1] != c:  # grey <-> colour: average the channels, repeat to the task's count
        x = x.float().mean(dim=1, keepdim=True).repeat(1, c, 1, 1)
    if tuple(x.shape[2:]) != (h, w):
        x = F.interpolate(x.float(), size=(h, w), mode="bilinear", align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8)


def auxiliary_images(name: str, ctx: ServerContext, size: int) -> ImageDataset:
    if name == "synthetic":  # another draw of patterns: same shape, different prototypes
        c, h, _ = ctx.shape
        data = load_dataset("synthetic", options={"classes": ctx.num_classes, "channels": c, "size": h,
                                                  "train_per_class": max(size // ctx.num_classes, 10),
                                                  "seed": ctx.seed + 1000}).train
    else:
        data = load_dataset(name, ctx.data_root).train
    if size and size < len(data):
        g = torch.Generator().manual_seed(derive_seed(ctx.seed, "feddf-aux"))
        data = data.subset(torch.randperm(len(data), generator=g)[:size])
    x = adapt(data.x, ctx.shape)
    return ImageDataset(x, torch.zeros(len(x), dtype=torch.long), ctx.num_classes, f"{name} (unlabeled)")


@register("feddf")
class FedDF(OneShotMethod):
    name = "feddf"
    defaults: dict[str, Any] = {"steps": 2000, "batch_size": 128, "lr": 1e-3, "temperature": 1.0,
                                "aux_dataset": None, "aux_size": 0, "eval_every": 100}

    def server(self, uploads: dict[int, Payload], ctx: ServerContext) -> dict[str, nn.Module]:
        p = self.params
        models = client_models(uploads, ctx)
        aux_name = p["aux_dataset"] or AUXILIARY.get(ctx.dataset)
        if aux_name is None:
            raise ValueError(f"feddf: no default auxiliary dataset for {ctx.dataset!r}; set aux_dataset")
        aux = auxiliary_images(aux_name, ctx, int(p["aux_size"]))
        start = time.perf_counter()  # one pass of every teacher over the auxiliary set: long with VGG-9s
        teachers = [prepare(m, ctx.device, channels_last=True) for m in models.values()]  # NHWC: faster convs
        teacher_logits = predict_logits(
            Ensemble(teachers), aux, ctx.device,
            progress=lambda starts: ctx.progress(starts, desc=f"feddf: teacher logits on {len(aux)} {aux_name} images",
                                                 unit="batch"))
        ctx.record["teacher_seconds"] = round(time.perf_counter() - start, 1)
        student = ctx.build(ctx.server_arch, purpose="feddf-student")
        if all(a == ctx.server_arch for a in ctx.client_archs):
            student.load_state_dict(weighted_average([m.state_dict() for m in models.values()],
                                                     [uploads[c].meta["num_samples"] for c in models]))
            ctx.record["init"] = "fedavg"
        else:
            ctx.record["init"] = "random (heterogeneous clients)"
        opt = torch.optim.Adam(student.parameters(), lr=p["lr"])
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=p["steps"])
        g = torch.Generator().manual_seed(derive_seed(ctx.seed, "feddf-batches"))
        bar = ctx.progress(range(1, p["steps"] + 1), desc="feddf: distillation", unit="step")
        for step in bar:
            idx = torch.randint(0, len(aux), (p["batch_size"],), generator=g)
            student.train()
            x, _ = aux.batch(idx, ctx.device)
            loss = kl_div(teacher_logits[idx.to(teacher_logits.device)], student(x), p["temperature"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            if step % p["eval_every"] == 0 or step == p["steps"]:
                acc = ctx.evaluate(student)["accuracy"]
                ctx.log(step, accuracy=acc, kd_loss=float(loss.detach()))
                bar.set_postfix(acc=f"{acc:.2f}")
        ctx.record["aux_dataset"] = aux_name
        ctx.record["distill_seconds"] = round(time.perf_counter() - start - ctx.record["teacher_seconds"], 1)
        return {"feddf": student}
