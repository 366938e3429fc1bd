"""FedMHO, FedMHO-MD and FedMHO-SD: model-heterogeneous one-shot FL with classification and
generative clients.

Paper: "FedMHO: Heterogeneous One-Shot Federated Learning Towards Resource-Constrained Edge
Devices" (Yao, Shi, Liu, Xu; ../shared/seeds/004_*.txt), Alg. 1 and 2:

* **Clients** (Alg. 1 lines 3-7): classification clients train with CE (Eq. 2) and upload their
  classifier (the shared ``train_classifier`` request, so the upload cache serves them); generative
  clients train a CVAE with ``recon + KL`` (Eq. 3, Adam) and upload the decoder and their label
  histogram (``train_cvae``).
* **Initialisation** (Eq. 4): ``w_0 = 1/|K_C| sum_k w_k``, the plain mean of the classification
  clients; with heterogeneous classifiers, ensemble distillation (Sec. 5.6): a fresh server model
  trained with ``KL(mean client logits || student)`` for ``init_epochs`` (Adam, ``init_lr``).
* **Data generation** (Alg. 1 lines 10-14): ``num_samples`` N = 6,000 images, ``z ~ N(0, I)``.
* **Unsupervised data optimisation** (Alg. 2): per class, 1-cluster K-means on the flattened pixels
  keeps the ``round(R_th * n_c)`` samples nearest the centre (halves up), ``r_th`` = 0.8.
* **Knowledge fusion**: FedMHO trains on the synthetic set with CE (Eq. 5); MD adds
  ``KL(mean_k h_k(x) || h(x))`` over the classification clients (Eq. 6), SD uses the frozen ``w_0``
  as teacher (Eq. 7); both minimise ``lam * CE + (1 - lam) * KL`` (Eq. 8, lam = 0.5).

Choices the paper leaves open (defaults; the authors' code where it decides):
* Distillation init data: the synthetic set, the only data the server has.
* Per-class budget (the code): N/C per class, split among the decoders by ``count_kc^2 / sum_k
  count_kc^2`` (uniform if no decoder holds c), largest-remainder rounding; z untruncated (the code).
* KL: per sample at temperature 1 (the equations have none), batch mean; the code's ``KLDivLoss()`` also
  divides by the class count (``kl_reduction: mean``; the presets ``fedmho_md_klmean``, ``fedmho_sd_klmean``).
* Fixed teachers, no augmentation: teacher logits computed once. MD and SD record their teacher's
  entropy and argmax agreement with the synthetic labels (``teacher`` in the summary).
* Per-dataset defaults (Table 3; ``null`` = the paper's value): server epochs 10 / 20 / 20 / 30 and
  Adam lr 1e-5 / 5e-4 / 5e-5 / 5e-5 for MNIST / Fashion / SVHN / EMNIST (others 20, 1e-4: the code's
  CIFAR-10); CVAE lr 5e-2 / 5e-2 / 1e-3 / 3e-3, 30 / 40 / 40 / 50 epochs (others 1e-3, 30); batch 64.
* Accuracy after every server epoch (epoch 0 = ``w_0``, Fig. 6's forgetting curve); the headline is
  the last epoch's model, ``<name>[init]`` is ``w_0``.
Ours (not in the paper): ``init_weights: samples`` (w_0 by sample count); ``init: random`` (no Eq. 4,
as the code's ``one_shot=True``; SD's teacher is then that model); ``filter: false`` (no Alg. 2,
Table 6); ``freeze_bn`` (BatchNorm in eval mode during fusion: the paper's VGG-9 has none);
``precision: bf16`` / ``channels_last`` for the server's training (teacher logits and the final
evaluation stay fp32); resumable server stages (:meth:`GenerativeMethod.train_stage`), with the
synthetic set drawn again from the same decoders and seeds on a resume.
"""

from __future__ import annotations

import copy
import json
from typing import Any, ClassVar

import torch
from torch import nn

from hetfl.fl.aggregate import weighted_average
from hetfl.fl.cache import uploads_digest
from hetfl.fl.checkpoint import Resumed, StageCheckpoint
from hetfl.fl.generative import (
    CVAETrain,
    FusionConfig,
    allocate_per_class,
    cvae_message,
    decoder_from_upload,
    generate,
    kmeans_filter,
    teacher_logits,
    teacher_stats,
    train_on_synthetic,
)
from hetfl.fl.method import OneShotMethod, ServerContext, derive_seed, register
from hetfl.fl.payload import Payload
from hetfl.methods.common import classifier_from_upload
from hetfl.models.cvae import CVAE_NAMES

