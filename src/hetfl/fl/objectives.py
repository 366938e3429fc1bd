"""Named extra terms of a client's local objective, added to the cross-entropy of ``train_classifier``.

A request lists its terms in ``meta["terms"]`` (name -> settings); each is built on the client from the
request, the model it starts from (the received global model) and the client's state, so a baseline
that changes the local objective is a few lines of its server part, not a new training loop:

* ``proximal`` (FedProx, Li et al. 2020, Eq. 2): ``mu/2 ||w - w_g||^2`` over the trainable parameters,
  ``w_g`` the received weights.
* ``contrastive`` (MOON, Li et al. 2021, Eq. 3): ``mu CE([cos(z, z_g), cos(z, z_prev)] / tau, 0)`` on the
  projection ``z`` (a model with ``projection`` and ``head``), ``z_g`` from the received model and
  ``z_prev`` from the client's previous local model, kept in its state under ``prev_model.``; no term
  at a client's first participation; the trained model becomes the stored one.
* ``kd`` (self-distillation, FedGKD, KDIA Eq. 11): ``weight [T^2] KL(p_t/T || p_s/T)`` against a model sent
  in the request's tensors under ``<model>/`` (default ``teacher/``); ``t2: false`` drops the T^2 factor
  (KDIA), ``direction: code`` takes KL(p_s/T || p_t/T) (KDIA's code).
* ``generated`` (KDIA Eq. 12): ``weight CE(classify(G(eps, y~)), y~)`` with a frozen
  :class:`~hetfl.models.generator.FeatureGenerator` sent under ``generator/``, ``eps ~ N(0, I)`` and
  ``y~`` uniform labels, one per real sample of the batch (``N_k E`` per batch where the client holds
  fewer than a batch), drawn from a stream seeded by the request.
* ``fedcog`` (FedCOG, Ye et al. 2024): before training, the client optimises ``size`` images from noise
  (Adam ``lr``, ``steps``) for labels in proportion to ``max_count - count_c`` of its histogram:
  ``CE(global(x), y) + adv (1 - JS(prev(x), global(x)))``, prev its previous local model (client state;
  the received model at a first participation); local loss = ``real`` x CE + ``syn`` x KL(global || model)
  on a synthetic batch per step (``real = n/(n + n_syn)``, ``syn = n_syn/(n + n_syn)``,
  ``n_syn = sum_c (max_count - count_c)``; ``kd_weight >= 0``: ``real`` 1 and ``syn`` = kd_weight).
* ``fedgen`` (FedGen, Zhu et al. 2021): with a frozen :class:`~hetfl.models.generator.LatentGenerator` sent
  under ``generator/`` (the input of the model's ``head``): ``beta KL(p_G || p_model(x))``, p_G the head's
  softmax on G(eps, y) for the batch's labels, plus ``alpha CE(head(G(eps, y')), y')`` with y' drawn from
  the client's own labels (one per sample); ``noise: normal | uniform`` (the authors' code: uniform).

* ``remember``: no loss; the trained model becomes the client's previous local model.

A term with a zero weight is not built, so such a request trains exactly as plain cross-entropy.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.fl.training import count_sample_passes

PREV_MODEL = "prev_model."  # client-state prefix of MOON's previous local model


class Term:
    """One extra loss term: ``term(model, x, y, logits, z)``; ``after(model, state)`` once trained."""

    needs_projection = False
    adds_loss = True
    ce_weight = 1.0  # the weight this term puts on the cross-entropy (FedCOG's real-data share)

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor,
                 z: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def after(self, model: nn.Module, state: dict[str, Any]) -> None:
        return None


class Proximal(Term):
    def __init__(self, mu: float, start: nn.Module) -> None:
        self.mu = mu
        self.anchor = [p.detach().clone() for p in start.parameters() if p.requires_grad]

    def __call__(self, model, x, y, logits, z):  # noqa: ANN001, ANN204
        params = [p for p in model.parameters() if p.requires_grad]
        return self.mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(params, self.anchor))


def _frozen(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class Contrastive(Term):
    needs_projection = True

    def __init__(self, mu: float, tau: float, start: nn.Module, state: dict[str, Any]) -> None:
        self.mu, self.tau = mu, tau
        self.global_model = _frozen(start)
        prev = {k[len(PREV_MODEL):]: v for k, v in state.items() if k.startswith(PREV_MODEL)}
        self.prev_model = None
        if prev:
            self.prev_model = _frozen(start)
            self.prev_model.load_state_dict(prev)

    def __call__(self, model, x, y, logits, z):  # noqa: ANN001, ANN204
        if self.prev_model is None:  # a first participation: no previous local model yet
            return z.new_zeros(())
        with torch.no_grad():
            z_g = self.global_model.projection(self.global_model.extract(x))
            z_prev = self.prev_model.projection(self.prev_model.extract(x))
        sims = torch.stack([F.cosine_similarity(z, z_g, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], dim=1)
        target = torch.zeros(len(x), dtype=torch.long, device=x.device)
        return self.mu * F.cross_entropy(sims / self.tau, target)

    def after(self, model: nn.Module, state: dict[str, Any]) -> None:
        keep_as_previous(model, state)


def keep_as_previous(model: nn.Module, state: dict[str, Any]) -> None:
    """Store ``model`` as the client's previous local model (``prev_model.`` in its state)."""
    for key in [k for k in state if k.startswith(PREV_MODEL)]:
        del state[key]
    state.update({PREV_MODEL + k: v.detach().cpu().clone() for k, v in model.state_dict().items()})


