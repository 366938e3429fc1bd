"""KDIA (Ma et al.): knowledge distillation with teacher-student inequitable aggregation (Alg. 1-2).

Per round t (counted from 1), with S_t the sampled clients:

* **Student** (Eq. 1, 10): theta_g = sum over S_t of p_k theta_k, p_k = N_k / sum over the round.
* **Teacher** (Eq. 5-10): theta_T = sum over all clients of F_k theta_k, theta_k client k's last
  accepted upload (the :class:`~hetfl.fl.clientbook.ClientBook` keeps it). ``triFreqs``:
  F^intv ∝ exp(-(t - t_k)) (t_k its last round, 0 before any), F^part ∝ its participation count,
  F^num = N_k over all N clients (``ctx.client_info``); F^tri = their geometric mean, normalised (Eq. 9).
  ``teacher_weights``: ``gm`` (default) | ``am`` (arithmetic mean) | ``intv`` | ``part`` | ``num`` (Table 3);
  under ``am``, ``intv`` and ``num`` a never-seen client weighs in with the initial model (under ``gm`` and
  ``part`` its weight is 0). Before round 1 the teacher is the initial model.
* **Generator** (Eq. 3-4): a :class:`~hetfl.models.generator.FeatureGenerator` (noise ``noise_dim`` 100 +
  label -> the clients' feature map) trained on the server after aggregation: CE of the p_k-weighted sum of
  the round's classifiers' logits on G(eps, y~) (read without Eq. 3's 1/K, as the authors' code), plus
  ``diversity`` x mean|eps_1 - eps_2| / (mean|Z_1 - Z_2| + 1e-5) over the two halves of a batch (Eq. 4); Adam
  (``gen_lr`` 1e-3, weight decay 1e-5; created anew every round, as the authors' code does: the paper is
  silent), ``gen_epochs`` 10 x ``gen_batches`` 200 batches of ``gen_batch_size`` 64; the labels are drawn
  uniformly once per round and reshuffled per epoch (Sec. 5.3). The round's clients receive student, teacher
  and generator (bytes counted as ``model`` and ``generator``); with ``lambda_kd`` 0 no teacher, with
  ``lambda_gen`` 0 no generator (which is then not trained).
* **Clients** (Eq. 11-13): CE + ``lambda_kd`` KL(teacher/tau || student/tau) (``tau`` 2, no tau^2 factor;
  ``kd_direction: code`` = the repository's KL(student || teacher)) + ``lambda_gen`` CE on generated
  features of uniform labels (Sec. 5.3: one per real sample, drawn once per local training and reshuffled
  every epoch; a client with N_k below the batch size draws N_k E labels and uses N_k of them, other ones,
  in each epoch; fresh noise every batch; generator frozen).
  ``lambda_kd`` 0.5; ``lambda_gen`` 1.0 (the paper's beta = 0.5 value; 0.01 at beta 0.1 and 5.0).
* **Final model** (``select``): ``val`` picks student or teacher by their validation accuracy at the last
  round (the default where a validation split exists; ``teacher`` otherwise, which the paper reports as the
  better one); ``teacher`` / ``student`` force one. Both are evaluated and reported every round.

The teacher's client models stay in memory up to ``book_memory_mb`` (2,048 MiB), the rest on disk in the
run folder (:class:`~hetfl.fl.clientbook.ClientBook`); the teacher sums them one at a time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.fl.aggregate import streamed_average, weighted_average
from hetfl.fl.clientbook import ClientBook
from hetfl.fl.method import ServerContext, derive_seed, register
from hetfl.fl.payload import Payload
from hetfl.methods.common import ServerGenerator, client_models, frozen
from hetfl.methods.fedavg import ROUND_DEFAULTS, ROUND_RANGES, FedAvgRounds
from hetfl.models import build_model
from hetfl.models.generator import FeatureGenerator

TEACHER_WEIGHTS = ("gm", "am", "intv", "part", "num")


def tri_freqs(book: ClientBook, round_: int, sizes: torch.Tensor, how: str = "gm") -> torch.Tensor:
    """Teacher weights F_k over all clients after round ``round_`` (module docstring), summing to 1."""
    last = book.last_round.clamp(min=0).double()  # t_k = 0 before any participation
    intv = torch.exp(-(round_ - last))
    intv = intv / intv.sum()
    parts = book.participations.double()
    part = parts / parts.sum() if float(parts.sum()) > 0 else torch.zeros_like(parts)
    num = sizes.double() / sizes.double().sum()
    if how == "gm":
        w = (intv * part * num) ** (1 / 3)
    elif how == "am":
        w = (intv + part + num) / 3
    else:
        w = {"intv": intv, "part": part, "num": num}[how]
    return w / w.sum()


def diversity_loss(noise: torch.Tensor, features: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Eq. 4 over the two halves of a batch: mean|eps_1 - eps_2| / (mean|Z_1 - Z_2| + eps)."""
    half = len(noise) // 2
    num = (noise[:half] - noise[half: 2 * half]).abs().mean()
    den = (features[:half] - features[half: 2 * half]).abs().flatten(1).mean()
    return num / (den + eps)


