"""DENSE's image generator (Zhang et al., NeurIPS 2022), used by DENSE, Co-Boosting and FedHydra.

``z (nz) -> Linear -> 128 x s x s -> BN -> Up x2 -> Conv3x3 128 -> BN -> LReLU(0.2) -> Up x2 ->
Conv3x3 64 -> BN -> LReLU(0.2) -> Conv3x3 nc -> Sigmoid`` with ``s = image_size // 4``; output
images in [0, 1] (no normalisation, as in DENSE). ``reset_parameters`` re-initialises it the way
DENSE does every epoch: conv/linear weights ~ N(0, 0.02), biases 0, BN gamma ~ N(1, 0.02), beta 0.

Speed: each ``Up x2 -> Conv3x3`` pair is computed at the low resolution (:func:`upsample_conv3x3`):
nearest upsampling repeats every pixel, so each of the four output parities sees a 2 x 2 window of
the input with summed 3 x 3 taps. Same function and parameters (the state_dict is unchanged), up to
float summation order; 36 H W -> 16 (H+1)(W+1) multiply-adds per channel pair, the two convolutions
that dominate the generator's cost (docs/BENCHMARKS.md). ``Generator(fused_upsample=False)`` runs the
layers one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Generator(nn.Module):
    def __init__(self, nz: int = 256, ngf: int = 64, image_size: int = 32, channels: int = 3,
                 fused_upsample: bool = True) -> None:
        super().__init__()
        self.fused_upsample = fused_upsample
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
        if _is_channels_last(self.conv_blocks[-2].weight):  # one layout end to end (see _is_channels_last)
            out = out.contiguous(memory_format=torch.channels_last)
        if not self.fused_upsample:
            return self.conv_blocks(out)
        layers = iter(self.conv_blocks)
        for layer in layers:
            if isinstance(layer, nn.Upsample):  # always followed by a 3x3 conv (see __init__)
                conv = next(layers)
                out = upsample_conv3x3(out, conv.weight, conv.bias)
            else:
                out = layer(out)
        return out


# Row (or column) taps of a 3x3 kernel that the even / odd output rows of a nearest x2 upsampling see
# at the low resolution: output 2p reads x[p-1], x[p], x[p] (taps w0, w1 + w2 on x[p-1], x[p]);
# output 2p+1 reads x[p], x[p], x[p+1] (taps w0 + w1, w2 on x[p], x[p+1]).
_PARITY_TAPS = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]],
                             [[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])


def upsample_conv3x3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``conv2d(interpolate(x, scale_factor=2, mode='nearest'), weight, bias, padding=1)`` for a 3 x 3
    ``weight``, computed at the input's resolution: one convolution with the four parities' 2 x 2
    kernels (summed taps) on ``x`` padded by 1, whose (H+1) x (W+1) output holds each parity at an
    offset of 0 (even) or 1 (odd) per axis; the parities are then interleaved. Exact in real
    arithmetic (zero padding of the upsampled image is zero padding of ``x``)."""
    if weight.shape[-2:] != (3, 3):
        raise ValueError(f"upsample_conv3x3 needs a 3x3 kernel, got {tuple(weight.shape[-2:])}")
    b, _, h, w = x.shape
    out_ch = weight.shape[0]
    taps = _PARITY_TAPS.to(device=weight.device, dtype=weight.dtype)
    kernel = torch.einsum("aij,ocjk,blk->abocil", taps, weight, taps).reshape(4 * out_ch, -1, 2, 2)
    if _is_channels_last(x):
        kernel = kernel.contiguous(memory_format=torch.channels_last)
    y = F.conv2d(x, kernel, None if bias is None else bias.repeat(4), padding=1).unflatten(1, (2, 2, out_ch))
    return _InterleaveParities.apply(y, h, w)


class _InterleaveParities(torch.autograd.Function):
    """``(b, 2, 2, o, h+1, w+1)`` parity maps -> ``(b, o, 2h, 2w)`` image: output pixel
    ``(2p + a, 2q + c)`` is ``y[:, a, c, :, p + a, q + c]``. The offset of that element in ``y``'s
    storage is linear in (b, o, p, a, q, c), so all four parities are one strided view of ``y`` and
    the interleave is one copy each way, in ``y``'s layout. Autograd's own backward of slices and
    stacks zero-fills a full copy of ``y`` per slice (a large share of a generator step: docs/BENCHMARKS.md);
    here only each parity's unused border row and column are zeroed."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, h: int, w: int) -> torch.Tensor:  # type: ignore[override]
        ctx.h, ctx.w = h, w
        ctx.y_meta = (y.shape, y.stride())
        b, o = y.shape[0], y.shape[3]
        fmt = torch.channels_last if y.stride(3) == 1 and o > 1 else torch.contiguous_format
        out = torch.empty((b, o, 2 * h, 2 * w), dtype=y.dtype, device=y.device, memory_format=fmt)
        out.view(b, o, h, 2, w, 2).copy_(_parity_view(y, h, w))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        h, w = ctx.h, ctx.w
        shape, stride = ctx.y_meta
        grad_y = torch.empty_strided(shape, stride, dtype=grad.dtype, device=grad.device)
        _parity_view(grad_y, h, w).copy_(grad.reshape(shape[0], shape[3], h, 2, w, 2))
        for a in (0, 1):  # row h of parity a = 0 and row 0 of a = 1 are never read,
            grad_y[:, a, :, :, h if a == 0 else 0, :].zero_()
        for c in (0, 1):  # nor column w of c = 0 and column 0 of c = 1
            grad_y[:, :, c, :, :, w if c == 0 else 0].zero_()
        return grad_y, None, None


def _parity_view(y: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``y[:, a, c, :, p + a, q + c]`` as a (b, o, h, 2, w, 2) view indexed [b, o, p, a, q, c]."""
    s0, s1, s2, s3, s4, s5 = y.stride()
    return y.as_strided((y.shape[0], y.shape[3], h, 2, w, 2), (s0, s3, s4, s1 + s4, s5, s2 + s5),
                        y.storage_offset())