class Remember(Term):
    """No loss: the trained model becomes the client's previous local model (``remember``)."""

    adds_loss = False

    def after(self, model: nn.Module, state: dict[str, Any]) -> None:
        keep_as_previous(model, state)


class Distillation(Term):
    def __init__(self, weight: float, temperature: float, teacher: nn.Module, t2: bool = True,
                 direction: str = "paper") -> None:
        self.weight, self.t = weight * (temperature ** 2 if t2 else 1.0), temperature
        self.teacher, self.direction = _frozen(teacher), direction

    def __call__(self, model, x, y, logits, z):  # noqa: ANN001, ANN204
        with torch.no_grad():
            log_teacher = F.log_softmax(self.teacher(x).float() / self.t, dim=1)
        log_student = F.log_softmax(logits.float() / self.t, dim=1)
        if self.direction == "code":  # KL(student || teacher), the gradient through the student's side
            return self.weight * F.kl_div(log_teacher, log_student, reduction="batchmean", log_target=True)
        return self.weight * F.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True)


class Generated(Term):
    """KDIA's generated features (Sec. 5.3): the labels are drawn uniformly once, one per real sample
    (N_k E for a client with fewer samples than a batch), and consumed in order, a batch's worth per step
    (as many as the real batch holds); when the rest is shorter than the batch (an epoch is over) they are
    reshuffled and read from the start again. A client below the batch size takes one step an epoch, so it
    uses N_k other labels in each of its E epochs. Noise is drawn anew every step."""

    def __init__(self, weight: float, generator: nn.Module, num_samples: int, batch_size: int, epochs: int,
                 seed: int) -> None:
        self.weight, self.generator = weight, _frozen(generator)
        self.rng = torch.Generator().manual_seed(seed)
        size = num_samples * epochs if num_samples < batch_size else num_samples  # KDIA's small-client rule
        self.labels = torch.randint(0, self.generator.num_classes, (max(size, 1),), generator=self.rng)
        self.cursor = 0

    def next_labels(self, n: int) -> torch.Tensor:
        """The next ``n`` labels of the sequence, reshuffled once the rest is shorter than ``n``."""
        n = min(n, len(self.labels))
        if self.cursor + n > len(self.labels):
            self.labels = self.labels[torch.randperm(len(self.labels), generator=self.rng)]
            self.cursor = 0
        out = self.labels[self.cursor: self.cursor + n]
        self.cursor += n
        return out

    def __call__(self, model, x, y, logits, z):  # noqa: ANN001, ANN204
        labels = self.next_labels(len(x))
        n = len(labels)
        noise = torch.randn(n, self.generator.noise_dim, generator=self.rng)
        with torch.no_grad():
            features = self.generator(noise.to(x.device), labels.to(x.device))
        return self.weight * F.cross_entropy(model.classify(features), labels.to(x.device))


