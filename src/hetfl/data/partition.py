"""Seeded client partitions of a labelled training set.

Every kind is a pure function of ``(labels, num_clients, spec, seed)``: the same seed gives the
same partition to every method, which is what makes one-shot comparisons fair.

Kinds (``spec["kind"]``):

``iid``
    Shuffle, then split into near-equal parts.
``dirichlet`` (``alpha``, ``min_size=10``, ``balance=True``)
    Label skew. For each class ``k`` draw ``p ~ Dir(alpha * 1_m)`` and split the class's samples
    by ``p``; with ``balance`` (the DENSE/MOON/NIID-Bench convention) clients already above the
    average size ``N/m`` receive nothing more. Resample the whole partition until every client
    holds at least ``min_size`` samples. ``min_size: half`` asks for at least half the average
    size (the FedDF/FedMHO convention).
``classes`` (``per_client=C``)
    Pathological label skew (NIID-Bench ``#C=k``): client ``i`` holds class ``i mod c`` plus
    ``C-1`` other distinct classes drawn at random; each class is split evenly among its holders.
    Classes nobody draws are left out (only possible when ``m < c``).
``2c/c``
    Client ``k`` holds every sample of classes ``2k`` and ``2k+1`` (FedHydra Table 2); the pairs
    are disjoint, so ``2m <= c`` is required. Classes beyond ``2m`` are left out.
``quantity`` (``alpha``, ``min_size=10``)
    Size skew with balanced labels: client shares ``q ~ Dir(alpha * 1_m)``, resampled until every
    client has ``min_size`` samples; a random permutation is cut by those shares.
``feddf_dirichlet`` (``alpha``)
    The partition of FedDF's public code (``build_non_iid_by_dirichlet`` and ``DataPartitioner``),
    which FedMHO's and FedHM's code bases inherit, step by step on numpy's legacy
    ``RandomState(seed)`` as that code draws from ``conf.random_state``: shuffle the (index, label)
    pairs; cut them into chunks of 10 "workers"; in each chunk split every class by a fresh
    ``Dir(alpha * 1)`` draw with the ``balance`` rule, all classes redrawn until every worker holds at
    least half the chunk's average; concatenate the workers' lists (each ordered by class) and give
    client ``i`` the ``i``-th of ``m`` **equal slices** ``int(N / m)`` long. So the clients are not the
    Dirichlet workers: every client has the same size and a slice can straddle two workers.
    With fewer than 10 clients there is one chunk of ``m`` workers (that code requires 10). The
    same seed gives the same partition as that code (e.g. FedMHO's README ``--manual_seed 2023``)
    if its training set is in the same order and ``conf.random_state`` has not been drawn from
    before (both read, not run: ``docs/results/fedmho-notes.md``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

PARTITION_KINDS = ("iid", "dirichlet", "classes", "2c/c", "quantity", "feddf_dirichlet")
MAX_RESAMPLES = 10_000
# A redraw loop stops after EARLY_DRAWS draws if none came within HOPELESS_SHORT - 1 clients of min_size:
# success was then out of reach of the remaining draws too, and the message says what would work.
EARLY_DRAWS = 100
HOPELESS_SHORT = 3
TRIAL_DRAWS = 5  # draws per larger alpha when the message looks for one that works


class PartitionError(ValueError):
    """A partition spec cannot be satisfied (bad parameter, too few samples, ...)."""


@dataclass(frozen=True)
class Partition:
    """Per-client index arrays into the training set, with the counts that describe them."""

    indices: tuple[np.ndarray, ...]
    num_classes: int
    counts: np.ndarray  # (clients, classes) int64

    @property
    def num_clients(self) -> int:
        return len(self.indices)

    @property
    def sizes(self) -> np.ndarray:
        return self.counts.sum(axis=1)

    def stats(self) -> dict[str, Any]:
        """What ``partition.json`` holds."""
        return {"num_classes": self.num_classes, "counts": self.counts.tolist()}


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_common(labels: np.ndarray, num_clients: int, num_classes: int | None) -> int:
    """Validate labels and client count; return the number of classes."""
    if labels.ndim != 1:
        raise PartitionError(f"labels must be a 1-d array, got shape {labels.shape}")
    if not _is_int(num_clients) or num_clients < 1:
        raise PartitionError(f"clients must be a positive integer, got {num_clients!r}")
    if num_clients > len(labels):
        raise PartitionError(f"{num_clients} clients but only {len(labels)} training samples")
    if labels.min() < 0:
        raise PartitionError(f"labels must be >= 0, got {labels.min()}")
    c = int(num_classes) if num_classes is not None else int(labels.max()) + 1
    if labels.max() >= c:
        raise PartitionError(f"labels reach {labels.max()} but num_classes={c}")
    return c


def _positive(spec: dict[str, Any], key: str) -> float:
    if key not in spec:
        raise PartitionError(f"partition kind '{spec['kind']}' needs '{key}'")
    value = spec[key]
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not (value > 0 and np.isfinite(value)):
        raise PartitionError(f"partition '{key}' must be a number > 0, got {value!r}")
    return float(value)


def _min_size(spec: dict[str, Any], n: int, m: int) -> int:
    raw = spec.get("min_size", 10)
    min_size = int(0.5 * n / m) if raw == "half" else int(raw)
    if min_size < 0:
        raise PartitionError(f"min_size must be >= 0 or 'half', got {raw!r}")
    if min_size * m > n:
        raise PartitionError(
            f"min_size={min_size} is impossible: {m} clients x {min_size} > {n} samples"
        )
    return min_size


def _iid(labels: np.ndarray, m: int, rng: np.random.Generator) -> list[np.ndarray]:
    return list(np.array_split(rng.permutation(len(labels)), m))


def _owners(pieces: list[tuple[np.ndarray, np.ndarray]], m: int) -> list[np.ndarray]:
    """Each client's indices from per-class (permuted indices, cut points): client ``j`` gets the ``j``-th
    piece of every class, in class order (as concatenating ``np.split`` pieces would)."""
    idx = np.concatenate([p for p, _ in pieces]) if pieces else np.zeros(0, np.int64)
    owner = np.concatenate([np.repeat(np.arange(m), np.diff(cuts, prepend=0, append=len(p))) for p, cuts in pieces]) \
        if pieces else np.zeros(0, np.int64)
    order = np.argsort(owner, kind="stable")
    return np.split(idx[order], np.cumsum(np.bincount(owner, minlength=m))[:-1])


def _unreachable(kind: str, m: int, min_size: int, draws: int, short: int, best: int,
                 alpha_works: float | None) -> PartitionError:
    hint = (f"min_size: {best} works with this seed (a draw reached it)" if best > 0
            else "no draw gave every client a sample")
    alpha = (f"alpha {alpha_works:g} reached min_size {min_size} in a trial draw" if alpha_works is not None
             else "no alpha up to 64x this one reached it in trial draws")
    return PartitionError(
        f"{kind} cannot give every one of {m} clients >= {min_size} samples: in {draws} draws at least {short} "
        f"clients fell short every time and the best draw's smallest client had {best}; {hint}; {alpha}; or use "
        "fewer clients")


def _alpha_that_works(alpha: float, min_size: int, sizes_of: Any) -> float | None:
    """The smallest of 2, 4, ... 64 x ``alpha`` at which one of TRIAL_DRAWS draws of ``sizes_of(alpha, rng)``
    gives every client ``min_size`` (a fixed trial seed: the message is the same every time)."""
    rng = np.random.default_rng(0x5EED)
    for factor in (2, 4, 8, 16, 32, 64):
        if any(sizes_of(alpha * factor, rng).min() >= min_size for _ in range(TRIAL_DRAWS)):
            return alpha * factor
    return None


def _dirichlet_draw(by_class: list[np.ndarray], m: int, n: int, alpha: float, balance: bool,
                    rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """One draw: every client's size and, per class, its permuted indices and cut points."""
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    sizes = np.zeros(m, dtype=np.int64)
    for idx_k in by_class:
        if len(idx_k) == 0:
            continue
        idx_k = rng.permutation(idx_k)
        p = rng.dirichlet(np.full(m, alpha))
        if balance:
            p = p * (sizes < n / m)
        if p.sum() <= 0:  # every client is above average: fall back to the raw draw
            p = rng.dirichlet(np.full(m, alpha))
        cuts = (np.cumsum(p / p.sum()) * len(idx_k)).astype(np.int64)[:-1]
        sizes += np.diff(cuts, prepend=0, append=len(idx_k))
        pieces.append((idx_k, cuts))
    return sizes, pieces


