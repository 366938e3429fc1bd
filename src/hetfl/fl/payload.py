"""Typed payloads: what travels between a client and the server.

A :class:`Payload` is named tensors plus small JSON metadata (task, client id, sample count,
label histogram, architecture, hyperparameters). Its wire form is one safetensors blob whose
``__metadata__`` holds the JSON under the key ``hetfl``: no pickle anywhere, so an upload from an
untrusted client can be parsed safely, and ``len(payload.to_bytes())`` is the exact number of bytes
a transport sends. The same payloads are used by the in-process simulator and by the Flower
adapter.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

META_KEY = "hetfl"


class PayloadError(ValueError):
    """A payload is malformed: wrong names, shapes or dtypes, non-finite values, bad metadata."""


@dataclass
class Payload:
    """Named tensors and JSON-serialisable metadata."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}
        return st_save(tensors, metadata={META_KEY: json.dumps(self.meta, sort_keys=True)})

    def write(self, path: str | Path) -> None:
        """:meth:`to_bytes` into ``path`` through a temporary file and a rename: a stop or a crash leaves
        the previous file (or none), never half a payload."""
        path = Path(path)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_bytes(self.to_bytes())
        os.replace(tmp, path)

    @classmethod
    def from_bytes(cls, blob: bytes) -> Payload:
        try:
            tensors = st_load(blob)
        except Exception as err:  # safetensors raises several error types
            raise PayloadError(f"not a hetfl payload (safetensors + JSON metadata): {err}") from err
        return cls(tensors, _meta(blob[8 : 8 + int.from_bytes(blob[:8], "little")]))

    @staticmethod
    def read_meta(path: str | Path) -> dict[str, Any]:
        """The metadata of a payload file, from its header alone (the tensors are not read)."""
        with open(path, "rb") as f:
            return _meta(f.read(int.from_bytes(f.read(8), "little")))

    def sha256(self) -> str:
        """Hex sha256 of :meth:`to_bytes`: equal digests mean byte-identical payloads."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (safetensors header + tensor data)."""
        return len(self.to_bytes())

    @property
    def tensor_nbytes(self) -> int:
        """Bytes of the tensors alone (``numel x element size``), no header or metadata."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def kind(self) -> str:
        """What the tensors are, for the ledger (hetfl.fl.comm.KINDS): the ``kind`` metadata, else a model."""
        return str(self.meta.get("kind", "model"))

    def validate(self, expected: Mapping[str, torch.Size | tuple[int, ...]] | None = None,
                 required_meta: tuple[str, ...] = ()) -> None:
        """Raise :class:`PayloadError` unless names/shapes match ``expected`` and values are finite."""
        missing = [k for k in required_meta if k not in self.meta]
        if missing:
            raise PayloadError(f"metadata lacks {missing}")
        if expected is not None:
            want, got = set(expected), set(self.tensors)
            if want != got:
                raise PayloadError(
                    f"tensor names differ: missing {sorted(want - got)[:5]}, unexpected {sorted(got - want)[:5]}"
                )
            for name, shape in expected.items():
                if tuple(self.tensors[name].shape) != tuple(shape):
                    raise PayloadError(
                        f"tensor {name!r} has shape {tuple(self.tensors[name].shape)}, expected {tuple(shape)}"
                    )
        for name, tensor in self.tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise PayloadError(f"tensor {name!r} has NaN or inf values")


def _meta(header: bytes) -> dict[str, Any]:
    """The hetfl metadata in a safetensors header."""
    try:
        meta = json.loads(json.loads(header).get("__metadata__", {}).get(META_KEY, "{}"))
    except Exception as err:
        raise PayloadError(f"not a hetfl payload (safetensors + JSON metadata): {err}") from err
    if not isinstance(meta, dict):
        raise PayloadError("payload metadata must be a JSON object")
    return meta


def state_payload(module: torch.nn.Module, **meta: Any) -> Payload:
    """A model's full state (parameters and buffers) as a payload."""
    return Payload({k: v.detach().clone().cpu() for k, v in module.state_dict().items()}, dict(meta))


def jsonl_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (``metrics.jsonl``), skipping blank lines and a line a kill cut
    short while it was written (it fails to parse)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def json_safe(value: Any) -> Any:
    """Convert numpy/torch scalars and arrays into plain JSON types."""
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