class FedGenTerm(Term):
    def __init__(self, alpha: float, beta: float, generator: nn.Module, labels: torch.Tensor, noise: str,
                 seed: int) -> None:
        self.alpha, self.beta, self.generator, self.noise = alpha, beta, _frozen(generator), noise
        self.labels = labels  # the labels this client holds
        self.rng = torch.Generator().manual_seed(seed)

    def _generate(self, y: torch.Tensor) -> torch.Tensor:
        shape = (len(y), self.generator.noise_dim)
        draw = torch.rand if self.noise == "uniform" else torch.randn
        eps = draw(shape, generator=self.rng)
        with torch.no_grad():
            return self.generator(eps.to(y.device), y)

    def __call__(self, model, x, y, logits, z):  # noqa: ANN001, ANN204
        with torch.no_grad():
            target = F.softmax(model.head(self._generate(y)), dim=1)
        latent = F.kl_div(F.log_softmax(logits, dim=1), target, reduction="batchmean")
        sampled = self.labels[torch.randint(0, len(self.labels), (len(y),), generator=self.rng)].to(y.device)
        teacher = F.cross_entropy(model.head(self._generate(sampled)), sampled)
        return self.beta * latent + self.alpha * teacher


def complement_labels(counts: torch.Tensor, size: int) -> torch.Tensor:
    """``size`` labels in proportion to ``max(counts) - counts`` (largest remainders), class-sorted;
    all classes alike where the histogram is flat."""
    gap = (counts.max() - counts).double()
    if float(gap.sum()) == 0:
        gap = torch.ones_like(gap)
    share = gap / gap.sum() * size
    n = share.floor().long()
    rest = size - int(n.sum())
    n[torch.argsort(share - n, descending=True, stable=True)[:rest]] += 1
    return torch.repeat_interleave(torch.arange(len(counts)), n)


