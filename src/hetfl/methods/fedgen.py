"""FedGen (Zhu et al., ICML 2021): data-free knowledge distillation through a server generator of
representations.

* **Server**: after FedAvg of the round's uploads, a :class:`~hetfl.models.generator.LatentGenerator`
  (noise ``noise_dim`` 32 + one-hot label -> ``hidden`` 256 -> the input of the clients' ``head``) is
  trained for ``gen_steps`` (50: the authors' 10 epochs x 5 teacher iterations) Adam steps (``gen_lr``
  3e-4, its state kept across rounds) of batch ``gen_batch_size`` on labels drawn from those the round's
  clients hold: loss = sum_k mean(w_{k,y} CE(head_k(G(eps, y)), y)), w_{k,y} = client k's share of
  label y's count among the round's clients, + ``eta`` x the diversity loss
  exp(-mean(d_noise d_G)) (pairwise L2 of the noise times pairwise L1 of the outputs).
* **Clients** (from round 2; the generator is untrained before): CE + ``beta_t`` KL(p_G || p) on their
  own labels + ``alpha_t`` CE(head(G(eps, y')), y') on labels drawn from the ones they hold
  (:class:`hetfl.fl.objectives.FedGenTerm`), alpha_t = ``alpha`` 0.98^(t-1), beta_t likewise
  (``alpha`` = ``beta`` = 10, the authors' MNIST values).
* Noise N(0, I) as in the paper; ``noise: uniform`` is the authors' code (uniform [0, 1), their issue #10).

Needs a client model with ``projection`` and ``head`` (``simplecnn``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.fl.method import ServerContext, derive_seed, register
from hetfl.fl.payload import Payload
from hetfl.methods.common import ServerGenerator, client_models, frozen, require_projection_head
from hetfl.methods.fedavg import ROUND_DEFAULTS, ROUND_RANGES, FedAvgRounds
from hetfl.models.generator import LatentGenerator


def fedgen_diversity(noise: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """FedGen's ``DiversityLoss('l1')``: exp(-mean over pairs of (mean squared noise gap) x (mean |output gap|))."""
    noise_dist = (noise[None] - noise[:, None]).pow(2).mean(dim=2)
    out_dist = (output[None] - output[:, None]).abs().mean(dim=2)
    return torch.exp(-(noise_dist * out_dist).mean())


@register("fedgen")
class FedGen(ServerGenerator, FedAvgRounds):
    name = "fedgen"
    defaults = {**ROUND_DEFAULTS, "alpha": 10.0, "beta": 10.0, "decay": 0.98, "noise": "normal", "noise_dim": 32,
                "hidden": 256, "gen_steps": 50, "gen_batch_size": 32, "gen_lr": 3e-4, "eta": 1.0}
    ranges = {**ROUND_RANGES, "alpha": {"ge": 0}, "beta": {"ge": 0}, "decay": {"gt": 0, "le": 1},
              "noise": {"choices": ("normal", "uniform")}, "noise_dim": {"ge": 1}, "hidden": {"ge": 1},
              "gen_steps": {"ge": 0}, "gen_batch_size": {"ge": 2}, "gen_lr": {"gt": 0}, "eta": {"ge": 0}}

    def check(self, ctx: ServerContext) -> None:
        super().check(ctx)
        require_projection_head(ctx, "fedgen")

    def setup(self, ctx: ServerContext) -> None:
        super().setup(ctx)
        torch.manual_seed(derive_seed(ctx.seed, "generator", self.name))
        latent = self.global_model.head.in_features
        p = self.params
        self.generator = LatentGenerator(int(p["noise_dim"]), ctx.num_classes, int(p["hidden"]), latent).to(ctx.device)
        self.gen_opt = torch.optim.Adam(self.generator.parameters(), lr=float(p["gen_lr"]))

    def client_message(self, client_id: int, round_: int, ctx: ServerContext) -> Payload:
        message = super().client_message(client_id, round_, ctx)
        if round_ > 1:
            message.tensors.update({f"generator/{k}": v.detach().cpu() for k, v in self.generator.state_dict().items()})
            message.meta["tensor_kinds"] = {"generator/": "generator"}
        return message

    def terms(self, client_id: int, round_: int, ctx: ServerContext) -> dict[str, dict[str, Any]]:
        if round_ == 1:
            return {}
        p, decay = self.params, float(self.params["decay"]) ** (round_ - 1)
        return {"fedgen": {"alpha": p["alpha"] * decay, "beta": p["beta"] * decay, "noise": p["noise"],
                           "noise_dim": p["noise_dim"], "num_classes": ctx.num_classes, "hidden": p["hidden"],
                           "latent_dim": self.global_model.head.in_features}}

    def aggregate(self, round_: int, uploads: dict[int, Payload], ctx: ServerContext) -> None:
        models = client_models(uploads, ctx)
        super().aggregate(round_, uploads, ctx)
        if int(self.params["gen_steps"]) > 0:
            counts = torch.tensor([uploads[c].meta["label_counts"] for c in uploads], dtype=torch.float64)
            ctx.record["generator_loss"] = self._train_generator(round_, [models[c] for c in uploads], counts, ctx)

    def _train_generator(self, round_: int, heads: list[nn.Module], counts: torch.Tensor, ctx: ServerContext) -> float:
        p = self.params
        rng = torch.Generator().manual_seed(derive_seed(ctx.seed, "generator", self.name, round_))
        totals = counts.sum(dim=0)
        held = torch.nonzero(totals > 0).flatten()
        share = (counts / totals.clamp(min=1)).float().to(ctx.device)  # (K, C): client k's share of label y
        frozen(heads, ctx.device)
        self.generator.train()
        loss = torch.zeros(())
        for _ in range(int(p["gen_steps"])):
            y = held[torch.randint(0, len(held), (int(p["gen_batch_size"]),), generator=rng)].to(ctx.device)
            shape = (len(y), int(p["noise_dim"]))
            eps = (torch.rand(shape, generator=rng) if p["noise"] == "uniform" else torch.randn(shape, generator=rng))
            eps = eps.to(ctx.device)
            out = self.generator(eps, y)
            teacher = sum((F.cross_entropy(h.head(out), y, reduction="none") * share[k, y]).mean()
                          for k, h in enumerate(heads))
            loss = teacher + float(p["eta"]) * fedgen_diversity(eps, out)
            self.gen_opt.zero_grad(set_to_none=True)
            loss.backward()
            self.gen_opt.step()
        return float(loss.detach())
