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

:func:`import_uploads` re-keys another cache's uploads (say, trained on a lent GPU) for this torch and
device, on purpose: more methods then run here on byte-identical uploads (``uploads_sha256`` in a
summary shows it), e.g. a CPU-only baseline beside GPU-run ones.

Every entry's JSON records the sha256 of its upload's bytes; :meth:`UploadCache.get` checks it, so a
cached upload is either exactly what was trained or it is deleted and trained again.
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


def _head(fingerprint: dict[str, Any], meta: dict[str, Any], torch_version: str, device_type: str) -> bytes:
    """What a key hashes before the request's tensors."""
    head = {"v": CACHE_VERSION, "torch": torch_version, "device": device_type, "data": fingerprint, "meta": meta}
    return json.dumps(head, sort_keys=True).encode()


def request_key(fingerprint: dict[str, Any], message: Payload, device: torch.device) -> str:
    digest = hashlib.sha256()
    digest.update(_head(fingerprint, message.meta, torch.__version__, device.type))
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
        """The upload stored under ``key``, exactly as it was stored, or None. An entry whose bytes no
        longer match the sha256 recorded beside them, whose record is missing, or that does not parse
        or holds non-finite values is reported, deleted, and its client trains again."""
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            blob = path.read_bytes()
            recorded = json.loads(path.with_suffix(".json").read_text()).get("sha256")
            if recorded != hashlib.sha256(blob).hexdigest():
                raise PayloadError("its bytes differ from the sha256 recorded when it was stored"
                                   if recorded else "no sha256 recorded beside it")
            upload = Payload.from_bytes(blob)
            upload.validate()  # finite values
        except (OSError, ValueError) as err:  # PayloadError and a damaged JSON record are ValueErrors
            warnings.warn(f"upload cache: {path} is damaged ({err}); removed, that client trains again",
                          stacklevel=2)
            self.remove(key)
            return None
        return upload

    def remove(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        path.with_suffix(".json").unlink(missing_ok=True)

    def partial_path(self, key: str) -> Path:
        """Where the client training for ``key`` keeps a resumable state until its upload is stored
        (:class:`hetfl.fl.checkpoint.TrainCheckpoint`)."""
        return self.root / "partial" / f"{key}.safetensors"

    def has(self, key: str) -> bool:
        """Whether an upload is stored under ``key`` (without reading it)."""
        return self._path(key).is_file()

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
        blob = payload.to_bytes()
        info = {"key": key, **describe, "meta": payload.meta, "sha256": hashlib.sha256(blob).hexdigest()}
        record = path.with_suffix(".json")
        tmp = record.with_name(f"{record.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(info, indent=1, sort_keys=True))
        os.replace(tmp, record)  # the record first: an upload is never stored without its digest
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_bytes(blob)
        os.replace(tmp, path)  # atomic: a crash never leaves a half-written upload


def _head_key(fingerprint: dict[str, Any], request: dict[str, Any], torch_version: str, device_type: str) -> str:
    """:func:`request_key` of a request without tensors, for any torch version and device type."""
    return hashlib.sha256(_head(fingerprint, request, torch_version, device_type)).hexdigest()


def import_uploads(src: str | Path, dst: str | Path, device: torch.device) -> list[tuple[str, str]]:
    """Copy every upload of the cache folder ``src`` into ``dst`` under the key that this torch on
    ``device`` looks up for the same request; returns (old key, new key) pairs. An entry's JSON must
    hold its fingerprint and request; where it names the torch and device it was keyed for
    (``keyed_for``, written since this function exists) the old key is checked against them. A request
    that carried tensors cannot be re-keyed from its JSON: such entries fail, as do unreadable uploads."""
    src, dst = Path(src), Path(dst)
    entries = sorted(src.glob("*/*.json"))
    if not entries:
        raise PayloadError(f"{src}: no upload-cache entries (<key[:2]>/<key>.json)")
    pairs = []
    for info_path in entries:
        info = json.loads(info_path.read_text())
        if "fingerprint" not in info or "request" not in info:
            raise PayloadError(f"{info_path}: not an upload-cache entry (no fingerprint or request)")
        if info.get("request_tensors"):
            raise PayloadError(f"{info_path}: its request carried tensors {info['request_tensors']}; "
                               "the key cannot be rebuilt from the JSON")
        made = info.get("keyed_for")
        if made and _head_key(info["fingerprint"], info["request"], made["torch"], made["device"]) != info_path.stem:
            raise PayloadError(f"{info_path}: the key does not match its fingerprint and request")
        blob = info_path.with_suffix(".safetensors")
        try:
            upload = Payload.from_bytes(blob.read_bytes())
        except (OSError, PayloadError) as err:
            raise PayloadError(f"{blob}: missing or unreadable ({err})") from err
        key = _head_key(info["fingerprint"], info["request"], torch.__version__, device.type)
        describe = {k: v for k, v in info.items() if k not in ("key", "meta", "keyed_for", "sha256")}
        UploadCache(dst).put(key, upload, {**describe, "keyed_for": {"torch": torch.__version__, "device": device.type},
                                           "imported_from": {"key": info_path.stem, "keyed_for": made}})
        pairs.append((info_path.stem, key))
    return pairs
