"""Server-side helpers shared by methods that receive classifier uploads."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, fields
from typing import Any, ClassVar

from torch import nn

from hetfl.fl.datafree import DataFreeConfig, DataFreeDistiller, Recipe, config_key
from hetfl.fl.method import OneShotMethod, ServerContext
from hetfl.fl.payload import Payload, PayloadError
from hetfl.fl.precision import check_compile


def classifier_from_upload(upload: Payload, client_id: int, ctx: ServerContext) -> nn.Module:
    """Validate a classifier upload (architecture, tensor names and shapes, finite values)
    against the client's assigned architecture and load it into a fresh model."""
    arch = ctx.client_archs[client_id]
    if upload.meta.get("arch") != arch:
        raise PayloadError(f"client {client_id}: uploaded arch {upload.meta.get('arch')!r}, expected {arch!r}")
    model = ctx.build(arch, purpose=f"upload-{client_id}")
    upload.validate({k: v.shape for k, v in model.state_dict().items()}, required_meta=("num_samples",))
    model.load_state_dict(upload.tensors)
    return model.eval()


def client_models(uploads: dict[int, Payload], ctx: ServerContext) -> dict[int, nn.Module]:
    return {cid: classifier_from_upload(up, cid, ctx) for cid, up in sorted(uploads.items())}


def group_by_arch(uploads: dict[int, Payload]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for cid, up in sorted(uploads.items()):
        groups[str(up.meta["arch"])].append(cid)
    return dict(groups)


class DataFreeMethod(OneShotMethod):
    """Base of the generator family (DENSE, Co-Boosting, FedHydra): validated
    :class:`DataFreeConfig` keys plus a method's own, a fresh student of the server architecture,
    and the shared :class:`DataFreeDistiller` loop. Subclasses implement :meth:`recipe`."""

    method_defaults: ClassVar[dict[str, Any]] = {}  # a method's own keys and its paper's defaults

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.defaults = {**asdict(DataFreeConfig()), **cls.method_defaults}

    @property
    def config(self) -> DataFreeConfig:
        keys = {f.name for f in fields(DataFreeConfig)}
        return DataFreeConfig(**{k: v for k, v in self.params.items() if k in keys})

    def check(self, ctx: ServerContext) -> None:
        """Bad loop settings (epochs, batch size, precision, compile without a compiler) fail before any
        training."""
        if self.config.compile:  # constructing DataFreeConfig validates the other keys
            check_compile(ctx.device)

    def recipe(self, teachers: list[nn.Module], ctx: ServerContext) -> Recipe:
        raise NotImplementedError

    def student(self, teachers: list[nn.Module], uploads: dict[int, Payload], ctx: ServerContext) -> nn.Module:
        """A freshly initialised server model (DENSE, Co-Boosting and FedHydra start from scratch)."""
        return ctx.build(ctx.server_arch, purpose=f"{self.name}-student")

    def server(self, uploads: dict[int, Payload], ctx: ServerContext) -> dict[str, nn.Module]:
        models = client_models(uploads, ctx)
        teachers = list(models.values())
        recipe = self.recipe(teachers, ctx)
        student = self.student(teachers, uploads, ctx)
        engine = DataFreeDistiller(teachers, student, recipe, self.config, ctx, self.name)
        model = engine.run(self.checkpoint_key(uploads), resume=ctx.resume)
        self.after(engine, ctx)
        return {self.name: model}

    def checkpoint_key(self, uploads: dict[int, Payload]) -> str:
        """What a checkpoint of this run must match to be resumed (:func:`config_key`)."""
        return config_key(self.config, method=self.name, params=self.params,
                          uploads=[uploads[c].meta.get("client_id") for c in sorted(uploads)])

    def after(self, engine: DataFreeDistiller, ctx: ServerContext) -> None:
        """Hook after the loop (plots, extra records)."""


# ---- multi-round helpers ------------------------------------------------------------------------------
def require_one_architecture(ctx: ServerContext, what: str) -> None:
    """ValueError unless every client uses the server architecture (``what``: why it must)."""
    mixed = sorted(set(ctx.client_archs) - {ctx.server_arch})
    if mixed:
        raise ValueError(f"{what}: it needs every client on the server architecture {ctx.server_arch!r}; "
                         f"clients use {mixed}")


def require_projection_head(ctx: ServerContext, method: str) -> None:
    """ValueError unless the client model has ``projection`` and ``head`` (MOON's, FedGen's heads)."""
    from hetfl.models import build_model

    model = build_model(ctx.server_arch, ctx.shape[0], ctx.shape[1], ctx.num_classes)
    if not (hasattr(model, "projection") and hasattr(model, "head")):
        raise ValueError(f"{method} needs a client model with a projection head (such as simplecnn); "
                         f"{ctx.server_arch!r} has none")


def frozen(models: list[nn.Module], device: Any) -> list[nn.Module]:
    """``models`` on ``device`` in eval mode with their parameters frozen (teachers of a server generator)."""
    for model in models:
        model.to(device).eval()
        for p in model.parameters():
            p.requires_grad_(False)
    return models


class ServerGenerator:
    """Mixin for a round method with a server generator ``self.generator`` and its optimiser
    ``self.gen_opt``: both go into the method's state (the checkpoint), so a resume continues them."""

    generator: nn.Module
    gen_opt: Any

    def state_dict(self) -> dict[str, Any]:
        from hetfl.fl.checkpoint import optimizer_tensors

        out = super().state_dict()  # type: ignore[misc]
        out.update({f"generator.{k}": v for k, v in self.generator.state_dict().items()})
        out.update(optimizer_tensors(self.gen_opt, "generator_opt."))
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from hetfl.fl.checkpoint import load_optimizer_tensors

        super().load_state_dict(state)  # type: ignore[misc]
        self.generator.load_state_dict({k[10:]: v for k, v in state.items() if k.startswith("generator.")})
        load_optimizer_tensors(self.gen_opt, state, "generator_opt.")
