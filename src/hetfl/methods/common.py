"""Server-side helpers shared by methods that receive classifier uploads."""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from hetfl.fl.method import ServerContext
from hetfl.fl.payload import Payload, PayloadError


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