# Table 3 (and the code for datasets the paper does not use): (server epochs, server lr).
SERVER_DEFAULTS = {"mnist": (10, 1e-5), "fmnist": (20, 5e-4), "svhn": (20, 5e-5), "emnist": (30, 5e-5)}
OTHER_SERVER = (20, 1e-4)
# (CVAE local epochs, CVAE Adam lr).
CVAE_DEFAULTS = {"mnist": (30, 5e-2), "fmnist": (40, 5e-2), "svhn": (40, 1e-3), "emnist": (50, 3e-3)}
OTHER_CVAE = (30, 1e-3)

GENERATIVE_DEFAULTS: dict[str, Any] = {
    "cvae": "cvae_small", "latent_dim": 20, "cvae_epochs": None, "cvae_lr": None, "cvae_batch_size": 64,
    "num_samples": 6000, "epochs": None, "lr": None, "batch_size": 64, "eval_every": 1,
    "precision": "fp32", "channels_last": False,
}


def resolve_names(spec: Any, ids: list[int], key: str) -> dict[int, str]:
    """A CVAE name per client: one name, or a list assigned round-robin over ``ids``."""
    names = [spec] if isinstance(spec, str) else list(spec or [])
    if not names:
        raise ValueError(f"{key} must be a CVAE name or a non-empty list of names")
    bad = sorted({n for n in names if n not in CVAE_NAMES}, key=str)
    if bad:
        raise ValueError(f"{key}: unknown cvae {bad}; choose from {list(CVAE_NAMES)}")
    return {cid: names[i % len(names)] for i, cid in enumerate(ids)}


