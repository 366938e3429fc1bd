"""Centralised training: one model on the union of all clients' data (the upper bound).

Not federated: the clients' raw training data is pooled at the server, and the bytes of that
raw data are counted as uploaded. Trains the server architecture with the clients' local
optimiser settings (override with ``client: {epochs: ...}``).
"""

from __future__ import annotations

from torch import nn

from hetfl.fl.method import OneShotMethod, ServerContext, derive_seed, register
from hetfl.fl.payload import Payload
from hetfl.fl.training import local_train


@register("central")
class Central(OneShotMethod):
    name = "central"
    defaults: dict = {}
    needs_uploads = False  # trains on pooled raw data instead

    def server(self, uploads: dict[int, Payload], ctx: ServerContext) -> dict[str, nn.Module]:
        data = ctx.pooled_train_data()
        model = ctx.build(ctx.server_arch, purpose="central")
        cfg = self.local_config(ctx)
        bar = ctx.progress(total=cfg.epochs, desc="central training", unit="epoch")

        def on_epoch(epoch: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            ctx.log(epoch, train_loss=loss)

        local_train(model, data, cfg, ctx.device, seed=derive_seed(ctx.seed, "central"), progress=on_epoch)
        bar.close()
        return {"central": model}
