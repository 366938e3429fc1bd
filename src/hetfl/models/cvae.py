"""Conditional VAEs (Sohn et al., 2015) of FedMHO and FedCVAE: ``cvae_small`` and ``cvae_large``.

Both condition encoder and decoder on the one-hot label and have a latent size of 20 by default
(FedMHO's ``--latent_size 20``). The decoder returns logits; :meth:`CVAE.decode` applies the
sigmoid, so samples are images in [0, 1] like the real data. Client loss (FedMHO Eq. 3, and
FedCVAE's): ``(BCE_sum(x_hat, x) + KL(q(z|x,c) || N(0, I))) / B``; BCE is computed on the logits
(``binary_cross_entropy_with_logits``), which equals BCE on sigmoid outputs but cannot overflow.

* ``cvae_small`` (FedMHO's lightweight CVAE):
  - 1 channel (MNIST/Fashion ``CVAE_MNIST``): MLP encoder ``[x, onehot] -> 256 -ReLU-> (mu, logvar)``,
    MLP decoder ``[z, onehot] -> 256 -ReLU-> C*H*W``.
  - 3 channels (``CVAE_SVHN``), side divisible by 8: encoder Conv4x4/s2 3->8->16->32 (ReLU),
    FC -> 256 ReLU, ``(mu, logvar)`` from ``[h, onehot]``; decoder FC ``[z, onehot]`` -> 256 -> 32x(s/8)^2,
    ConvT4x4/s2 32->16->8->3.
* ``cvae_large`` (our design after the description "conv 64-128-256 encoder / decoder with bilinear
  upsampling"; the public code was not copied): encoder Conv4x4/s2 (c->64), Conv4x4/s2 (64->128),
  Conv3x3 (128->256), ReLU after each, FC ``[h, onehot] -> (mu, logvar)``; decoder FC
  ``[z, onehot] -> 256 x (s/4)^2``, then 2x (bilinear x2 upsampling, Conv3x3 256->128->64, ReLU),
  Conv3x3 64->c. Needs a side divisible by 4.

FLOPs per sample: :func:`hetfl.models.count_flops` works on these models (``forward(x)`` conditions
on class 0 when no label is given) and counts 2 FLOPs per multiply-accumulate; FedMHO's Table 2
counts multiply-accumulates (its CNN row, 467.23K, is exactly the MACs of CNN_MNIST). Its CVAE-small
row (408.06K) equals the MACs of ``CVAE_MNIST`` with latent size 2 (the ``parameters.py`` default),
not 20: see :func:`cvae_flops`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .flops import count_flops

DEFAULT_LATENT = 20


class CVAE(nn.Module):
    """Encoder ``q(z | x, c)`` and decoder ``p(x | z, c)``; subclasses build ``encoder``/``decoder``."""

    arch: ClassVar[str] = ""

    def __init__(self, in_channels: int, image_size: int, num_classes: int, latent_dim: int = DEFAULT_LATENT) -> None:
        super().__init__()
        if in_channels < 1 or image_size < 1 or num_classes < 1 or latent_dim < 1:
            raise ValueError(f"{self.arch}: in_channels, image_size, num_classes and latent_dim must be positive, "
                             f"got {in_channels}, {image_size}, {num_classes}, {latent_dim}")
        self.in_channels, self.image_size = in_channels, image_size
        self.num_classes, self.latent_dim = num_classes, latent_dim

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.in_channels, self.image_size, self.image_size

    def onehot(self, y: Tensor) -> Tensor:
        return F.one_hot(y.long(), self.num_classes).float()

    def encode(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """``(mu, logvar)`` of ``q(z | x, c)``."""
        out = self.encoder(x, self.onehot(y))
        return out[:, : self.latent_dim], out[:, self.latent_dim :]

    def decode_logits(self, z: Tensor, y: Tensor) -> Tensor:
        return self.decoder(z, self.onehot(y)).view(-1, *self.shape)

    def decode(self, z: Tensor, y: Tensor) -> Tensor:
        """Images in [0, 1] for latents ``z`` and labels ``y``."""
        return torch.sigmoid(self.decode_logits(z, y))

    def forward(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        """Reconstruction logits through the posterior mean (label 0 when ``y`` is None, for FLOP
        counting)."""
        if y is None:
            y = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        mu, _ = self.encode(x, y)
        return self.decode_logits(mu, y)

    def loss(self, x: Tensor, y: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Eq. 3 per batch: ``(reconstruction, KL)``, each summed over dimensions and averaged over
        the batch (reparameterised ``z``; ``generator`` seeds the noise)."""
        mu, logvar = self.encode(x, y)
        eps = torch.randn(mu.shape, generator=generator, device="cpu").to(mu.device) if generator is not None \
            else torch.randn_like(mu)
        z = mu + eps * torch.exp(0.5 * logvar)
        logits = self.decode_logits(z, y)
        b = x.shape[0]
        recon = F.binary_cross_entropy_with_logits(logits, x, reduction="sum") / b
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / b
        return recon, kl

    @torch.no_grad()
    def sample(self, labels: Tensor, generator: torch.Generator | None = None, z_range: float | None = None) -> Tensor:
        """One image per label, ``z ~ N(0, I)`` (truncated to ``[-z_range, z_range]`` when given)."""
        z = sample_latent(len(labels), self.latent_dim, generator, z_range)
        device = next(self.parameters()).device
        return self.decode(z.to(device), labels.to(device))