def _dirichlet(labels: np.ndarray, m: int, c: int, spec: dict, rng: np.random.Generator) -> list:
    alpha = _positive(spec, "alpha")
    n = len(labels)
    min_size = _min_size(spec, n, m)
    balance = bool(spec.get("balance", True))
    by_class = [np.flatnonzero(labels == k) for k in range(c)]
    best, short = -1, m  # over the draws: the largest smallest client, the fewest clients short
    for draw in range(1, MAX_RESAMPLES + 1):
        sizes, pieces = _dirichlet_draw(by_class, m, n, alpha, balance, rng)
        if sizes.min() >= min_size:
            return _owners(pieces, m)
        best, short = max(best, int(sizes.min())), min(short, int((sizes < min_size).sum()))
        if draw >= EARLY_DRAWS and short >= HOPELESS_SHORT:
            break
    works = _alpha_that_works(alpha, min_size, lambda a, g: _dirichlet_draw(by_class, m, n, a, balance, g)[0])
    raise _unreachable(f"dirichlet(alpha={alpha})", m, min_size, draw, short, best, works)


def _classes(labels: np.ndarray, m: int, c: int, spec: dict, rng: np.random.Generator) -> list:
    per_client = int(spec["per_client"])
    if not 1 <= per_client <= c:
        raise PartitionError(f"classes(per_client={spec.get('per_client')}) needs 1 <= C <= {c}")
    owned: list[list[int]] = []
    for i in range(m):
        first = i % c
        others = rng.permutation([k for k in range(c) if k != first])[: per_client - 1]
        owned.append([first, *others.tolist()])
    parts: list[list[np.ndarray]] = [[] for _ in range(m)]
    for k in range(c):
        holders = [i for i in range(m) if k in owned[i]]
        if not holders:
            continue
        pieces = np.array_split(rng.permutation(np.flatnonzero(labels == k)), len(holders))
        for i, piece in zip(holders, pieces):
            parts[i].append(piece)
    return [np.concatenate(p) for p in parts]