class GenerativeMethod(OneShotMethod):
    """Common part of FedMHO and FedCVAE: validated CVAE/server settings, per-dataset defaults,
    CVAE requests and decoder uploads, resumable training stages on the synthetic set."""

    CHECKPOINT_EVERY_S: ClassVar[float] = 300.0  # a training stage saves its state this often (and at its end)
    # None: the per-dataset default; cvae: one name or a list of names (checked by resolve_names)
    ranges: ClassVar[dict[str, dict[str, Any]]] = {
        "cvae": {"type": "any"}, "generative_clients": {"type": "any"},
        "cvae_epochs": {"type": "int", "ge": 1}, "cvae_lr": {"type": "float", "gt": 0},
        "epochs": {"type": "int", "ge": 1}, "lr": {"type": "float", "gt": 0}, "num_samples": {"ge": 1},
        "latent_dim": {"ge": 1}, "cvae_batch_size": {"ge": 1}}

    def cvae_train(self, ctx: ServerContext) -> CVAETrain:
        epochs, lr = CVAE_DEFAULTS.get(ctx.dataset, OTHER_CVAE)
        p = self.params
        return CVAETrain(epochs=p["cvae_epochs"] if p["cvae_epochs"] is not None else epochs,
                         batch_size=p["cvae_batch_size"], lr=p["cvae_lr"] if p["cvae_lr"] is not None else lr)

    def fusion(self, ctx: ServerContext, lam: float = 1.0) -> FusionConfig:
        epochs, lr = SERVER_DEFAULTS.get(ctx.dataset, OTHER_SERVER)
        p = self.params
        return FusionConfig(epochs=p["epochs"] if p["epochs"] is not None else epochs, batch_size=p["batch_size"],
                            lr=p["lr"] if p["lr"] is not None else lr, lam=lam,
                            kl_reduction=p.get("kl_reduction", "batchmean"), eval_every=p["eval_every"],
                            freeze_bn=p.get("freeze_bn", False), precision=p["precision"],
                            channels_last=p["channels_last"])

    def generative_ids(self, ctx: ServerContext) -> list[int]:
        raise NotImplementedError

    def train_stage(self, stage: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: FusionConfig,
                    uploads: dict[int, Payload], ctx: ServerContext, teacher: torch.Tensor | None = None,
                    tracked: bool = True, desc: str = "") -> list[float]:
        """:func:`train_on_synthetic` as a resumable stage of the server (ours; the public codes have no
        checkpoints): its state goes to ``checkpoint-<stage>.safetensors`` in the method's folder every
        ``CHECKPOINT_EVERY_S`` seconds, after its last epoch and on SIGINT or SIGTERM, keyed by the
        method's settings, the seed, the server model and the uploads' digest. The same run again goes
        on from there; a ``tracked`` stage (evaluated and logged) then drops the rows logged after the
        checkpoint and restores its earlier evaluations for best-over-epochs. The files go when the
        method is done (:meth:`clear_stages`)."""
        key = json.dumps({"method": self.name, "params": self.params, "seed": ctx.seed, "stage": stage,
                          "server": ctx.server_arch, "lam": cfg.lam,
                          "uploads": ctx.record.get("uploads_sha256") or uploads_digest(uploads)},
                         sort_keys=True, default=str)
        ckpt = StageCheckpoint(ctx.out_dir / f"checkpoint-{stage}.safetensors", key, self.CHECKPOINT_EVERY_S)
        if not ctx.resume:
            ckpt.clear()

        def resumed(state: Resumed) -> None:
            ctx.add_prior_seconds(state.seconds)
            if state.done:
                ctx.record.setdefault("resumed_from_epoch", {})[stage] = state.done
            if tracked:
                ctx.trim_log(state.done if state.done else -1)  # -1: a fresh start drops every old row
                ctx.restore_history(state.history)

        return train_on_synthetic(model, x, y, cfg, derive_seed(ctx.seed, self.name, stage), teacher=teacher,
                                  evaluate=ctx.evaluate if tracked else None, log=ctx.log if tracked else None,
                                  progress=ctx.progress, desc=desc or f"{self.name}: {stage}", checkpoint=ckpt,
                                  on_resume=resumed)

    @staticmethod
    def clear_stages(ctx: ServerContext) -> None:
        for path in ctx.out_dir.glob("checkpoint-*.safetensors"):
            path.unlink()

    def cvae_names(self, ctx: ServerContext) -> dict[int, str]:
        return resolve_names(self.params["cvae"], self.generative_ids(ctx), f"{self.name}.cvae")

    def check_generative(self, ctx: ServerContext) -> None:
        p = self.params
        if not isinstance(p["latent_dim"], int) or p["latent_dim"] < 1:
            raise ValueError(f"latent_dim must be a positive integer, got {p['latent_dim']!r}")
        if not isinstance(p["num_samples"], int) or p["num_samples"] < 1:
            raise ValueError(f"num_samples must be a positive integer, got {p['num_samples']!r}")
        self.cvae_train(ctx)
        self.fusion(ctx)
        from hetfl.models.cvae import build_cvae

        for name in set(self.cvae_names(ctx).values()):  # a CVAE that cannot take this image shape
            build_cvae(name, ctx.shape[0], ctx.shape[1], ctx.num_classes, p["latent_dim"])

    def cvae_request(self, client_id: int, ctx: ServerContext) -> Payload:
        arch = self.cvae_names(ctx)[client_id]
        return cvae_message(arch, ctx.shape, ctx.num_classes, self.params["latent_dim"], self.cvae_train(ctx),
                            init_seed=derive_seed(ctx.seed, "cvae-init", arch),
                            seed=derive_seed(ctx.seed, "cvae-train", client_id))

    def validate_upload(self, client_id: int, message: Payload, upload: Payload, ctx: ServerContext) -> None:
        """Decoder uploads: the engine's checks (task, client id, finite values) plus the requested
        CVAE, latent size and the decoder's exact tensor names and shapes; classifier uploads as usual."""
        super().validate_upload(client_id, message, upload, ctx)
        if message.meta.get("task") == "train_cvae":
            with torch.random.fork_rng(devices=[]):  # building must not move the caller's RNG
                decoder_from_upload(upload, client_id, message.meta["cvae"], int(message.meta["latent_dim"]),
                                    ctx.shape, ctx.num_classes, torch.device("cpu"))

    def decoders(self, uploads: dict[int, Payload], ctx: ServerContext) -> tuple[list[int], list, torch.Tensor]:
        """(client ids, validated decoders, (K, C) label histograms) of the generative clients."""
        names = self.cvae_names(ctx)
        ids = [c for c in sorted(names) if c in uploads]  # an engine may drop clients that failed
        if not ids:
            raise ValueError(f"{self.name}: no generative client uploaded (expected {sorted(names)})")
        ctx.record["generative_clients"] = ids
        decs = [decoder_from_upload(uploads[c], c, names[c], self.params["latent_dim"], ctx.shape,
                                    ctx.num_classes, ctx.device) for c in ids]
        counts = torch.tensor([uploads[c].meta["label_counts"] for c in ids], dtype=torch.float64)
        return ids, decs, counts


