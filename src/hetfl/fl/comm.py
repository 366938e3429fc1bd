"""Communication accounting: every transfer with its direction, kind, payload bytes and tensor bytes.

A record is ``(round, client, direction, payload_bytes, kind, tensor_bytes)``:

* ``direction``: ``up`` (client to server), ``down`` (server to client) or ``peer`` (one client's data
  for another, relayed through the server: counted once, as the sender's upload; the copy the server
  forwards under ``relayed/`` in the receiver's message is not counted again);
* ``kind``: what the tensors are (:data:`KINDS`), read from the payload's ``kind`` metadata
  (``model`` where it names none);
* ``payload_bytes``: the whole wire form (safetensors header and JSON metadata included), what a
  transport sends; ``tensor_bytes``: the tensors alone (``numel x element size``), the quantity the
  papers' communication equations count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetfl.fl.payload import Payload

DIRECTIONS = ("up", "down", "peer")
KINDS = ("model", "logits", "soft_labels", "distilled_data", "labels", "raw_data", "state", "generator", "info")

Record = tuple[int, int, str, int, str, int]
RELAYED = "relayed/"  # tensor-name prefix of forwarded peer data in a message (counted at its sender)


@dataclass
class CommLedger:
    """Every transfer as a :data:`Record`; totals derived on demand."""

    records: list[Record] = field(default_factory=list)

    def add(self, round_: int, client: int, direction: str, nbytes: int, kind: str = "model",
            tensor_bytes: int = 0) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.records.append((int(round_), int(client), direction, int(nbytes), kind, int(tensor_bytes)))

    def add_payload(self, round_: int, client: int, direction: str, payload: Payload) -> None:
        """One payload: its bytes under its ``kind``; tensors whose names start with a prefix in its
        ``tensor_kinds`` metadata (e.g. ``{"generator/": "generator"}``) count as that kind (a record of
        their own with no payload bytes). Tensors under ``relayed/`` (other clients' data the server
        forwards, counted once as their senders' ``peer`` uploads) are not counted again."""
        prefixes: dict[str, str] = dict(payload.meta.get("tensor_kinds") or {})
        by_kind: dict[str, int] = {}
        forwarded = 0
        for name, t in payload.tensors.items():
            if name.startswith(RELAYED):
                forwarded += t.numel() * t.element_size()
                continue
            kind = next((k for p, k in prefixes.items() if name.startswith(p)), payload.kind)
            by_kind[kind] = by_kind.get(kind, 0) + t.numel() * t.element_size()
        self.add(round_, client, direction, payload.nbytes - forwarded, payload.kind, by_kind.pop(payload.kind, 0))
        for kind, nbytes in sorted(by_kind.items()):
            self.add(round_, client, direction, 0, kind, nbytes)

    def restore(self, rows: list[list]) -> None:
        """The records of a checkpoint's JSON (rows of an older 4-field form count as models)."""
        self.records[:] = [(*r, "model", 0) if len(r) == 4 else tuple(r) for r in rows]  # type: ignore[misc]

    def total(self, direction: str) -> int:
        return sum(r[3] for r in self.records if r[2] == direction)

    def tensor_bytes(self, direction: str | None = None) -> dict[str, int]:
        """Tensor bytes per kind (of one direction, or all)."""
        out: dict[str, int] = {}
        for _, _, d, _, kind, tb in self.records:
            if direction is None or d == direction:
                out[kind] = out.get(kind, 0) + tb
        return dict(sorted(out.items()))

    def per_client(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for _, client, direction, nbytes, _, _ in self.records:
            entry = out.setdefault(client, {d: 0 for d in DIRECTIONS})
            entry[direction] += nbytes
        return dict(sorted(out.items()))

    def per_round(self) -> list[dict[str, int]]:
        """Per round: payload bytes per direction and ``tensor_bytes`` (every direction and kind)."""
        rounds: dict[int, dict[str, int]] = {}
        for round_, _, direction, nbytes, _, tb in self.records:
            entry = rounds.setdefault(round_, {"round": round_, **{d: 0 for d in DIRECTIONS}, "tensor_bytes": 0})
            entry[direction] += nbytes
            entry["tensor_bytes"] += tb
        return [rounds[r] for r in sorted(rounds)]

    def summary(self) -> dict[str, object]:
        """What ``summary.json`` reports: payload bytes per direction and tensor bytes per kind."""
        return {"bytes_up": self.total("up"), "bytes_down": self.total("down"), "bytes_peer": self.total("peer"),
                "tensor_bytes": {d: self.tensor_bytes(d) for d in DIRECTIONS if self.tensor_bytes(d)}}


# ---- the papers' communication equations (HFLDD, Sec. V-C and VI-A4), in bits ------------------------------
B1 = 32  # bits per model parameter (and per soft-label value)
B2 = 8  # bits per pixel of a distilled image (grayscale; 3 x 8 for RGB)


def cost_fedavg(clients: int, rounds: int, params: int, b1: int = B1) -> int:
    """Eq. 3 (FedAvg, FedProx, DynaFed): N (2T - 1) |w| B1; the first download is a seed (free)."""
    return clients * (2 * rounds - 1) * params * b1


def cost_hfldd(clients: int, aux_size: int, classes: int, distilled: list[int], pixels: int, heads: int,
               params: int, rounds: int, b1: int = B1, b2: int = B2) -> int:
    """Eq. 18: N |D_g| N_c B1 (soft labels) + sum over the members of |D~_i| x pixels x B2 (distilled images
    to their heads) + H |w| (2T - 1) B1 (the heads' rounds)."""
    return (clients * aux_size * classes * b1 + sum(distilled) * pixels * b2
            + heads * params * (2 * rounds - 1) * b1)


def cost_fedseq(clusters: int, per_cluster: int, params: int, rounds: int, b1: int = B1) -> int:
    """Eq. 19: O |w| B1 ((2T - 1) + T J): the heads' rounds plus the model passed around each ring."""
    return clusters * params * b1 * ((2 * rounds - 1) + rounds * per_cluster)


def mebibytes(bits: int) -> float:
    """Bits as MiB (the papers' "MB")."""
    return bits / 8 / 2**20
