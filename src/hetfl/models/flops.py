"""Parameter and FLOP counting for the model zoo.

FLOPs are counted with :class:`torch.utils.flop_counter.FlopCounterMode`, which counts
matrix multiplications and convolutions (2 FLOPs per multiply-accumulate) and ignores
element-wise ops, pooling and normalisation.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def count_parameters(model: nn.Module) -> int:
    """Total number of parameters (trainable or not) of ``model``."""
    return sum(p.numel() for p in model.parameters())


def count_flops(model: nn.Module, in_channels: int, image_size: int) -> int:
    """Forward FLOPs for one sample of shape ``(in_channels, image_size, image_size)``.

    The model runs once in eval mode (so BatchNorm statistics are untouched) on a zero
    image on the model's device; its train/eval mode is restored afterwards.
    """
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else torch.get_default_dtype()
    x = torch.zeros(1, in_channels, image_size, image_size, device=device, dtype=dtype)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        model.train(was_training)
    return int(counter.get_total_flops())