def _two_per_client(labels: np.ndarray, m: int, c: int) -> list:
    if 2 * m > c:
        raise PartitionError(f"2c/c gives each client 2 disjoint classes: needs 2 x {m} <= {c}")
    return [np.flatnonzero((labels == 2 * i) | (labels == 2 * i + 1)) for i in range(m)]


def _quantity(labels: np.ndarray, m: int, spec: dict, rng: np.random.Generator) -> list:
    alpha = _positive(spec, "alpha")
    n = len(labels)
    min_size = _min_size(spec, n, m)
    best, short = -1, m
    for draw in range(1, MAX_RESAMPLES + 1):
        shares = rng.dirichlet(np.full(m, alpha))
        cuts = (np.cumsum(shares) * n).astype(np.int64)[:-1]
        sizes = np.diff(np.concatenate([[0], cuts, [n]]))
        if sizes.min() >= min_size:
            return list(np.split(rng.permutation(n), cuts))
        best, short = max(best, int(sizes.min())), min(short, int((sizes < min_size).sum()))
        if draw >= EARLY_DRAWS and short >= HOPELESS_SHORT:
            break
    works = _alpha_that_works(alpha, min_size, lambda a, g: np.diff(np.concatenate(
        [[0], (np.cumsum(g.dirichlet(np.full(m, a))) * n).astype(np.int64)[:-1], [n]])))
    raise _unreachable(f"quantity(alpha={alpha})", m, min_size, draw, short, best, works)


FEDDF_GROUP = 10  # FedDF's ``n_auxi_workers``: Dirichlet workers per chunk of the shuffled data


