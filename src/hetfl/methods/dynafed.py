"""DynaFed (Pi et al., CVPR 2023): FedAvg whose server distils the global trajectory into a small set.

The paper (Fig. 1 and its method section): rounds 1..L (``trajectory_rounds`` L, 25) are FedAvg's, and
the server keeps the global model before round 1 and after each of them (theta_0..theta_L). After round L
it synthesises a small set by trajectory matching (MTT, Cazenavette et al.): ``syn_iterations`` (3,000)
times, a start theta_t is drawn, trained ``syn_steps`` (20) differentiable SGD steps on the synthetic set
with a learned step size, and the images, soft labels and step size move to minimise
||theta - theta*||^2 / ||theta_t - theta*||^2. Every later round (L + 1 on) fine-tunes the aggregate on the
set. Bytes are FedAvg's (HFLDD's Eq. 3).

What the paper leaves open follows the authors' code (pipilurj/DynaFed: run_end2end.py, its run scripts
experiments/*/*_serverdistill.sh, image_synthesizer.py ``Synthesizer.synthesize``, server.py
``datadistill``, utils.py ``DiffAugment`` / ``kd_loss``):

* Trajectory: the global parameters after each round's aggregation; t is uniform over 0..L - M
  (``--min_start_epoch 0``, ``--max_start_epoch 50``); the run scripts' ``minimum_trajectory_length`` 25
  counts theta_0, so their synthesis comes after 24 rounds and fine-tuning from round 25.
* Target theta* (``weight_averaging``, on: ``--weight_averaging --least_ave_num 2``, ``--max_ave_num`` 10):
  the plain mean of k checkpoints drawn with replacement from theta_{t+1}..theta_{t+M} (``expert_epochs`` M,
  3), k uniform in least..min(most, M) (clamped to M when M < least); off: theta_{t+M}.
* Set: ``ipc`` (15) noise images per class (``--pix_init noise``; the authors' inputs are normalised, ours
  are pixels in [0, 1], so uniform noise there, and neither clips them), soft labels ``label_init`` (0:
  ``--label_init 0.``) times one-hot as logits, i.e. uniform at first; the step size starts at ``syn_lr``
  (``--lr_teacher 0.04``, the last of the two the scripts pass) and is learned as is, not in log space.
* Optimisers: Adam on the images (``--img_optim adam``, ``lr_img`` 5e-2), labels (``lr_label`` 1e-2) and
  step size (``--lr_optim adam``, ``lr_lr`` 1e-5); every inner step uses the whole set (``batch_syn`` = C ipc).
* Loss on soft labels: ``kd_loss``, the mean over batch and classes of -softmax(y) log softmax(f(x)),
  i.e. cross-entropy / C, in the inner steps and in fine-tuning.
* DSA (``dsa``, on: ``--dsa True``, ``--dsa_strategy color_crop_cutout_flip_scale_rotate``, mode 'S'): each
  inner step and each fine-tuning batch sees a fresh augmentation (:func:`augment`); the BatchNorm
  passes do not.
* Aggregation (``weighting``): the uniform mean of the sampled clients (``Server.fedavg`` /
  ``reduce_average``), ``samples`` for FedAvg's n_k weights. Clients train every round, also after
  the synthesis (``run_end2end.py`` trains every sampled client each round).
* Fine-tuning (``server.py: datadistill``): ``bn_passes`` (3) no-grad forward passes over the set in
  training mode (BatchNorm's running statistics; nothing for a model without BatchNorm, such as HFLDD's
  LeNet-5), then ``distill_iter`` (20) epochs of a fresh Adam (``distill_lr`` 1e-4) at batch
  ``distill_batch`` (256), shuffled.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from hetfl.fl.method import ServerContext, derive_seed, register
from hetfl.fl.payload import Payload
from hetfl.methods.fedavg import ROUND_DEFAULTS, ROUND_RANGES, FedAvgRounds

TRAJECTORY = "trajectory."
# The authors' (MTT's, DC's) ParamDiffAug and strategy 'color_crop_cutout_flip_scale_rotate' in mode 'S'.
DSA_FAMILIES = ("color", "crop", "cutout", "flip", "scale", "rotate")
DSA_SCALE, DSA_ROTATE, DSA_CROP, DSA_CUTOUT, DSA_FLIP = 1.2, 15.0, 0.125, 0.5, 0.5
DSA_BRIGHTNESS, DSA_SATURATION, DSA_CONTRAST = 1.0, 2.0, 0.5


def augment(x: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    """Differentiable Siamese augmentation (Zhao & Bilen, 2021) of a batch (N, C, H, W): one family of
    :data:`DSA_FAMILIES` drawn for the call, its parameters drawn per image, all from ``rng`` (CPU), so the
    same generator state gives the same transform. Affine in ``x``, hence differentiable in it."""
    n, _, h, w = x.shape

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=rng).to(device=x.device, dtype=x.dtype)

    def randint(low: int, high: int) -> torch.Tensor:  # per image, high exclusive
        return torch.randint(low, high, (n,), generator=rng).to(x.device)

    family = DSA_FAMILIES[int(torch.randint(0, len(DSA_FAMILIES), (1,), generator=rng))]
    if family == "color":  # brightness, saturation, contrast
        x = x + (rand(n, 1, 1, 1) - 0.5) * DSA_BRIGHTNESS
        mean = x.mean(dim=1, keepdim=True)
        x = (x - mean) * (rand(n, 1, 1, 1) * DSA_SATURATION) + mean
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        return (x - mean) * (rand(n, 1, 1, 1) + DSA_CONTRAST) + mean
    if family == "flip":  # horizontal, with probability 1/2
        return torch.where(rand(n, 1, 1, 1) < DSA_FLIP, x.flip(3), x)
    if family == "crop":  # shift by up to 1/8 of the side, zero fill
        sh, sw = int(h * DSA_CROP + 0.5), int(w * DSA_CROP + 0.5)
        rows = (torch.arange(h, device=x.device) + randint(-sh, sh + 1)[:, None] + 1).clamp(0, h + 1)
        cols = (torch.arange(w, device=x.device) + randint(-sw, sw + 1)[:, None] + 1).clamp(0, w + 1)
        padded = F.pad(x, (1, 1, 1, 1))
        padded = padded.gather(2, rows[:, None, :, None].expand(n, x.shape[1], h, w + 2))
        return padded.gather(3, cols[:, None, None, :].expand(n, x.shape[1], h, w))
    if family == "cutout":  # a zeroed square of half the side, centred anywhere in the image
        ch, cw = int(h * DSA_CUTOUT + 0.5), int(w * DSA_CUTOUT + 0.5)
        top = randint(0, h + 1 - ch % 2)[:, None] - ch // 2
        left = randint(0, w + 1 - cw % 2)[:, None] - cw // 2
        r, c = torch.arange(h, device=x.device), torch.arange(w, device=x.device)
        inside_r, inside_c = (r >= top) & (r < top + ch), (c >= left) & (c < left + cw)
        return x * (~(inside_r[:, :, None] & inside_c[:, None, :]))[:, None].to(x.dtype)
    theta = torch.zeros(n, 2, 3, dtype=x.dtype, device=x.device)
    if family == "scale":  # each axis by a factor in [1/1.2, 1.2]
        theta[:, 0, 0] = rand(n) * (DSA_SCALE - 1 / DSA_SCALE) + 1 / DSA_SCALE
        theta[:, 1, 1] = rand(n) * (DSA_SCALE - 1 / DSA_SCALE) + 1 / DSA_SCALE
    else:  # rotate by up to 15 degrees either way
        angle = (rand(n) - 0.5) * 2 * DSA_ROTATE / 180 * math.pi
        theta[:, 0, 0], theta[:, 0, 1] = angle.cos(), -angle.sin()
        theta[:, 1, 0], theta[:, 1, 1] = angle.sin(), angle.cos()
    grid = F.affine_grid(theta, list(x.shape), align_corners=True)
    return F.grid_sample(x, grid, align_corners=True)


def soft_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The authors' ``kd_loss``: -softmax(labels) * log_softmax(logits), averaged over batch and classes."""
    return -(F.softmax(labels, dim=1) * F.log_softmax(logits, dim=1)).mean()


