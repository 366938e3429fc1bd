"""Centralised training: one model on the union of all clients' data (the upper bound).

Not federated: the clients' raw training data is pooled at the server, and the bytes of that
raw data are counted as uploaded. Trains the server architecture with the clients' local
optimiser settings (override with ``client: {epochs: ...}``). The training resumes after an
interruption (ours): :meth:`Central._checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
from typing import ClassVar

from torch import nn

from hetfl.fl.checkpoint import TrainCheckpoint
from hetfl.fl.method import OneShotMethod, ServerContext, derive_seed, register
from hetfl.fl.payload import Payload
from hetfl.fl.training import local_train


@register("central")
class Central(OneShotMethod):
    name = "central"
    defaults: dict = {}
    needs_uploads = False  # trains on pooled raw data instead
    runs_remotely = False
    CHECKPOINT_EVERY_S: ClassVar[float] = 120.0  # the training saves its state this often (and on a stop)

    def server(self, uploads: dict[int, Payload], ctx: ServerContext) -> dict[str, nn.Module]:
        data = ctx.pooled_train_data()
        model = ctx.build(ctx.server_arch, purpose="central")
        cfg = self.local_config(ctx)
        seed = derive_seed(ctx.seed, "central")
        checkpoint = self._checkpoint(ctx, cfg.to_dict(), seed, data.digest())
        prior = checkpoint.saved_seconds()  # trained before a resume (0: a fresh start)
        ctx.add_prior_seconds(prior)
        first = True
        bar = ctx.progress(total=cfg.epochs, desc="central training", unit="epoch")

        def on_epoch(epoch: int, loss: float) -> None:
            nonlocal first
            if first:  # drop the rows an interrupted run logged after its checkpoint (all, on a fresh start)
                ctx.trim_log(epoch - 1)
                if prior:
                    ctx.record["resumed_from_epoch"] = epoch - 1
                first = False
            bar.update(epoch - bar.n)
            bar.set_postfix(loss=f"{loss:.3f}")
            ctx.log(epoch, train_loss=loss)

        local_train(model, data, cfg, ctx.device, seed=seed, progress=on_epoch, checkpoint=checkpoint)
        bar.close()
        for path in ctx.out_dir.glob("checkpoint-central-*.safetensors"):
            path.unlink()  # done (and any file of another configuration)
        return {self.name: model}

    def _checkpoint(self, ctx: ServerContext, cfg: dict, seed: int, data: str) -> TrainCheckpoint:
        """The training's checkpoint (:class:`TrainCheckpoint`: every ``CHECKPOINT_EVERY_S`` seconds
        and on SIGINT or SIGTERM after the step under way), named by what determines the training:
        the optimiser settings, the seed, the server model and the pooled data's digest. A run of the
        same configuration into the same folder goes on from it; ``--fresh`` starts over."""
        key = json.dumps({"config": cfg, "seed": seed, "server": ctx.server_arch, "data": data}, sort_keys=True)
        name = hashlib.sha256(key.encode()).hexdigest()[:16]
        checkpoint = TrainCheckpoint(ctx.out_dir / f"checkpoint-central-{name}.safetensors", self.CHECKPOINT_EVERY_S)
        if not ctx.resume:
            checkpoint.clear()
        return checkpoint