def train_generator(generator: FeatureGenerator, opt: torch.optim.Optimizer, heads: list[nn.Module],
                    weights: list[float], labels: torch.Tensor, epochs: int, batch_size: int, diversity: float,
                    rng: torch.Generator, device: torch.device) -> float:
    """Eq. 3 + Eq. 4: ``epochs`` passes over ``labels`` (reshuffled each), the heads (``classify``) frozen;
    returns the last batch's loss."""
    generator.train()
    w = torch.tensor(weights, dtype=torch.float32, device=device)
    loss = torch.zeros(())
    for _ in range(epochs):
        order = labels[torch.randperm(len(labels), generator=rng)]
        for start in range(0, len(order), batch_size):
            y = order[start: start + batch_size].to(device)
            noise = torch.randn(len(y), generator.noise_dim, generator=rng).to(device)
            features = generator(noise, y)
            logits = torch.stack([h.classify(features) for h in heads])  # (K, B, C)
            mixed = torch.tensordot(w, logits, dims=1)
            loss = F.cross_entropy(mixed, y) + diversity * diversity_loss(noise, features)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return float(loss.detach())


@register("kdia")
class KDIA(ServerGenerator, FedAvgRounds):
    model_needs = ("extract", "classify", "feature_shape")
    name = "kdia"
    keep_client_models = True
    defaults = {**ROUND_DEFAULTS, "lambda_kd": 0.5, "tau": 2.0, "lambda_gen": 1.0, "kd_direction": "paper",
                "teacher_weights": "gm", "select": "auto", "noise_dim": 100, "gen_epochs": 10, "gen_batches": 200,
                "gen_batch_size": 64, "gen_lr": 1e-3, "gen_weight_decay": 1e-5, "diversity": 1.0,
                "book_memory_mb": 2048.0}
    ranges = {**ROUND_RANGES, "lambda_kd": {"ge": 0}, "lambda_gen": {"ge": 0}, "tau": {"gt": 0},
              "kd_direction": {"choices": ("paper", "code")}, "teacher_weights": {"choices": TEACHER_WEIGHTS},
              "select": {"choices": ("auto", "val", "teacher", "student")}, "noise_dim": {"ge": 1},
              "gen_epochs": {"ge": 0}, "gen_batches": {"ge": 1}, "gen_batch_size": {"ge": 2},
              "gen_lr": {"gt": 0}, "gen_weight_decay": {"ge": 0}, "diversity": {"ge": 0},
              "book_memory_mb": {"ge": 0}}

    def check(self, ctx: ServerContext) -> None:
        super().check(ctx)
        model = build_model(ctx.server_arch, ctx.shape[0], ctx.shape[1], ctx.num_classes)
        if not all(hasattr(model, a) for a in ("extract", "classify", "feature_shape")):
            raise ValueError(f"kdia needs a client model with extract/classify, which {ctx.server_arch!r} lacks")
        if self.params["select"] == "val" and ctx.validate(model) is None:
            raise ValueError("select: val needs a validation split (top-level validation: f > 0)")

    def setup(self, ctx: ServerContext) -> None:
        super().setup(ctx)  # the student, from the shared initialisation
        self.initial = {k: v.detach().clone() for k, v in self.global_model.state_dict().items()}
        self.teacher = ctx.build(ctx.server_arch, purpose="global")
        self.sizes = torch.tensor(ctx.client_info()["num_samples"], dtype=torch.float64)
        torch.manual_seed(derive_seed(ctx.seed, "generator", self.name))
        self.generator = FeatureGenerator(int(self.params["noise_dim"]), ctx.num_classes,
                                          tuple(self.global_model.feature_shape)).to(ctx.device)
        self.gen_opt = self._generator_optimiser(ctx)
        select = self.params["select"]
        self.select = select if select != "auto" else ("val" if ctx.validate(self.teacher) is not None else "teacher")
        self._picked: tuple[int, str] | None = None  # (round evaluated, model label) under select: val

    def _generator_optimiser(self, ctx: ServerContext) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.generator.parameters(), lr=float(self.params["gen_lr"]),
                                weight_decay=float(self.params["gen_weight_decay"]),
                                fused=ctx.device.type == "cpu")  # one kernel for all parameters

    @property
    def labels(self) -> tuple[str, str]:
        return f"{self.name}[student]", f"{self.name}[teacher]"

    def client_message(self, client_id: int, round_: int, ctx: ServerContext) -> Payload:
        """The student, plus the teacher and the generator where their term has a weight (ablations send less)."""
        message = super().client_message(client_id, round_, ctx)
        if float(self.params["lambda_kd"]) > 0:
            message.tensors.update({f"teacher/{k}": v.detach().cpu() for k, v in self.teacher.state_dict().items()})
        if float(self.params["lambda_gen"]) > 0:
            message.tensors.update({f"generator/{k}": v.detach().cpu() for k, v in self.generator.state_dict().items()})
            message.meta["tensor_kinds"] = {"generator/": "generator"}
        return message

    @property
    def trains_generator(self) -> bool:
        return int(self.params["gen_epochs"]) > 0 and float(self.params["lambda_gen"]) > 0

    def terms(self, client_id: int, round_: int, ctx: ServerContext) -> dict[str, dict[str, Any]]:
        p = self.params
        return {"kd": {"weight": p["lambda_kd"], "temperature": p["tau"], "t2": False, "direction": p["kd_direction"]},
                "generated": {"weight": p["lambda_gen"], "noise_dim": p["noise_dim"], "num_classes": ctx.num_classes,
                              "feature_shape": list(self.global_model.feature_shape)}}

    def aggregate(self, round_: int, uploads: dict[int, Payload], ctx: ServerContext) -> None:
        models = client_models(uploads, ctx)
        p_k = [float(uploads[c].meta["num_samples"]) for c in uploads]
        self.global_model.load_state_dict(weighted_average([models[c].state_dict() for c in uploads], p_k))
        self.teacher.load_state_dict(self.teacher_state(round_))
        if self.trains_generator:
            self._train_generator(round_, [models[c] for c in uploads], p_k, ctx)

    def teacher_state(self, round_: int) -> dict[str, torch.Tensor]:
        """sum_k F_k theta_k over every client (the initial model for a never-seen client)."""
        f = tri_freqs(self.book, round_, self.sizes, self.params["teacher_weights"])
        keep = [k for k in range(len(f)) if float(f[k]) > 0]
        states = (self.book.model(k) or self.initial for k in keep)  # one at a time: some may be on disk
        return streamed_average(states, [float(f[k]) for k in keep])

    def _train_generator(self, round_: int, heads: list[nn.Module], p_k: list[float], ctx: ServerContext) -> None:
        p = self.params
        rng = torch.Generator().manual_seed(derive_seed(ctx.seed, "generator", self.name, round_))
        labels = torch.randint(0, ctx.num_classes, (int(p["gen_batches"]) * int(p["gen_batch_size"]),), generator=rng)
        frozen(heads, ctx.device)
        self.gen_opt = self._generator_optimiser(ctx)  # a fresh Adam every round, as the authors' code
        total = sum(p_k)
        loss = train_generator(self.generator, self.gen_opt, heads, [w / total for w in p_k], labels,
                               int(p["gen_epochs"]), int(p["gen_batch_size"]), float(p["diversity"]), rng, ctx.device)
        ctx.record["generator_loss"] = loss

    def models(self) -> dict[str, nn.Module]:
        student, teacher = self.labels
        return {student: self.global_model, teacher: self.teacher}

    def headline(self, ctx: ServerContext) -> str:
        student, teacher = self.labels
        if self.select in ("teacher", "student"):
            return teacher if self.select == "teacher" else student
        stamp = int(self.book.last_round.max())
        if self._picked is None or self._picked[0] != stamp:
            acc = {k: (ctx.validate(m) or {"accuracy": -math.inf})["accuracy"] for k, m in self.models().items()}
            self._picked = (stamp, teacher if acc[teacher] >= acc[student] else student)
        return self._picked[1]