def matching_target(trajectory: list[dict[str, torch.Tensor]], start: int, expert_epochs: int,
                    averaging: tuple[int, int] | None, rng: torch.Generator) -> dict[str, torch.Tensor]:
    """theta*: theta_{start + M} without ``averaging``; with ``(least, most)``, the mean of k checkpoints
    drawn with replacement from theta_{start+1}..theta_{start+M}, k uniform in least..min(most, M)."""
    if averaging is None:
        return trajectory[start + expert_epochs]
    high = min(averaging[1], expert_epochs)
    k = int(torch.randint(min(averaging[0], high), high + 1, (1,), generator=rng))
    picks = torch.randint(start + 1, start + expert_epochs + 1, (k,), generator=rng).tolist()
    return {n: torch.stack([trajectory[i][n] for i in picks]).mean(0) for n in trajectory[start]}


def match_trajectory(model: nn.Module, trajectory: list[dict[str, torch.Tensor]], images: torch.Tensor,
                     labels: torch.Tensor, lr: torch.Tensor, iterations: int, syn_steps: int, expert_epochs: int,
                     rng: torch.Generator, *, lr_img: float = 5e-2, lr_label: float = 1e-2, lr_lr: float = 1e-5,
                     dsa: bool = True, averaging: tuple[int, int] | None = (2, 10)) -> float:
    """MTT on ``images`` / ``labels`` (soft-label logits) / ``lr`` (the step size), in place, with Adam on
    each; returns the last matching loss (before its update)."""
    names = [n for n, p in model.named_parameters()]
    buffers = dict(model.named_buffers())
    optimisers = [torch.optim.Adam([images], lr=lr_img), torch.optim.Adam([labels], lr=lr_label),
                  torch.optim.Adam([lr], lr=lr_lr)]
    loss = torch.zeros(())
    for _ in range(iterations):
        start = int(torch.randint(0, len(trajectory) - expert_epochs, (1,), generator=rng))
        begin = trajectory[start]
        target = matching_target(trajectory, start, expert_epochs, averaging, rng)
        params = {n: begin[n].detach().clone().requires_grad_(True) for n in names}
        for _step in range(syn_steps):
            x = augment(images, rng) if dsa else images
            out = functional_call(model, ({**params, **buffers}), (x,))
            grads = torch.autograd.grad(soft_cross_entropy(out, labels), list(params.values()), create_graph=True)
            params = {n: p - lr * g for (n, p), g in zip(params.items(), grads)}
        num = sum(((params[n] - target[n]) ** 2).sum() for n in names)
        den = sum(((begin[n] - target[n]) ** 2).sum() for n in names).clamp(min=1e-12)
        loss = num / den
        for opt in optimisers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in optimisers:
            opt.step()
    return float(loss.detach())