def _feddf_dirichlet(labels: np.ndarray, m: int, c: int, spec: dict, seed: int) -> list:
    alpha = _positive(spec, "alpha")
    n = len(labels)
    rs = np.random.RandomState(seed)
    pairs = np.stack([np.arange(n), labels], axis=1)
    rs.shuffle(pairs)  # rows
    chunks = -(-m // FEDDF_GROUP)
    workers: list[np.ndarray] = []
    start = 0
    for i in range(chunks):
        stop = n if i == chunks - 1 else start + int(FEDDF_GROUP / m * n)
        count = FEDDF_GROUP if i < chunks - 1 else m - FEDDF_GROUP * (chunks - 1)
        workers += _feddf_chunk(pairs[start:stop], count, c, alpha, rs)
        start = stop
    order = np.concatenate(workers)
    size = int(1.0 / m * n)
    return [order[i * size:(i + 1) * size] for i in range(m)]


def _feddf_chunk(pairs: np.ndarray, k: int, c: int, alpha: float, rs: np.random.RandomState) -> list:
    """One chunk's ``k`` worker lists, each the concatenation of its share of class 0, 1, ..."""
    size = len(pairs)
    floor = int(0.5 * size / k)
    members = [pairs[pairs[:, 1] == cls, 0] for cls in range(c)]
    for _ in range(MAX_RESAMPLES):
        lists: list[list[np.ndarray]] = [[] for _ in range(k)]
        sizes = np.zeros(k, dtype=np.int64)
        for idx in members:
            p = rs.dirichlet(np.repeat(alpha, k))
            p = p * (sizes < size / k)  # never all zero: this class is not yet given out
            cuts = (np.cumsum(p / p.sum()) * len(idx)).astype(int)[:-1]
            for j, piece in enumerate(np.split(idx, cuts)):
                lists[j].append(piece)
                sizes[j] += len(piece)
        if sizes.min() >= floor:
            return [np.concatenate(parts) for parts in lists]
    raise PartitionError(
        f"feddf_dirichlet(alpha={alpha}) could not give every one of {k} workers >= {floor} samples "
        f"in {MAX_RESAMPLES} draws; raise alpha"
    )


ALLOWED_KEYS = {
    "iid": {"kind"},
    "dirichlet": {"kind", "alpha", "min_size", "balance"},
    "classes": {"kind", "per_client"},
    "2c/c": {"kind"},
    "quantity": {"kind", "alpha", "min_size"},
    "feddf_dirichlet": {"kind", "alpha"},
}


def validate_spec(spec: dict[str, Any]) -> None:
    kind = spec.get("kind")
    if kind not in PARTITION_KINDS:
        raise PartitionError(f"unknown partition kind {kind!r}; choose one of: {', '.join(PARTITION_KINDS)}")
    extra = set(spec) - ALLOWED_KEYS[kind]
    if extra:
        raise PartitionError(
            f"partition '{kind}' does not take {sorted(extra)}; valid keys: {sorted(ALLOWED_KEYS[kind])}"
        )
    if kind in ("dirichlet", "quantity", "feddf_dirichlet"):
        _positive(spec, "alpha")
    if kind in ("dirichlet", "quantity"):
        raw = spec.get("min_size", 10)
        if raw != "half" and not (_is_int(raw) and raw >= 0):
            raise PartitionError(f"min_size must be a non-negative integer or 'half', got {raw!r}")
    if kind == "dirichlet" and not isinstance(spec.get("balance", True), (bool, np.bool_)):
        raise PartitionError(f"balance must be true or false, got {spec['balance']!r}")
    if kind == "classes" and not (_is_int(spec.get("per_client")) and spec["per_client"] >= 1):
        raise PartitionError(f"classes needs per_client >= 1, got {spec.get('per_client')!r}")


def make_partition(
    labels: np.ndarray, num_clients: int, spec: dict[str, Any], seed: int, num_classes: int | None = None
) -> Partition:
    """Split sample indices among ``num_clients`` clients as ``spec`` says, seeded by ``seed``."""
    validate_spec(spec)
    labels = np.asarray(labels, dtype=np.int64)
    c = _check_common(labels, num_clients, num_classes)
    rng = np.random.default_rng([seed, 0x9A27])
    kind = spec["kind"]
    if kind == "iid":
        parts = _iid(labels, num_clients, rng)
    elif kind == "dirichlet":
        parts = _dirichlet(labels, num_clients, c, spec, rng)
    elif kind == "classes":
        parts = _classes(labels, num_clients, c, spec, rng)
    elif kind == "2c/c":
        parts = _two_per_client(labels, num_clients, c)
    elif kind == "feddf_dirichlet":
        parts = _feddf_dirichlet(labels, num_clients, c, spec, seed)
    else:
        parts = _quantity(labels, num_clients, spec, rng)
    indices = tuple(np.sort(np.asarray(p, dtype=np.int64)) for p in parts)
    counts = np.stack([np.bincount(labels[idx], minlength=c) for idx in indices]).astype(np.int64)
    empty = [i for i, idx in enumerate(indices) if len(idx) == 0]
    if empty:
        raise PartitionError(f"partition left clients {empty} without data; use fewer clients")
    return Partition(indices, c, counts)