def js_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence of two softmax distributions, batch mean, in log space: a probability
    that underflows to 0 adds 0 with a finite gradient (``p log p`` on probabilities gives NaN there)."""
    log_p, log_q = F.log_softmax(p_logits, dim=1), F.log_softmax(q_logits, dim=1)
    log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
    return (F.kl_div(log_m, log_p, reduction="batchmean", log_target=True)
            + F.kl_div(log_m, log_q, reduction="batchmean", log_target=True)) / 2


class FedCOGTerm(Term):
    def __init__(self, settings: dict[str, Any], start: nn.Module, state: dict[str, Any],
                 context: dict[str, Any]) -> None:
        device = next(start.parameters()).device
        self.rng = torch.Generator().manual_seed(int(context["seed"]))
        self.global_model = _frozen(start)
        prev = {k[len(PREV_MODEL):]: v for k, v in state.items() if k.startswith(PREV_MODEL)}
        prev_model = _frozen(start)
        if prev:
            prev_model.load_state_dict(prev)
        counts = torch.as_tensor(context["label_counts"])
        self.y = complement_labels(counts, int(settings["size"])).to(device)
        layout = torch.channels_last if context.get("channels_last") else torch.contiguous_format
        x = torch.randn((len(self.y), *context["shape"]), generator=self.rng).to(device)
        x = x.contiguous(memory_format=layout).requires_grad_(True)  # the models' layout (faster NHWC convs)
        opt = torch.optim.Adam([x], lr=float(settings["lr"]))
        for _ in range(int(settings["steps"])):
            t_out = self.global_model(x)
            loss = F.cross_entropy(t_out, self.y) + float(settings["adv"]) * (1 - js_divergence(prev_model(x), t_out))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            count_sample_passes(len(self.y))
        self.x = x.detach()
        with torch.no_grad():
            self.target = F.softmax(self.global_model(self.x), dim=1)
        n_syn, n = float((counts.max() - counts).sum()), float(counts.sum())
        kd = float(settings.get("kd_weight", -1.0))
        self.ce_weight, self.syn = (1.0, kd) if kd >= 0 else (n / (n + n_syn), n_syn / (n + n_syn))
        self.batch, self.layout = int(context["batch_size"]), layout

    def __call__(self, model, x, y, logits, z):  # noqa: ANN001, ANN204
        idx = torch.randint(0, len(self.x), (min(self.batch, len(self.x)),), generator=self.rng).to(self.x.device)
        batch = self.x[idx].contiguous(memory_format=self.layout)
        kl = F.kl_div(F.log_softmax(model(batch), dim=1), self.target[idx], reduction="batchmean")
        return self.syn * kl

    def after(self, model: nn.Module, state: dict[str, Any]) -> None:
        keep_as_previous(model, state)


def build_terms(spec: dict[str, dict[str, Any]], start: nn.Module, tensors: dict[str, torch.Tensor],
                state: dict[str, Any], context: dict[str, Any] | None = None) -> list[Term]:
    """The terms a request names (module docstring); ``start``: the model before local training;
    ``context``: the client's ``num_samples``, ``batch_size``, ``epochs`` and the request's ``seed``."""
    context = context or {}
    terms: list[Term] = []
    for name, settings in spec.items():
        if name == "proximal":
            if float(settings["mu"]) > 0:
                terms.append(Proximal(float(settings["mu"]), start))
        elif name == "contrastive":
            if not (hasattr(start, "projection") and hasattr(start, "head")):
                raise ValueError(f"the contrastive term needs a model with a projection head, "
                                 f"not {type(start).__name__}")
            if float(settings["mu"]) > 0:
                terms.append(Contrastive(float(settings["mu"]), float(settings["tau"]), start, state))
        elif name == "kd":
            if float(settings["weight"]) > 0:
                prefix = f"{settings.get('model', 'teacher')}/"
                teacher = copy.deepcopy(start)
                teacher.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
                terms.append(Distillation(float(settings["weight"]), float(settings["temperature"]), teacher,
                                          bool(settings.get("t2", True)), str(settings.get("direction", "paper"))))
        elif name == "generated":
            if float(settings["weight"]) > 0:
                from hetfl.models.generator import FeatureGenerator

                generator = FeatureGenerator(int(settings["noise_dim"]), int(settings["num_classes"]),
                                             tuple(settings["feature_shape"]))
                generator.load_state_dict({k[10:]: v for k, v in tensors.items() if k.startswith("generator/")})
                terms.append(Generated(float(settings["weight"]), generator.to(next(start.parameters()).device),
                                       int(context["num_samples"]), int(context["batch_size"]),
                                       int(context["epochs"]), int(context["seed"])))
        elif name == "remember":
            terms.append(Remember())
        elif name == "fedcog":
            terms.append(FedCOGTerm(settings, start, state, context))
        elif name == "fedgen":
            from hetfl.models.generator import LatentGenerator

            generator = LatentGenerator(int(settings["noise_dim"]), int(settings["num_classes"]),
                                        int(settings["hidden"]), int(settings["latent_dim"]))
            generator.load_state_dict({k[10:]: v for k, v in tensors.items() if k.startswith("generator/")})
            held = torch.nonzero(torch.as_tensor(context["label_counts"]) > 0).flatten()
            terms.append(FedGenTerm(float(settings["alpha"]), float(settings["beta"]),
                                    generator.to(next(start.parameters()).device), held,
                                    str(settings.get("noise", "normal")), int(context["seed"])))
        else:
            raise ValueError(f"unknown loss term {name!r}; known: contrastive, fedcog, fedgen, generated, kd, "
                             "proximal, remember")
    return terms


def objective(terms: list[Term]) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """Cross-entropy plus ``terms`` as a ``local_train`` loss (None: no terms, plain cross-entropy)."""
    terms = [t for t in terms if t.adds_loss]
    if not terms:
        return None
    projection = any(t.needs_projection for t in terms)
    ce_weight = math.prod(t.ce_weight for t in terms)

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = model.projection(model.extract(x)) if projection else None
        logits = model.head(z) if projection else model(x)
        ce = F.cross_entropy(logits, y)
        return (ce if ce_weight == 1.0 else ce_weight * ce) + sum(t(model, x, y, logits, z) for t in terms)

    return loss