def _is_channels_last(t: torch.Tensor) -> bool:
    """NHWC and not also NCHW (a tensor with one channel or 1 x 1 pixels is both). A generator moved
    to channels_last runs every layer in NHWC: a layout that changes inside the network makes the
    elementwise backward kernels mix layouts, which makes them many times slower."""
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


@torch.no_grad()
def _normal_in_logical_order(weight: torch.Tensor, mean: float, std: float = 0.02) -> None:
    weight.copy_(torch.empty(weight.shape, dtype=weight.dtype, device=weight.device).normal_(mean, std))


class FeatureGenerator(nn.Module):
    """KDIA's conditional feature generator (Sec. 5, the authors' ``Generator``): noise (``noise_dim``)
    concatenated with a learned label embedding (C x C), as a 1x1 map, then transposed 2x2 convolutions
    of stride 1 (each grows the map by one pixel) with BatchNorm and LeakyReLU(0.2), widths 512, 256,
    128, ..., and a Sigmoid: a ``feature_shape`` (C_f, H, H) map for a client model's ``classify``
    (16x5x5 for ``simplecnn``: four layers, as in the authors' code)."""

    def __init__(self, noise_dim: int, num_classes: int, feature_shape: tuple[int, int, int]) -> None:
        super().__init__()
        channels, height, width = feature_shape
        if height != width or height < 2:
            raise ValueError(f"the feature generator makes square maps of side >= 2, not {feature_shape}")
        self.noise_dim, self.num_classes, self.feature_shape = noise_dim, num_classes, tuple(feature_shape)
        self.embed = nn.Embedding(num_classes, num_classes)
        widths = [max(512 >> i, 64) for i in range(height - 2)]
        layers: list[nn.Module] = []
        cin = noise_dim + num_classes
        for w in widths:
            layers += [nn.ConvTranspose2d(cin, w, 2, 1), nn.BatchNorm2d(w), nn.LeakyReLU(0.2, inplace=True)]
            cin = w
        layers += [nn.ConvTranspose2d(cin, channels, 2, 1), nn.Sigmoid()]
        self.net = nn.Sequential(*layers)

    def forward(self, noise: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.cat([noise, self.embed(labels)], dim=1)[:, :, None, None]
        for layer in self.net:  # the transposed convolutions as GEMMs (conv_transpose2x2)
            h = conv_transpose2x2(h, layer.weight, layer.bias) if isinstance(layer, nn.ConvTranspose2d) else layer(h)
        return h.contiguous()


def conv_transpose2x2(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.conv_transpose2d(x, weight, bias)`` for a 2 x 2 kernel, stride 1, no padding: one GEMM of the
    (B H W, C_in) pixels by the (C_in, 4 C_out) taps, then each tap's (B, H, W, C_out) map added at its
    offset into the (H+1) x (W+1) output. The same function up to float summation order; the library's
    transposed convolution is several times slower on a 1 x 1 input and on the few-pixel maps of
    :class:`FeatureGenerator` (docs/BENCHMARKS.md). Returns an NCHW-shaped view of NHWC memory."""
    if weight.shape[-2:] != (2, 2):
        raise ValueError(f"conv_transpose2x2 needs a 2x2 kernel, got {tuple(weight.shape[-2:])}")
    b, c_in, h, w = x.shape
    c_out = weight.shape[1]
    taps = (x.permute(0, 2, 3, 1).reshape(b * h * w, c_in) @ weight.reshape(c_in, c_out * 4))
    taps = taps.view(b, h, w, c_out, 2, 2)
    out = (bias.expand(b, h + 1, w + 1, c_out).clone() if bias is not None
           else taps.new_zeros(b, h + 1, w + 1, c_out))
    for a in (0, 1):
        for c in (0, 1):
            out[:, a:a + h, c:c + w] += taps[..., a, c]
    return out.permute(0, 3, 1, 2)


class LatentGenerator(nn.Module):
    """FedGen's generator (Zhu et al., 2021, the authors' ``Generator``): noise (``noise_dim``) and a
    one-hot label -> Linear(hidden) -> BatchNorm -> ReLU -> Linear(latent_dim): a representation for a
    classifier's last layer (``head``; 256-d for ``simplecnn``)."""

    def __init__(self, noise_dim: int, num_classes: int, hidden: int, latent_dim: int) -> None:
        super().__init__()
        self.noise_dim, self.num_classes = noise_dim, num_classes
        self.fc = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden), nn.BatchNorm1d(hidden), nn.ReLU())
        self.representation = nn.Linear(hidden, latent_dim)

    def forward(self, noise: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        onehot = nn.functional.one_hot(labels, self.num_classes).to(noise.dtype)
        return self.representation(self.fc(torch.cat([noise, onehot], dim=1)))
