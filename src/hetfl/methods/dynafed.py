"""DynaFed (Pi et al., CVPR 2023): FedAvg whose server distils the global trajectory into a small set.

Rounds 1..L (``trajectory_rounds`` L, 25) are FedAvg's; the server records the global model after
each (and the initial one). After round L it synthesises ``ipc`` (15) images per class by trajectory
matching (MTT, Cazenavette et al.): ``syn_iterations`` (3,000) times, a start model theta_t is drawn from
the recorded ones, trained ``syn_steps`` (20) differentiable SGD steps on the synthetic set (learned soft
labels, learned step size), and the images, labels and step size move to bring it to theta_{t + M}
(``expert_epochs`` M, 3): loss ||theta - theta_{t+M}||^2 / ||theta_t - theta_{t+M}||^2 (SGD on the images,
``lr_img`` 5e-2; Adam on the labels and step size). Every later round fine-tunes the aggregate on the set:
``distill_iter`` (20) Adam passes (lr 1e-4) at batch 256 of soft-label cross-entropy, after ``bn_passes`` (3)
forward passes over the set in training mode that refresh BatchNorm's running statistics (none for a model
without BatchNorm, such as HFLDD's LeNet-5). Bytes are FedAvg's (Eq. 3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from hetfl.fl.method import ServerContext, derive_seed, register
from hetfl.fl.payload import Payload
from hetfl.methods.fedavg import ROUND_DEFAULTS, ROUND_RANGES, FedAvgRounds

TRAJECTORY = "trajectory."


def match_trajectory(model: nn.Module, trajectory: list[dict[str, torch.Tensor]], images: torch.Tensor,
                     labels: torch.Tensor, lr: torch.Tensor, iterations: int, syn_steps: int, expert_epochs: int,
                     lr_img: float, rng: torch.Generator) -> float:
    """MTT on ``images`` / ``labels`` (logits of soft labels) / ``lr`` (a log step size), in place; returns
    the last matching loss."""
    names = [n for n, p in model.named_parameters()]
    buffers = dict(model.named_buffers())
    opt_img = torch.optim.SGD([images], lr=lr_img, momentum=0.5)
    opt_rest = torch.optim.Adam([labels, lr], lr=1e-3)
    loss = torch.zeros(())
    for _ in range(iterations):
        start = int(torch.randint(0, len(trajectory) - expert_epochs, (1,), generator=rng))
        begin, target = trajectory[start], trajectory[start + expert_epochs]
        params = {n: begin[n].detach().clone().requires_grad_(True) for n in names}
        soft = F.softmax(labels, dim=1)
        for _step in range(syn_steps):
            out = functional_call(model, ({**params, **buffers}), (images,))
            ce = -(soft * F.log_softmax(out, dim=1)).sum(1).mean()
            grads = torch.autograd.grad(ce, list(params.values()), create_graph=True)
            params = {n: p - lr.exp() * g for (n, p), g in zip(params.items(), grads)}
        num = sum(((params[n] - target[n]) ** 2).sum() for n in names)
        den = sum(((begin[n] - target[n]) ** 2).sum() for n in names).clamp(min=1e-12)
        loss = num / den
        opt_img.zero_grad(set_to_none=True)
        opt_rest.zero_grad(set_to_none=True)
        loss.backward()
        opt_img.step()
        opt_rest.step()
        with torch.no_grad():
            images.clamp_(0, 1)
    return float(loss.detach())


@register("dynafed")
class DynaFed(FedAvgRounds):
    name = "dynafed"
    defaults = {**ROUND_DEFAULTS, "trajectory_rounds": 25, "ipc": 15, "syn_iterations": 3000, "syn_steps": 20,
                "expert_epochs": 3, "lr_img": 5e-2, "syn_lr": 0.01, "distill_iter": 20, "distill_lr": 1e-4,
                "distill_batch": 256, "bn_passes": 3}
    ranges = {**ROUND_RANGES, "trajectory_rounds": {"ge": 2}, "ipc": {"ge": 1}, "syn_iterations": {"ge": 0},
              "syn_steps": {"ge": 1}, "expert_epochs": {"ge": 1}, "lr_img": {"gt": 0}, "syn_lr": {"gt": 0},
              "distill_iter": {"ge": 0}, "distill_lr": {"gt": 0}, "distill_batch": {"ge": 1},
              "bn_passes": {"ge": 0}}

    def check(self, ctx: ServerContext) -> None:
        super().check(ctx)
        if self.params["expert_epochs"] > self.params["trajectory_rounds"]:
            raise ValueError(f"expert_epochs {self.params['expert_epochs']} is more than the "
                             f"{self.params['trajectory_rounds']} recorded rounds")

    def setup(self, ctx: ServerContext) -> None:
        super().setup(ctx)
        self.trajectory = [self._snapshot()]
        c, n = ctx.num_classes, int(self.params["ipc"])
        g = torch.Generator().manual_seed(derive_seed(ctx.seed, "dynafed-init"))
        self.images = torch.rand((c * n, *ctx.shape), generator=g).to(ctx.device)
        self.labels = (torch.eye(c).repeat_interleave(n, dim=0) * 5.0).to(ctx.device)  # soft-label logits
        self.lr = torch.tensor(float(self.params["syn_lr"])).log().to(ctx.device)
        self.synthesised = False

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.global_model.named_parameters()}

    def aggregate(self, round_: int, uploads: dict[int, Payload], ctx: ServerContext) -> None:
        super().aggregate(round_, uploads, ctx)
        L = int(self.params["trajectory_rounds"])  # noqa: N806 (the paper's L)
        if round_ <= L:
            self.trajectory.append(self._snapshot())
        if round_ == L and not self.synthesised:
            self._synthesise(ctx)
        if self.synthesised:
            self._fine_tune(round_, ctx)

    def _synthesise(self, ctx: ServerContext) -> None:
        p = self.params
        rng = torch.Generator().manual_seed(derive_seed(ctx.seed, "dynafed-mtt"))
        images = self.images.clone().requires_grad_(True)
        labels = self.labels.clone().requires_grad_(True)
        lr = self.lr.clone().requires_grad_(True)
        model = ctx.build(ctx.server_arch, purpose="mtt").train()
        loss = match_trajectory(model, self.trajectory, images, labels, lr, int(p["syn_iterations"]),
                                int(p["syn_steps"]), int(p["expert_epochs"]), float(p["lr_img"]), rng)
        self.images, self.labels, self.lr = images.detach(), labels.detach(), lr.detach()
        self.synthesised = True
        self.trajectory = []  # no longer needed
        ctx.record["matching_loss"] = loss

    def _fine_tune(self, round_: int, ctx: ServerContext) -> None:
        p = self.params
        rng = torch.Generator().manual_seed(derive_seed(ctx.seed, "dynafed-tune", round_))
        opt = torch.optim.Adam(self.global_model.parameters(), lr=float(p["distill_lr"]))
        soft = F.softmax(self.labels, dim=1)
        self.global_model.train()
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.global_model.modules()):
            with torch.no_grad():  # BatchNorm's running statistics on the synthetic set
                for _ in range(int(p["bn_passes"])):
                    for s in range(0, len(self.images), int(p["distill_batch"])):
                        self.global_model(self.images[s: s + int(p["distill_batch"])])
        for _ in range(int(p["distill_iter"])):
            order = torch.randperm(len(self.images), generator=rng).to(self.images.device)
            for s in range(0, len(order), int(p["distill_batch"])):
                idx = order[s: s + int(p["distill_batch"])]
                out = self.global_model(self.images[idx])
                loss = -(soft[idx] * F.log_softmax(out, dim=1)).sum(1).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = super().state_dict()
        for i, snap in enumerate(self.trajectory):
            out.update({f"{TRAJECTORY}{i}.{k}": v for k, v in snap.items()})
        out.update({"synthetic.images": self.images, "synthetic.labels": self.labels, "synthetic.lr": self.lr,
                    "synthetic.done": torch.tensor(self.synthesised)})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        found: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            if key.startswith(TRAJECTORY):
                index, _, name = key[len(TRAJECTORY):].partition(".")
                found.setdefault(int(index), {})[name] = value.clone()
        self.trajectory = [found[i] for i in sorted(found)]
        self.images, self.labels = state["synthetic.images"].clone(), state["synthetic.labels"].clone()
        self.lr, self.synthesised = state["synthetic.lr"].clone(), bool(state["synthetic.done"])