def generative_clients(spec: Any, num_clients: int) -> list[int]:
    """``half`` = the second half of the client ids (clients ceil(K/2) .. K-1, the paper's 5 + 5
    split); or an explicit list of ids."""
    if spec == "half":
        return list(range((num_clients + 1) // 2, num_clients))
    if not isinstance(spec, (list, tuple)) or not all(isinstance(c, int) and not isinstance(c, bool) for c in spec):
        raise ValueError(f"generative_clients must be 'half' or a list of client ids, got {spec!r}")
    bad = sorted(c for c in spec if not 0 <= c < num_clients)
    if bad or len(set(spec)) != len(spec):
        raise ValueError(f"generative_clients {list(spec)}: ids must be distinct and in [0, {num_clients})")
    return sorted(spec)


class FedMHO(GenerativeMethod):
    name = "fedmho"
    kd: ClassVar[str] = "none"  # none | md | sd
    defaults: dict[str, Any] = {
        **GENERATIVE_DEFAULTS, "generative_clients": "half", "r_th": 0.8, "filter": True, "lam": 0.5,
        "kl_reduction": "batchmean", "freeze_bn": False, "init": "auto", "init_weights": "uniform", "init_epochs": None,
        "init_lr": 1e-3,
    }

    # ---- configuration ------------------------------------------------------------------------
    def generative_ids(self, ctx: ServerContext) -> list[int]:
        return generative_clients(self.params["generative_clients"], ctx.num_clients)

    def classification_ids(self, ctx: ServerContext) -> list[int]:
        gen = set(self.generative_ids(ctx))
        return [c for c in range(ctx.num_clients) if c not in gen]

    def init_mode(self, ctx: ServerContext) -> str:
        archs = {ctx.client_archs[c] for c in self.classification_ids(ctx)}
        mode = self.params["init"]
        if mode == "auto":
            return "average" if archs == {ctx.server_arch} else "distill"
        if mode == "average" and archs != {ctx.server_arch}:
            raise ValueError(f"init: average needs every classification client on the server architecture "
                             f"{ctx.server_arch!r}; they use {sorted(archs)} (use init: distill or auto)")
        return mode

    def check(self, ctx: ServerContext) -> None:
        p = self.params
        gen = self.generative_ids(ctx)
        if not gen:
            raise ValueError(f"generative_clients {p['generative_clients']!r} selects no client out of "
                             f"{ctx.num_clients}; FedMHO needs at least one generative client")
        if not self.classification_ids(ctx):
            raise ValueError(f"generative_clients selects all {ctx.num_clients} clients; FedMHO needs at least "
                             "one classification client")
        if not isinstance(p["r_th"], (int, float)) or not 0 < p["r_th"] <= 1:
            raise ValueError(f"r_th (R_th of Alg. 2) must be in (0, 1], got {p['r_th']!r}")
        if not isinstance(p["filter"], bool):
            raise ValueError(f"filter must be true or false, got {p['filter']!r}")
        if p["init"] not in ("auto", "average", "distill", "random"):
            raise ValueError(f"init must be auto, average, distill or random, got {p['init']!r}")
        if p["init_weights"] not in ("uniform", "samples"):
            raise ValueError(f"init_weights must be uniform (Eq. 4) or samples, got {p['init_weights']!r}")
        if not isinstance(p["init_lr"], (int, float)) or p["init_lr"] <= 0:
            raise ValueError(f"init_lr must be positive, got {p['init_lr']!r}")
        self.fusion(ctx, self.lam)
        self.check_generative(ctx)
        self.init_mode(ctx)

    @property
    def lam(self) -> float:
        return 1.0 if self.kd == "none" else self.params["lam"]

    # ---- client side --------------------------------------------------------------------------
    def client_message(self, client_id: int, ctx: ServerContext) -> Payload:
        if client_id in self.generative_ids(ctx):
            return self.cvae_request(client_id, ctx)
        return super().client_message(client_id, ctx)  # the shared train_classifier request

    # ---- server side --------------------------------------------------------------------------
    def decoded(self, uploads: dict[int, Payload], ctx: ServerContext) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
        """Alg. 1 lines 10-13: the unfiltered synthetic set (images, labels) and the (K, C) matrix of
        how many images of each class each generative client's decoder drew (in decoder order)."""
        _, decs, counts = self.decoders(uploads, ctx)
        alloc = allocate_per_class(counts, self.params["num_samples"])
        x, y = generate(decs, alloc, derive_seed(ctx.seed, self.name, "generate"))
        return x, y, alloc

    def synthetic(self, uploads: dict[int, Payload], ctx: ServerContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Alg. 1 lines 10-14: generate, then filter per class (Alg. 2)."""
        x, y, _ = self.decoded(uploads, ctx)
        ctx.record["synthetic_generated"] = len(y)
        if self.params["filter"]:
            keep = kmeans_filter(x, y, float(self.params["r_th"])).to(x.device)
            x, y = x[keep], y[keep]
        ctx.record["synthetic_used"] = len(y)
        return x, y

    def initial_model(self, classifiers: dict[int, nn.Module], uploads: dict[int, Payload], x: torch.Tensor,
                      ctx: ServerContext) -> nn.Module:
        """Eq. 4 (parameter average) or, for heterogeneous classifiers, ensemble distillation;
        ``random`` keeps the fresh server model (ablation)."""
        mode = self.init_mode(ctx)
        ctx.record["init"] = mode
        model = ctx.build(ctx.server_arch, purpose=f"{self.name}-global")
        if mode == "random":
            return model
        if mode == "average":
            ids = sorted(classifiers)
            weights = [uploads[c].meta["num_samples"] if self.params["init_weights"] == "samples" else 1.0
                       for c in ids]
            model.load_state_dict(weighted_average([classifiers[c].state_dict() for c in ids], weights))
            return model
        logits = teacher_logits(list(classifiers.values()), x)
        fusion = self.fusion(ctx, lam=0.0)
        epochs = self.params["init_epochs"] if self.params["init_epochs"] is not None else fusion.epochs
        cfg = FusionConfig(epochs=epochs, batch_size=fusion.batch_size, lr=self.params["init_lr"], lam=0.0,
                           precision=fusion.precision, channels_last=fusion.channels_last)
        dummy = torch.zeros(len(x), dtype=torch.long, device=x.device)  # CE weight is 0: labels unused
        self.train_stage("init", model, x, dummy, cfg, uploads, ctx, teacher=logits, tracked=False,
                         desc=f"{self.name}: ensemble-distillation init")
        return model

    def server(self, uploads: dict[int, Payload], ctx: ServerContext) -> dict[str, nn.Module]:
        ids = [c for c in self.classification_ids(ctx) if c in uploads]  # an engine may drop failed clients
        if not ids:
            raise ValueError(f"{self.name}: no classification client uploaded")
        classifiers = {c: classifier_from_upload(uploads[c], c, ctx) for c in ids}
        x, y = self.synthetic(uploads, ctx)
        model = self.initial_model(classifiers, uploads, x, ctx)
        init = copy.deepcopy(model).eval().requires_grad_(False)  # w_0: SD's frozen teacher
        self.teacher = init
        teacher = None
        if self.kd == "md":
            teacher = teacher_logits(list(classifiers.values()), x)
        elif self.kd == "sd":
            teacher = teacher_logits([init], x)
        if teacher is not None:
            ctx.record["teacher"] = teacher_stats(teacher, y, ctx.num_classes)
        curve = self.train_stage("fuse", model, x, y, self.fusion(ctx, self.lam), uploads, ctx, teacher=teacher,
                                 desc=f"{self.name}: knowledge fusion")
        self.clear_stages(ctx)
        ctx.record["curve"] = curve
        ctx.record["init_accuracy"] = curve[0] if curve else None
        return {self.name: model, f"{self.name}[init]": init}


@register("fedmho_md")
class FedMHOMD(FedMHO):
    name = "fedmho_md"
    kd = "md"


@register("fedmho_sd")
class FedMHOSD(FedMHO):
    name = "fedmho_sd"
    kd = "sd"


register("fedmho")(FedMHO)
