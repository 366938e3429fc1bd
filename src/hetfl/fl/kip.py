"""Kernel Inducing Points (KIP; Nguyen et al., ICLR 2021): dataset distillation by kernel ridge regression.

A support set (X_s, y_s) is optimised so that kernel ridge regression on it predicts the labels of the
real (target) data: loss = 1/2 ||y_t - K_ts (K_ss + lambda tr(K_ss)/n I)^-1 y_s||^2 (HFLDD Sec. IV-B),
with Adam on the support images, a few target samples per step, fixed centred one-hot labels and float64
arithmetic. The kernel is the closed-form neural tangent kernel of a one-hidden-layer ReLU network
(:func:`ntk_relu`, the arc-cosine formulas of Cho & Saul and Jacot et al., differentiable in torch) or an
RBF kernel (``kernel: rbf``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hetfl.fl.training import count_sample_passes

Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def ntk_relu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The infinite-width NTK of f(x) = v . relu(W x / sqrt(d)) / sqrt(m), W and v standard normal, no
    biases: Theta = Sigma_2 + Sigma_1 x dSigma, with Sigma_1 = x.x'/d, Sigma_2 = sqrt(q q')/(2 pi)
    (sin t + (pi - t) cos t) and dSigma = (pi - t)/(2 pi), t the angle between x and x'."""
    a, b = a.flatten(1), b.flatten(1)
    d = a.shape[1]
    qa, qb = (a * a).sum(1) / d, (b * b).sum(1) / d
    cross = a @ b.T / d
    norm = torch.sqrt(qa[:, None] * qb[None, :]).clamp(min=1e-30)
    cos = (cross / norm).clamp(-1 + 1e-12, 1 - 1e-12)
    theta = torch.arccos(cos)
    sigma2 = norm / (2 * math.pi) * (torch.sin(theta) + (math.pi - theta) * cos)
    dsigma = (math.pi - theta) / (2 * math.pi)
    return sigma2 + cross * dsigma


def rbf(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """exp(-||x - x'||^2 / d)."""
    a, b = a.flatten(1), b.flatten(1)
    return torch.exp(-torch.cdist(a, b).pow(2) / a.shape[1])


KERNELS: dict[str, Kernel] = {"ntk": ntk_relu, "rbf": rbf}


def centred_onehot(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(y, num_classes).double() - 1.0 / num_classes


def kip_loss(x_s: torch.Tensor, y_s: torch.Tensor, x_t: torch.Tensor, y_t: torch.Tensor, kernel: Kernel,
             lam: float) -> torch.Tensor:
    """1/2 ||y_t - K_ts (K_ss + lam tr(K_ss)/n I)^-1 y_s||^2 (labels as centred one-hot rows)."""
    k_ss, k_ts = kernel(x_s, x_s), kernel(x_t, x_s)
    n = len(x_s)
    reg = lam * torch.trace(k_ss) / n
    pred = k_ts @ torch.linalg.solve(k_ss + reg * torch.eye(n, dtype=k_ss.dtype, device=k_ss.device), y_s)
    return 0.5 * (y_t - pred).pow(2).sum()


def balanced_init(y: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of ``size`` samples, as equal a share of each present class as the counts allow (seeded)."""
    classes = torch.unique(y)
    pools = {int(c): torch.nonzero(y == c).flatten()[torch.randperm(int((y == c).sum()), generator=generator)]
             for c in classes}
    chosen: list[int] = []
    taken = dict.fromkeys(pools, 0)
    while len(chosen) < min(size, len(y)):
        for c, pool in pools.items():
            if taken[c] < len(pool) and len(chosen) < size:
                chosen.append(int(pool[taken[c]]))
                taken[c] += 1
    return torch.tensor(chosen, dtype=torch.long)


def distill(x: torch.Tensor, y: torch.Tensor, num_classes: int, size: int, steps: int, lr: float, lam: float,
            kernel: str = "ntk", target_batch: int = 10, seed: int = 0,
            on_step: Callable[[int, float], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KIP on one client's data ``x`` (float images in [0, 1]) and labels: ``size`` support images (from a
    class-balanced sample) optimised for ``steps`` Adam steps; returns them (float, clamped to [0, 1]) and
    their labels. Raises ValueError on a non-finite loss."""
    g = torch.Generator().manual_seed(seed)
    index = balanced_init(y, size, g)
    x_s = x[index].double().clone().requires_grad_(True)
    y_s = centred_onehot(y[index], num_classes)
    x64, y64 = x.double(), centred_onehot(y, num_classes)
    opt = torch.optim.Adam([x_s], lr=lr)
    fn = KERNELS[kernel]
    for step in range(steps):
        pick = torch.randint(0, len(x), (min(target_batch, len(x)),), generator=g)
        loss = kip_loss(x_s, y_s, x64[pick], y64[pick], fn, lam)
        if not torch.isfinite(loss):
            raise ValueError(f"KIP: the loss is not finite at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        count_sample_passes(len(x_s) + len(pick))
        if on_step is not None:
            on_step(step, float(loss))
    return x_s.detach().clamp(0, 1).float(), y[index].clone()
