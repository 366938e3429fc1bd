"""Co-Boosting (Dai et al., ICLR 2024): data-free one-shot FL boosting data and ensemble together.

On the shared loop (:mod:`hetfl.fl.datafree`), with the facts of the public implementation:

* Teacher: weighted ensemble ``P = sum_k w_k F_k(x) / sum_k w_k``, ``w`` initialised to 1/m.
* Generator loss: hard-sample-weighted CE ``mean_i (1 - p_i[y_i]) * CE(P_i, y_i)`` (weights
  detached, exponent ``hs`` = 1) + ``lambda_adv * -T^2 KL(P/T || s/T)`` with ``T = adv_temperature``
  = 3 and **no** disagreement mask + ``lambda_bn * L_BN`` (mean over clients; the shipped scripts
  set ``lambda_bn = 0``, which is our default too). Generator and z re-initialised every epoch;
  the generator's gradient norm clipped to 10 before each Adam step (``generator_grad_clip``; z's
  gradient is not clipped); lowest-loss batch kept.
* Ensemble re-weighting after every epoch but the first: one pass over the pool with
  ``CE(P(x; w), y)``; per batch ``w <- w - mu * wdc^epoch * sign(grad_w)`` (mu 0.01, wdc 0.99), then
  ``w <- clip(w0 + clip(w - w0, -1, 1), 0, 1)``.
* KD on the whole pool each epoch, in batches drawn afresh from all its samples in a random order
  (``pool_shuffle``, as the code's shuffled DataLoader over the pool), after ODS:
  ``x <- x + eta * sign(grad_x sum(r * softmax(P(x)/4)))`` with ``r ~ U(-1, 1)``; student loss
  ``T^2 KL(P/T || s/T)`` with T = 4; the student's gradient norm clipped to 10 (``grad_clip``);
  SGD lr 0.01, momentum 0.9, weight decay 1e-4, cosine schedule; batch 128.

``distill_precision: bf16`` (ours, off by default) autocasts the ODS passes through the teachers as
well as the student's forward; the teachers' logits are cast back to fp32 and the images stay fp32,
so the ODS step and the KD loss are computed in fp32 (only the signs of near-zero gradient entries
may differ).

Stated deviations: ODS step ``ods_eta`` = 4/255 in [0, 1] pixel space (the reference uses 8/255 in
mean=std=0.5 normalised space, the same step); the pool lives in memory as uint8 tensors; the
ensemble re-weighting pass takes the pool's batches as generated (the code's loader shuffles them
for it too: the same samples and steps, in another order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.fl.datafree import Batch, DataFreeConfig, DataFreeDistiller, Recipe, kl_div
from hetfl.fl.method import ServerContext, derive_seed, register
from hetfl.fl.precision import autocast
from hetfl.methods.common import DataFreeMethod


class CoBoostingRecipe(Recipe):
    keep = "best"
    reset_generator = True
    optimize_z = True

    def __init__(self, m: int, device: torch.device, params: dict[str, Any], seed: int) -> None:
        self.w = torch.full((m,), 1.0 / m, device=device)
        self.w0 = self.w.clone()
        self.p, self.seed = params, seed
        self.kd_calls = 0

    def aggregate(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w = self.w.to(logits.dtype)
        return torch.tensordot(w, logits, dims=1) / w.sum()

    def generator_loss(self, P: torch.Tensor, s: torch.Tensor, y: torch.Tensor, bn: torch.Tensor,
                       cfg: DataFreeConfig) -> torch.Tensor:
        p_y = F.softmax(P, dim=1).gather(1, y[:, None]).squeeze(1)
        hard = (1.0 - p_y).detach() ** self.p["hs"]
        ce = (hard * F.cross_entropy(P, y, reduction="none")).mean()
        adv = -kl_div(P, s, self.p["adv_temperature"])
        return ce + cfg.lambda_bn * bn.mean() + cfg.lambda_adv * adv

    def kd_batch(self, engine: DataFreeDistiller, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Output-diversified sampling: one signed-gradient step on a random projection of the
        teacher's softened output, then the teacher's logits on the perturbed images."""
        x8, y, _ = batch
        x = x8.float().div(255.0).requires_grad_(True)
        g = torch.Generator().manual_seed(derive_seed(self.seed, "ods", self.kd_calls))
        self.kd_calls += 1
        r = (torch.rand(x.shape[0], engine.ctx.num_classes, generator=g) * 2 - 1).to(x.device)
        P = self.aggregate(self._teacher_logits(engine, x), y)
        (grad,) = torch.autograd.grad((r * F.softmax(P / 4.0, dim=1)).sum(), x)
        with torch.no_grad():
            x_ods = (x + self.p["ods_eta"] * grad.sign()).clamp_(0, 1)
            P_ods = self.aggregate(self._teacher_logits(engine, x_ods), y)
        return x_ods, P_ods

    @staticmethod
    def _teacher_logits(engine: DataFreeDistiller, x: torch.Tensor) -> torch.Tensor:
        """The teachers' logits under ``distill_precision`` (the ODS passes, most of a KD step's time),
        cast back to fp32, so the aggregate, the ODS step and the loss stay fp32."""
        with autocast(engine.ctx.device, engine.cfg.distill_precision):
            return engine.teacher_logits(x)

    def on_epoch_end(self, engine: DataFreeDistiller, epoch: int) -> None:
        if epoch <= 1:
            return
        step = self.p["mu"] * self.p["wdc"] ** epoch
        for _, y, logits in engine.pool:
            w = self.w.clone().requires_grad_(True)
            loss = F.cross_entropy(torch.tensordot(w, logits, dims=1) / w.sum(), y)
            (grad,) = torch.autograd.grad(loss, w)
            with torch.no_grad():
                w = w - step * grad.sign()
                self.w = (self.w0 + (w - self.w0).clamp(-1, 1)).clamp(0, 1)
        engine.ctx.log(epoch, ensemble_weights=self.w.tolist())

    def state(self) -> dict[str, torch.Tensor]:
        return {"w": self.w, "kd_calls": torch.tensor(self.kd_calls)}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        if "w" in state:
            self.w = state["w"].clone()
            self.kd_calls = int(state["kd_calls"])


@register("coboosting")
class CoBoosting(DataFreeMethod):
    name = "coboosting"
    method_defaults: dict[str, Any] = {
        "batch_size": 128, "lr": 0.01, "weight_decay": 1e-4, "cosine": True, "temperature": 4.0,
        "grad_clip": 10.0, "generator_grad_clip": 10.0, "pool_shuffle": True,
        "lambda_bn": 0.0, "pool_size": -1, "replay": -1,
        "adv_temperature": 3.0, "hs": 1.0, "mu": 0.01, "wdc": 0.99, "ods_eta": 4.0 / 255.0,
    }

    def recipe(self, teachers: list[nn.Module], ctx: ServerContext) -> Recipe:
        return CoBoostingRecipe(len(teachers), ctx.device, self.params, ctx.seed)

    def after(self, engine: DataFreeDistiller, ctx: ServerContext) -> None:
        ctx.record["ensemble_weights"] = engine.recipe.w.tolist()