@register("dynafed")
class DynaFed(FedAvgRounds):
    name = "dynafed"
    defaults = {**ROUND_DEFAULTS, "trajectory_rounds": 25, "ipc": 15, "syn_iterations": 3000, "syn_steps": 20,
                "expert_epochs": 3, "weight_averaging": True, "least_ave_num": 2, "max_ave_num": 10,
                "dsa": True, "lr_img": 5e-2, "lr_label": 1e-2, "lr_lr": 1e-5, "syn_lr": 0.04, "label_init": 0.0,
                "weighting": "uniform", "distill_iter": 20, "distill_lr": 1e-4, "distill_batch": 256,
                "bn_passes": 3}
    ranges = {**ROUND_RANGES, "trajectory_rounds": {"ge": 1}, "ipc": {"ge": 1}, "syn_iterations": {"ge": 0},
              "syn_steps": {"ge": 1}, "expert_epochs": {"ge": 1}, "least_ave_num": {"ge": 1},
              "max_ave_num": {"ge": 1}, "lr_img": {"gt": 0}, "lr_label": {"gt": 0}, "lr_lr": {"gt": 0},
              "syn_lr": {"gt": 0}, "weighting": {"choices": ("uniform", "samples")}, "distill_iter": {"ge": 0},
              "distill_lr": {"gt": 0}, "distill_batch": {"ge": 1}, "bn_passes": {"ge": 0}}

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
        self.labels = (torch.eye(c).repeat_interleave(n, dim=0) * float(self.params["label_init"])).to(ctx.device)
        self.lr = torch.tensor(float(self.params["syn_lr"])).to(ctx.device)
        self.synthesised = False

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.global_model.named_parameters()}

    def weights(self, uploads: dict[int, Payload], ctx: ServerContext) -> list[float]:
        """The authors' uniform mean over the sampled clients, or FedAvg's sample counts."""
        return [1.0] * len(uploads) if self.params["weighting"] == "uniform" else super().weights(uploads, ctx)

    def aggregate(self, round_: int, uploads: dict[int, Payload], ctx: ServerContext) -> None:
        super().aggregate(round_, uploads, ctx)
        if self.synthesised:
            self._fine_tune(round_, ctx)
        elif round_ <= int(self.params["trajectory_rounds"]):
            self.trajectory.append(self._snapshot())
            if round_ == int(self.params["trajectory_rounds"]):
                self._synthesise(ctx)

    def _synthesise(self, ctx: ServerContext) -> None:
        p = self.params
        rng = torch.Generator().manual_seed(derive_seed(ctx.seed, "dynafed-mtt"))
        images = self.images.clone().requires_grad_(True)
        labels = self.labels.clone().requires_grad_(True)
        lr = self.lr.clone().requires_grad_(True)
        model = ctx.build(ctx.server_arch, purpose="mtt").train()
        averaging = (int(p["least_ave_num"]), int(p["max_ave_num"])) if p["weight_averaging"] else None
        loss = match_trajectory(model, self.trajectory, images, labels, lr, int(p["syn_iterations"]),
                                int(p["syn_steps"]), int(p["expert_epochs"]), rng, lr_img=float(p["lr_img"]),
                                lr_label=float(p["lr_label"]), lr_lr=float(p["lr_lr"]), dsa=bool(p["dsa"]),
                                averaging=averaging)
        self.images, self.labels, self.lr = images.detach(), labels.detach(), lr.detach()
        self.synthesised = True
        self.trajectory = []  # no longer needed
        ctx.record["matching_loss"] = loss
        ctx.record["synthetic_lr"] = float(self.lr)

    def _fine_tune(self, round_: int, ctx: ServerContext) -> None:
        p = self.params
        batch = int(p["distill_batch"])
        rng = torch.Generator().manual_seed(derive_seed(ctx.seed, "dynafed-tune", round_))
        opt = torch.optim.Adam(self.global_model.parameters(), lr=float(p["distill_lr"]))
        self.global_model.train()
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.global_model.modules()):
            with torch.no_grad():  # BatchNorm's running statistics on the synthetic set
                for _ in range(int(p["bn_passes"])):
                    for s in range(0, len(self.images), batch):
                        self.global_model(self.images[s: s + batch])
        for _ in range(int(p["distill_iter"])):
            order = torch.randperm(len(self.images), generator=rng).to(self.images.device)
            for s in range(0, len(order), batch):
                idx = order[s: s + batch]
                x = augment(self.images[idx], rng) if p["dsa"] else self.images[idx]
                loss = soft_cross_entropy(self.global_model(x), self.labels[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = super().state_dict()
        for i, snap in enumerate(self.trajectory):
            out.update({f"{TRAJECTORY}{i}.{k}": v for k, v in snap.items()})
        out.update({"synthetic.images": self.images, "synthetic.labels": self.labels,
                    "synthetic.step_size": self.lr, "synthetic.done": torch.tensor(self.synthesised)})
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
        self.lr, self.synthesised = state["synthetic.step_size"].clone(), bool(state["synthetic.done"])
