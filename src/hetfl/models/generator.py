"""DENSE's image generator (Zhang et al., NeurIPS 2022), used by DENSE, Co-Boosting and FedHydra.

``z (nz) -> Linear -> 128 x s x s -> BN -> Up x2 -> Conv3x3 128 -> BN -> LReLU(0.2) -> Up x2 ->
Conv3x3 64 -> BN -> LReLU(0.2) -> Conv3x3 nc -> Sigmoid`` with ``s = image_size // 4``; output
images in [0, 1] (no normalisation, as in DENSE). ``reset_parameters`` re-initialises it the way
DENSE does every epoch: conv/linear weights ~ N(0, 0.02), biases 0, BN gamma ~ N(1, 0.02), beta 0.
"""

from __future__ import annotations

import torch
from torch import nn


class Generator(nn.Module):
    def __init__(self, nz: int = 256, ngf: int = 64, image_size: int = 32, channels: int = 3) -> None:
        super().__init__()
        if image_size % 4:
            raise ValueError(f"generator image_size must be a multiple of 4, got {image_size}")
        self.nz, self.image_size, self.channels = nz, image_size, channels
        self.init_size = image_size // 4
        self.l1 = nn.Linear(nz, ngf * 2 * self.init_size**2)
        self.conv_blocks = nn.Sequential(
            nn.BatchNorm2d(ngf * 2),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(ngf * 2, ngf * 2, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(ngf * 2, ngf, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ngf, channels, 3, stride=1, padding=1),
            nn.Sigmoid(),
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """DENSE's initialisation, independent of the memory layout: ``normal_`` fills a tensor in
        memory order, so the draws go to a contiguous tensor first (a channels_last generator gets
        the same weights as a contiguous one for the same seed)."""
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                _normal_in_logical_order(m.weight, 0.0)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                _normal_in_logical_order(m.weight, 1.0)
                nn.init.zeros_(m.bias)
                m.reset_running_stats()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        out = self.l1(z)
        out = out.reshape(out.shape[0], -1, self.init_size, self.init_size)
        return self.conv_blocks(out)


@torch.no_grad()
def _normal_in_logical_order(weight: torch.Tensor, mean: float, std: float = 0.02) -> None:
    weight.copy_(torch.empty(weight.shape, dtype=weight.dtype, device=weight.device).normal_(mean, std))
