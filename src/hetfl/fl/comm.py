"""Communication accounting: bytes sent up and down, per client and per round."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CommLedger:
    """Every transfer as ``(round, client, direction, bytes)``; totals derived on demand."""

    records: list[tuple[int, int, str, int]] = field(default_factory=list)

    def add(self, round_: int, client: int, direction: str, nbytes: int) -> None:
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        self.records.append((round_, client, direction, int(nbytes)))

    def total(self, direction: str) -> int:
        return sum(b for _, _, d, b in self.records if d == direction)

    def per_client(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for _, client, direction, nbytes in self.records:
            entry = out.setdefault(client, {"up": 0, "down": 0})
            entry[direction] += nbytes
        return dict(sorted(out.items()))

    def per_round(self) -> list[dict[str, int]]:
        rounds: dict[int, dict[str, int]] = {}
        for round_, _, direction, nbytes in self.records:
            entry = rounds.setdefault(round_, {"round": round_, "up": 0, "down": 0})
            entry[direction] += nbytes
        return [rounds[r] for r in sorted(rounds)]