def sample_latent(n: int, dim: int, generator: torch.Generator | None = None,
                  z_range: float | None = None) -> Tensor:
    """``n`` standard normal latents; with ``z_range`` truncated to ``[-z_range, z_range]``
    (FedCVAE's ``truncnorm``) by inverse-CDF sampling."""
    if z_range is None:
        return torch.randn(n, dim, generator=generator)
    if z_range <= 0:
        raise ValueError(f"z_range must be positive, got {z_range}")
    normal = torch.distributions.Normal(0.0, 1.0)
    lo, hi = normal.cdf(torch.tensor(-float(z_range))), normal.cdf(torch.tensor(float(z_range)))
    u = lo + (hi - lo) * torch.rand(n, dim, generator=generator)
    return normal.icdf(u.clamp(1e-7, 1 - 1e-7)).clamp(-z_range, z_range)


class _Cat(nn.Module):
    """``net(cat([a, b], dim=1))`` with ``a`` flattened: the conditioning of MLP parts."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, a: Tensor, c: Tensor) -> Tensor:
        return self.net(torch.cat([a.flatten(1), c], dim=1))


class _ConvEncoder(nn.Module):
    """``head(cat([flatten(body(x)), onehot]))``."""

    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body, self.head = body, head

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        return self.head(torch.cat([self.body(x).flatten(1), c], dim=1))


class _ConvDecoder(nn.Module):
    """``body(view(fc(cat([z, onehot]))))``."""

    def __init__(self, fc: nn.Module, shape: tuple[int, int, int], body: nn.Module) -> None:
        super().__init__()
        self.fc, self.shape, self.body = fc, shape, body

    def forward(self, z: Tensor, c: Tensor) -> Tensor:
        return self.body(self.fc(torch.cat([z, c], dim=1)).view(-1, *self.shape))


class CVAESmall(CVAE):
    arch = "cvae_small"
    hidden = 256

    def __init__(self, in_channels: int, image_size: int, num_classes: int, latent_dim: int = DEFAULT_LATENT) -> None:
        super().__init__(in_channels, image_size, num_classes, latent_dim)
        pixels, h, c = in_channels * image_size**2, self.hidden, num_classes
        if in_channels == 1:
            self.encoder = _Cat(nn.Sequential(nn.Linear(pixels + c, h), nn.ReLU(inplace=True),
                                              nn.Linear(h, 2 * latent_dim)))
            self.decoder = _Cat(nn.Sequential(nn.Linear(latent_dim + c, h), nn.ReLU(inplace=True),
                                              nn.Linear(h, pixels)))
            return
        if image_size % 8:
            raise ValueError(f"cvae_small with {in_channels} channels needs an image side divisible by 8, "
                             f"got {image_size}")
        s = image_size // 8
        body = nn.Sequential(_down(in_channels, 8), _down(8, 16), _down(16, 32), nn.Flatten(),
                             nn.Linear(32 * s * s, h), nn.ReLU(inplace=True))
        self.encoder = _ConvEncoder(body, nn.Linear(h + c, 2 * latent_dim))
        fc = nn.Sequential(nn.Linear(latent_dim + c, h), nn.ReLU(inplace=True), nn.Linear(h, 32 * s * s),
                           nn.ReLU(inplace=True))
        up = nn.Sequential(_up(32, 16), _up(16, 8), nn.ConvTranspose2d(8, in_channels, 4, 2, 1))
        self.decoder = _ConvDecoder(fc, (32, s, s), up)


class CVAELarge(CVAE):
    arch = "cvae_large"

    def __init__(self, in_channels: int, image_size: int, num_classes: int, latent_dim: int = DEFAULT_LATENT) -> None:
        super().__init__(in_channels, image_size, num_classes, latent_dim)
        if image_size % 4:
            raise ValueError(f"cvae_large needs an image side divisible by 4, got {image_size}")
        s, c = image_size // 4, num_classes
        body = nn.Sequential(_down(in_channels, 64), _down(64, 128), nn.Conv2d(128, 256, 3, padding=1),
                             nn.ReLU(inplace=True))
        self.encoder = _ConvEncoder(body, nn.Linear(256 * s * s + c, 2 * latent_dim))
        fc = nn.Sequential(nn.Linear(latent_dim + c, 256 * s * s), nn.ReLU(inplace=True))
        up = nn.Sequential(
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False), nn.Conv2d(256, 128, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False), nn.Conv2d(128, 64, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(64, in_channels, 3, padding=1),
        )
        self.decoder = _ConvDecoder(fc, (256, s, s), up)


def _down(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 4, 2, 1), nn.ReLU(inplace=True))


def _up(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.ConvTranspose2d(cin, cout, 4, 2, 1), nn.ReLU(inplace=True))


CVAES: dict[str, Callable[..., CVAE]] = {cls.arch: cls for cls in (CVAESmall, CVAELarge)}
CVAE_NAMES: tuple[str, ...] = tuple(sorted(CVAES))


def build_cvae(name: str, in_channels: int, image_size: int, num_classes: int,
               latent_dim: int = DEFAULT_LATENT) -> CVAE:
    """A freshly initialised CVAE (weights from torch's global RNG); ValueError for unknown names."""
    if name not in CVAES:
        raise ValueError(f"unknown cvae {name!r}; choose one of: {', '.join(CVAE_NAMES)}")
    return CVAES[name](in_channels, image_size, num_classes, latent_dim)


def decoder_state(model: CVAE) -> dict[str, Tensor]:
    """The decoder's tensors only (what a generative client uploads)."""
    return {k: v.detach().clone().cpu() for k, v in model.decoder.state_dict().items()}


def cvae_flops(name: str, in_channels: int, image_size: int, num_classes: int,
               latent_dim: int = DEFAULT_LATENT) -> dict[str, int]:
    """FLOPs per sample (2 per multiply-accumulate) of the whole CVAE forward (what a client
    trains, without the backward) and of the decoder alone (one synthetic sample)."""
    model = build_cvae(name, in_channels, image_size, num_classes, latent_dim)
    total = count_flops(model, in_channels, image_size)
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.decode(torch.zeros(1, latent_dim), torch.zeros(1, dtype=torch.long))
    return {"forward": total, "decoder": int(counter.get_total_flops())}
