"""Upload cache: client uploads stored as safetensors + JSON under a key of all that determines them.

The key hashes the data fingerprint (dataset, its options, partition spec, number of clients,
seed, the client's own sample indices), the full request the server sent (task, architecture,
initial seed, local hyperparameters, any tensors it carried), the cache format version, the
torch version and the device type. Two methods that send the same request therefore receive
byte-identical uploads, and a second run skips local training.

Retraining (no cache, or another cache folder) repeats an upload bit for bit only on the same
device with the same torch thread count: CPU kernels split their sums by thread, so another
count changes the last bits, and ten local epochs turn that into accuracy differences of up to a
few points. The count is written beside each upload (``torch_threads``), not keyed, so a cached
upload is reused whatever the current count.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hetfl.fl.payload import Payload, PayloadError

CACHE_VERSION = 1


def request_key(fingerprint: dict[str, Any], message: Payload, device: torch.device) -> str:
    digest = hashlib.sha256()
    head = {"v": CACHE_VERSION, "torch": torch.__version__, "device": device.type,
            "data": fingerprint, "meta": message.meta}
    digest.update(json.dumps(head, sort_keys=True).encode())
    for name in sorted(message.tensors):
        digest.update(name.encode())
        digest.update(message.tensors[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def uploads_digest(uploads: Mapping[int, Payload]) -> str:
    """sha256 over the clients' ids and their uploads' bytes (tensors and metadata), in client order:
    equal digests mean two runs received byte-identical uploads from the same clients."""
    digest = hashlib.sha256()
    for cid in sorted(uploads):
        digest.update(f"{cid}:{uploads[cid].sha256()}\n".encode())
    return digest.hexdigest()


class UploadCache:
    """A folder of ``<key>.safetensors`` uploads with a readable ``<key>.json`` beside each."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def get(self, key: str) -> Payload | None:
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            return Payload.from_bytes(path.read_bytes())
        except PayloadError as err:  # a damaged file (e.g. a crash before it reached the disk): retrain
            warnings.warn(f"upload cache: {path} is unreadable ({err}); removed, that client trains again",
                          stacklevel=2)
            path.unlink(missing_ok=True)
            return None

    def info(self, key: str) -> dict[str, Any]:
        """The JSON written beside an upload (fingerprint, request, training seconds)."""
        path = self._path(key).with_suffix(".json")
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def put(self, key: str, payload: Payload, describe: dict[str, Any]) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(payload.to_bytes())
        os.replace(tmp, path)  # atomic: a crash never leaves a half-written upload
        info = {"key": key, **describe, "meta": payload.meta}
        path.with_suffix(".json").write_text(json.dumps(info, indent=1, sort_keys=True))
