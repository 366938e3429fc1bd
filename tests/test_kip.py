"""KIP dataset distillation and its closed-form NTK (HFLDD's Stage 2)."""

from __future__ import annotations

import torch

from hetfl.data.synthetic import load_synthetic
from hetfl.fl.kip import KERNELS, centred_onehot, distill, kip_loss, ntk_relu


def empirical_ntk(a: torch.Tensor, b: torch.Tensor, width: int, seed: int = 0) -> torch.Tensor:
    """grad_theta f(a) . grad_theta f(b) of one random width-``width`` network of ntk_relu's form."""
    g = torch.Generator().manual_seed(seed)
    d = a.shape[1]
    w = torch.randn(width, d, generator=g, dtype=torch.float64)
    v = torch.randn(width, generator=g, dtype=torch.float64)

    def grads(x: torch.Tensor) -> torch.Tensor:
        pre = x @ w.T / d ** 0.5  # (n, m)
        dv = torch.relu(pre) / width ** 0.5  # df/dv
        dw = (v * (pre > 0)).unsqueeze(2) * x.unsqueeze(1) / (d * width) ** 0.5  # df/dW: (n, m, d)
        return torch.cat([dv, dw.flatten(1)], dim=1)

    return grads(a) @ grads(b).T


def test_the_closed_form_ntk_is_within_5_percent_of_a_wide_networks():
    torch.manual_seed(0)
    a, b = torch.rand(6, 20, dtype=torch.float64), torch.rand(5, 20, dtype=torch.float64)
    closed, empirical = ntk_relu(a, b), empirical_ntk(a, b, 4096)
    assert torch.allclose(closed, empirical, rtol=0.05)


def _client():
    data = load_synthetic(classes=3, channels=1, size=8, train_per_class=30, test_per_class=30, seed=1)
    x, y = data.train.batch(torch.arange(len(data.train)))
    xt, yt = data.test.batch(torch.arange(len(data.test)))
    return x, y, xt, yt


def test_kip_steps_lower_the_loss_on_held_out_data_and_a_model_on_the_set_beats_chance():
    x, y, xt, yt = _client()
    start, start_labels = distill(x, y, 3, 12, steps=0, lr=0.004, lam=1e-6, seed=0)
    distilled, labels = distill(x, y, 3, 12, steps=50, lr=0.01, lam=1e-6, seed=0)
    assert torch.equal(start_labels, labels)  # the same class-balanced start, the labels fixed
    y_s = centred_onehot(labels, 3)
    before = kip_loss(start.double(), y_s, xt.double(), centred_onehot(yt, 3), KERNELS["ntk"], 1e-6)
    after = kip_loss(distilled.double(), y_s, xt.double(), centred_onehot(yt, 3), KERNELS["ntk"], 1e-6)
    assert float(after) < float(before)
    assert torch.bincount(labels, minlength=3).tolist() == [4, 4, 4]  # class-balanced support
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _step in range(200):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(distilled), labels).backward()
        opt.step()
    accuracy = float((model(xt).argmax(1) == yt).float().mean())
    assert accuracy > 0.5  # chance is 1/3
