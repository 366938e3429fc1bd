"""DENSE (Zhang et al., NeurIPS 2022): data-free one-shot FL by ensemble distillation.

Teacher ``P = 1/m sum_k F_k(x)`` (plain mean of client logits). Generator loss (per step)
``CE(P, y) + lambda_bn * L_BN + lambda_adv * L_adv`` with ``L_BN`` the DeepInversion loss summed over
every BatchNorm layer of every client and ``L_adv = -mean_i(mask_i * KL(softmax P_i || softmax s_i))``,
``mask_i = [argmax s_i != argmax P_i]`` (T = 1). The generator and z are re-initialised every epoch
and optimised with Adam (lr 1e-3, betas 0.5/0.999) for ``generator_steps``; the lowest-loss batch
is added to the pool; the student is distilled with ``T^2 KL(P/T || s/T)`` over the pool.

Defaults follow DENSE's README command (not its argparse defaults, which switch the losses off):
T_g = 200, T_G = 30, batch 256, KD SGD lr 0.005 with momentum 0.9, T = 20, lambda_bn = lambda_adv = 1.
Choices and deviations, stated:
* The pool is replayed in full each epoch (``pool_size: -1, replay: -1``: DENSE's O(T_g^2) KD
  steps); set ``replay: k`` to bound it. It is kept in memory as uint8 tensors, not PNGs.
* No augmentation in the generator step or the KD pass (DENSE flips MNIST digits horizontally,
  which we consider a bug for digits).
* The student is in eval mode while the generator trains (DENSE leaves it in train mode, so its
  BN statistics drift on synthetic batches).
* The student starts from random initialisation, as in DENSE.
* The KD pass draws its batches each epoch from the samples of the whole pool in a seeded random
  order (``pool_shuffle: true``), as DENSE's code does with a shuffled DataLoader over every pooled
  image; ``pool_shuffle: false`` takes this epoch's batch, then the pool oldest first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.fl.datafree import DataFreeConfig, Recipe, kl_div
from hetfl.fl.method import ServerContext, register
from hetfl.methods.common import DataFreeMethod


class DenseRecipe(Recipe):
    keep = "best"
    reset_generator = True
    optimize_z = True

    def generator_loss(self, P: torch.Tensor, s: torch.Tensor, y: torch.Tensor, bn: torch.Tensor,
                       cfg: DataFreeConfig) -> torch.Tensor:
        mask = (s.argmax(dim=1) != P.argmax(dim=1)).float()
        adv = -(kl_div(P, s, 1.0, reduction="none") * mask).mean()
        return F.cross_entropy(P, y) + cfg.lambda_bn * bn.sum() + cfg.lambda_adv * adv


@register("dense")
class Dense(DataFreeMethod):
    name = "dense"
    method_defaults: dict[str, Any] = {"lr": 0.005, "temperature": 20.0, "pool_size": -1, "replay": -1,
                                       "pool_shuffle": True}

    def recipe(self, teachers: list[nn.Module], ctx: ServerContext) -> Recipe:
        return DenseRecipe()
