"""make_partition on synthetic label arrays: coverage, counts, skew, determinism and errors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from hetfl.data import partition as partition_mod
from hetfl.data.partition import PARTITION_KINDS, Partition, PartitionError, make_partition

C = 10


def balanced_labels(per_class: int = 500, classes: int = C, seed: int = 1) -> np.ndarray:
    """``classes x per_class`` labels in shuffled order."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(classes), per_class))


def unbalanced_labels(seed: int = 2) -> np.ndarray:
    """Class k has 50 + 100 k samples (50 ... 950), shuffled."""
    sizes = 50 + 100 * np.arange(C)
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(C), sizes))


LABELS = {"balanced": balanced_labels(), "unbalanced": unbalanced_labels()}

COVERING_SPECS = [
    ({"kind": "iid"}, 7),
    ({"kind": "dirichlet", "alpha": 0.05}, 10),
    ({"kind": "dirichlet", "alpha": 0.5}, 10),
    ({"kind": "dirichlet", "alpha": 100}, 10),
    ({"kind": "dirichlet", "alpha": 0.5, "balance": False}, 10),
    ({"kind": "quantity", "alpha": 0.5}, 10),
    ({"kind": "classes", "per_client": 2}, 10),
    ({"kind": "classes", "per_client": 2}, 13),
    ({"kind": "classes", "per_client": 3}, 20),
    ({"kind": "2c/c"}, 5),
    ({"kind": "feddf_dirichlet", "alpha": 0.5}, 10),
    ({"kind": "feddf_dirichlet", "alpha": 0.1}, 20),
]


def _id(case: tuple[dict, int]) -> str:
    spec, m = case
    rest = ",".join(f"{k}={v}" for k, v in spec.items() if k != "kind")
    return f"{spec['kind']}({rest})x{m}"


def class_shares(p: Partition) -> np.ndarray:
    return p.counts / p.counts.sum(axis=1, keepdims=True)


def feddf_reference(labels: np.ndarray, m: int, alpha: float, seed: int) -> list[list[int]]:
    """FedDF's partition written out with Python lists, one sample at a time (slow reference)."""
    rs = np.random.RandomState(seed)
    pairs = np.array([[i, int(y)] for i, y in enumerate(labels)])
    rs.shuffle(pairs)
    pairs = pairs.tolist()
    n, c, order, start, left = len(pairs), int(max(labels)) + 1, [], 0, m
    while left > 0:
        k = min(10, left)
        stop = n if left <= 10 else start + int(10 / m * n)
        chunk = pairs[start:stop]
        while True:
            workers: list[list[int]] = [[] for _ in range(k)]
            for cls in range(c):
                members = [i for i, y in chunk if y == cls]
                p = [q if len(workers[j]) < len(chunk) / k else 0.0 for j, q in enumerate(rs.dirichlet([alpha] * k))]
                bounds, acc = [0], 0.0
                for q in p[:-1]:
                    acc += q / sum(p)
                    bounds.append(int(acc * len(members)))
                bounds.append(len(members))
                for j in range(k):
                    workers[j] += members[bounds[j]:bounds[j + 1]]
            if min(len(w) for w in workers) >= int(0.5 * len(chunk) / k):
                break
        order += [i for w in workers for i in w]
        start, left = stop, left - 10
    size = int(1.0 / m * n)
    return [sorted(order[i * size:(i + 1) * size]) for i in range(m)]


@pytest.mark.parametrize("m, n", [(10, 2000), (20, 2000), (10, 1999), (4, 1000)])
def test_feddf_dirichlet_equals_a_slow_reference_and_gives_equal_slices(m, n):
    labels = balanced_labels(per_class=n // C + 1)[:n]
    p = make_partition(labels, m, {"kind": "feddf_dirichlet", "alpha": 0.3}, seed=2023)
    expected = feddf_reference(labels, m, 0.3, seed=2023)
    assert [idx.tolist() for idx in p.indices] == expected
    assert set(p.sizes.tolist()) == {n // m}  # equal clients; the remainder (n mod m) is left out
    assert len(np.unique(np.concatenate(p.indices))) == m * (n // m)
    # skewed: at alpha 0.3 some client lacks some class although every client has n/m samples
    assert (p.counts == 0).any()


def test_feddf_dirichlet_rejects_dirichlet_only_keys():
    with pytest.raises(PartitionError, match="does not take \\['min_size'\\]"):
        make_partition(LABELS["balanced"], 10, {"kind": "feddf_dirichlet", "alpha": 0.5, "min_size": "half"}, seed=0)


# ------------------------------------------------------------------------------ coverage


@pytest.mark.parametrize("label_kind", sorted(LABELS))
@pytest.mark.parametrize("case", COVERING_SPECS, ids=[_id(c) for c in COVERING_SPECS])
def test_partition_is_disjoint_cover_with_exact_counts(case, label_kind):
    spec, m = case
    labels = LABELS[label_kind]
    n = len(labels)
    p = make_partition(labels, m, spec, seed=3)

    assert isinstance(p, Partition)
    assert p.num_clients == m == len(p.indices)
    assert p.num_classes == C
    assert p.counts.shape == (m, C)
    assert p.counts.dtype == np.int64

    for idx in p.indices:
        assert idx.dtype == np.int64
        assert len(idx) > 0
        assert np.all(np.diff(idx) > 0), "indices are sorted and have no duplicates"

    everything = np.concatenate(p.indices)
    # Disjoint: no index appears twice. Cover: the union is exactly range(N).
    assert len(everything) == n
    np.testing.assert_array_equal(np.sort(everything), np.arange(n))

    for k, idx in enumerate(p.indices):
        np.testing.assert_array_equal(p.counts[k], np.bincount(labels[idx], minlength=C))
    assert p.counts.sum() == n
    np.testing.assert_array_equal(p.counts.sum(axis=1), p.sizes)
    np.testing.assert_array_equal(p.sizes, [len(idx) for idx in p.indices])
    # Column sums: every class keeps all its samples.
    np.testing.assert_array_equal(p.counts.sum(axis=0), np.bincount(labels, minlength=C))


def test_iid_sizes_differ_by_at_most_one_and_labels_are_mixed():
    labels = LABELS["balanced"]
    p = make_partition(labels, 7, {"kind": "iid"}, seed=0)
    assert p.sizes.max() - p.sizes.min() <= 1
    # ~714 samples each: every class present with a share near 0.1.
    assert np.all(p.counts > 0)
    assert np.abs(class_shares(p) - 0.1).max() < 0.05


def test_accepts_lists_and_explicit_num_classes():
    labels = [0, 1, 2, 0, 1, 2, 0, 1]
    p = make_partition(labels, 2, {"kind": "iid"}, seed=0, num_classes=5)
    assert p.num_classes == 5
    assert p.counts.shape == (2, 5)
    np.testing.assert_array_equal(p.counts[:, 3:], 0)
    np.testing.assert_array_equal(p.counts.sum(axis=0), [3, 3, 2, 0, 0])


def test_labels_beyond_num_classes_raise():
    with pytest.raises(PartitionError, match="labels reach 3 but num_classes=3"):
        make_partition(np.array([0, 1, 2, 3]), 2, {"kind": "iid"}, seed=0, num_classes=3)


# ----------------------------------------------------------------------------- dirichlet


def test_dirichlet_small_alpha_is_skewed_and_large_alpha_is_near_uniform():
    labels = LABELS["balanced"]
    skewed = make_partition(labels, 20, {"kind": "dirichlet", "alpha": 0.05}, seed=0)
    uniform = make_partition(labels, 20, {"kind": "dirichlet", "alpha": 1000}, seed=0)

    skewed_top = class_shares(skewed).max(axis=1).mean()
    uniform_top = class_shares(uniform).max(axis=1).mean()
    assert skewed_top > 0.7
    assert uniform_top < 0.15
    # Large alpha: every client's every class share is within a few % of 1/c.
    assert np.abs(class_shares(uniform) - 1 / C).max() < 0.03
    assert np.all(uniform.counts > 0)
    # Small alpha: many (client, class) cells are empty.
    assert (skewed.counts == 0).mean() > 0.4


def test_dirichlet_skew_decreases_with_alpha():
    labels = LABELS["balanced"]
    tops = []
    for alpha in (0.05, 0.5, 100):
        p = make_partition(labels, 10, {"kind": "dirichlet", "alpha": alpha}, seed=4)
        tops.append(class_shares(p).max(axis=1).mean())
    assert tops[0] > tops[1] > tops[2]


@pytest.mark.parametrize("min_size", [0, 10, 200, 400])
def test_dirichlet_min_size_is_respected(min_size):
    labels = LABELS["balanced"]
    for seed in range(3):
        p = make_partition(labels, 10, {"kind": "dirichlet", "alpha": 0.5, "min_size": min_size}, seed=seed)
        assert p.sizes.min() >= min_size


def test_dirichlet_default_min_size_is_ten():
    labels = LABELS["balanced"]
    for seed in range(5):
        p = make_partition(labels, 20, {"kind": "dirichlet", "alpha": 0.05}, seed=seed)
        assert p.sizes.min() >= 10


@pytest.mark.parametrize("label_kind", sorted(LABELS))
def test_dirichlet_min_size_half_gives_half_the_average(label_kind):
    labels = LABELS[label_kind]
    m = 10
    for seed in range(3):
        p = make_partition(labels, m, {"kind": "dirichlet", "alpha": 0.5, "min_size": "half"}, seed=seed)
        assert p.sizes.min() >= 0.5 * len(labels) / m - 1
        assert p.sizes.min() >= int(0.5 * len(labels) / m)


def test_dirichlet_that_cannot_meet_min_size_raises(monkeypatch):
    # 10 classes x 10 samples, 10 clients each needing all 10 of an average share: with
    # alpha=0.01 and no balancing the draws essentially never split that evenly.
    monkeypatch.setattr(partition_mod, "MAX_RESAMPLES", 50)
    labels = np.repeat(np.arange(C), 10)
    spec = {"kind": "dirichlet", "alpha": 0.01, "min_size": 10, "balance": False}
    with pytest.raises(PartitionError, match=r"cannot give every one of 10 clients >= 10 samples: in 50 draws"):
        make_partition(labels, 10, spec, seed=0)


def slow_dirichlet(labels: np.ndarray, m: int, c: int, alpha: float, min_size: int, balance: bool,
                   seed: int) -> list[np.ndarray]:
    """The redraw loop written plainly, one list of pieces per client (the reference)."""
    rng = np.random.default_rng([seed, 0x9A27])  # make_partition's stream
    n, by_class = len(labels), [np.flatnonzero(labels == k) for k in range(c)]
    while True:
        parts: list[list[np.ndarray]] = [[] for _ in range(m)]
        sizes = np.zeros(m, dtype=np.int64)
        for idx_k in by_class:
            if len(idx_k) == 0:
                continue
            idx_k = rng.permutation(idx_k)
            p = rng.dirichlet(np.full(m, alpha))
            if balance:
                p = p * (sizes < n / m)
            if p.sum() <= 0:
                p = rng.dirichlet(np.full(m, alpha))
            cuts = (np.cumsum(p / p.sum()) * len(idx_k)).astype(np.int64)[:-1]
            for j, piece in enumerate(np.split(idx_k, cuts)):
                parts[j].append(piece)
                sizes[j] += len(piece)
        if sizes.min() >= min_size:
            return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts]


@pytest.mark.parametrize(("m", "alpha", "min_size", "balance"), [(7, 0.1, 10, True), (40, 0.5, 5, True),
                                                                  (25, 0.3, 2, False), (120, 1.0, 10, True)])
def test_dirichlet_equals_the_slow_reference_draw_for_draw(m, alpha, min_size, balance):
    labels = np.random.default_rng(5).integers(0, C, 3000)
    spec = {"kind": "dirichlet", "alpha": alpha, "min_size": min_size, "balance": balance}
    for seed in (0, 3):
        got = make_partition(labels, m, spec, seed=seed).indices
        want = slow_dirichlet(labels, m, C, alpha, min_size, balance, seed)
        assert len(got) == m and all(np.array_equal(a, np.sort(b)) for a, b in zip(got, want))


@pytest.mark.parametrize(("kind", "clients", "min_size", "works"), [("dirichlet", 20_000, 1, None),
                                                                      ("dirichlet", 5_000, 5, 1),
                                                                      ("quantity", 20_000, 2, None)])
def test_an_unreachable_min_size_stops_early_and_says_what_would_work(kind, clients, min_size, works):
    import time

    labels = np.random.default_rng(0).integers(0, C, 60_000)  # MNIST's size
    start = time.perf_counter()
    with pytest.raises(PartitionError, match=rf"{kind}\(alpha=0.5\) cannot give every one of {clients} clients "
                                             rf">= {min_size} samples: in 100 draws at least \d+ clients fell short"):
        try:
            make_partition(labels, clients, {"kind": kind, "alpha": 0.5, "min_size": min_size}, seed=0)
        except PartitionError as err:
            assert (f"min_size: {works} works with this seed" in str(err)) if works else "no draw gave" in str(err)
            found = re.search(r"; alpha ([0-9.]+) reached min_size", str(err))
            if kind == "dirichlet":  # a larger alpha that works is named, and works
                spec = {"kind": kind, "alpha": float(found.group(1)), "min_size": min_size}
                assert make_partition(labels, clients, spec, seed=0).sizes.min() >= min_size
            raise
    assert time.perf_counter() - start < 10
    if works:  # the min_size it names does work
        spec = {"kind": kind, "alpha": 0.5, "min_size": works}
        assert make_partition(labels, clients, spec, seed=0).sizes.min() >= works


# ---------------------------------------------------------------------------------- 2c/c


def test_two_classes_per_client_holds_exactly_its_pair():
    labels = LABELS["unbalanced"]
    m = 4
    p = make_partition(labels, m, {"kind": "2c/c"}, seed=0)
    seen: set[int] = set()
    for k, idx in enumerate(p.indices):
        pair = {2 * k, 2 * k + 1}
        assert set(np.unique(labels[idx]).tolist()) == pair
        # All samples of both classes, nothing else.
        np.testing.assert_array_equal(idx, np.flatnonzero(np.isin(labels, list(pair))))
        assert seen.isdisjoint(pair)
        seen |= pair
    # Classes 8 and 9 (beyond 2m) are left out.
    left_out = np.flatnonzero(labels >= 2 * m)
    assert np.intersect1d(np.concatenate(p.indices), left_out).size == 0


def test_two_classes_per_client_ignores_seed():
    labels = LABELS["balanced"]
    a = make_partition(labels, 5, {"kind": "2c/c"}, seed=0)
    b = make_partition(labels, 5, {"kind": "2c/c"}, seed=99)
    for x, y in zip(a.indices, b.indices):
        np.testing.assert_array_equal(x, y)


def test_two_classes_per_client_with_too_many_clients_raises():
    with pytest.raises(PartitionError, match=re.escape("needs 2 x 6 <= 10")):
        make_partition(LABELS["balanced"], 6, {"kind": "2c/c"}, seed=0)


# ------------------------------------------------------------------------------- classes


@pytest.mark.parametrize(("per_client", "m"), [(1, 10), (1, 4), (2, 10), (2, 7), (3, 20), (5, 12), (10, 3)])
def test_classes_each_client_holds_exactly_c_classes(per_client, m):
    labels = LABELS["balanced"]
    p = make_partition(labels, m, {"kind": "classes", "per_client": per_client}, seed=5)
    held = p.counts > 0
    np.testing.assert_array_equal(held.sum(axis=1), per_client)
    for i in range(m):
        assert held[i, i % C], f"client {i} must hold class {i % C}"
    # Each class is split evenly among its holders (sizes differ by at most one).
    for k in range(C):
        holders = p.counts[:, k][held[:, k]]
        if holders.size:
            assert holders.sum() == 500
            assert holders.max() - holders.min() <= 1


def test_classes_one_per_client_is_one_class_each():
    labels = LABELS["balanced"]
    p = make_partition(labels, C, {"kind": "classes", "per_client": 1}, seed=0)
    for i, idx in enumerate(p.indices):
        np.testing.assert_array_equal(np.unique(labels[idx]), [i])
        np.testing.assert_array_equal(idx, np.flatnonzero(labels == i))


def test_classes_with_fewer_clients_than_classes_leaves_undrawn_classes_out():
    labels = LABELS["balanced"]
    p = make_partition(labels, 3, {"kind": "classes", "per_client": 2}, seed=0)
    held = p.counts > 0
    held_classes = np.flatnonzero(held.any(axis=0))
    covered = np.sort(np.concatenate(p.indices))
    np.testing.assert_array_equal(covered, np.flatnonzero(np.isin(labels, held_classes)))
    assert len(held_classes) <= 6


# ------------------------------------------------------------------------------ quantity


def test_quantity_labels_are_balanced_within_big_clients():
    labels = LABELS["balanced"]
    checked = 0
    for seed in range(4):
        p = make_partition(labels, 10, {"kind": "quantity", "alpha": 0.5}, seed=seed)
        for k in np.flatnonzero(p.sizes >= 500):
            assert np.abs(p.counts[k] / p.sizes[k] - 0.1).max() < 0.05
            checked += 1
    assert checked >= 4


def test_quantity_sizes_are_skewed_for_small_alpha_and_even_for_large():
    labels = LABELS["balanced"]
    small = make_partition(labels, 10, {"kind": "quantity", "alpha": 0.3}, seed=0)
    large = make_partition(labels, 10, {"kind": "quantity", "alpha": 1000}, seed=0)
    assert small.sizes.max() / small.sizes.min() > 5
    assert small.sizes.min() >= 10  # default min_size
    assert np.abs(large.sizes / 500 - 1).max() < 0.15


def test_quantity_min_size_is_respected():
    labels = LABELS["balanced"]
    for seed in range(3):
        p = make_partition(labels, 10, {"kind": "quantity", "alpha": 1.0, "min_size": 150}, seed=seed)
        assert p.sizes.min() >= 150


def test_quantity_that_cannot_meet_min_size_raises(monkeypatch):
    monkeypatch.setattr(partition_mod, "MAX_RESAMPLES", 50)
    labels = np.repeat(np.arange(C), 10)
    with pytest.raises(PartitionError, match=r"quantity\(alpha=0\.01\) cannot give every one of 10 clients"):
        make_partition(labels, 10, {"kind": "quantity", "alpha": 0.01, "min_size": 10}, seed=0)


# --------------------------------------------------------------------------- determinism


SEEDED_SPECS = [
    ({"kind": "iid"}, 10),
    ({"kind": "dirichlet", "alpha": 0.5}, 10),
    ({"kind": "dirichlet", "alpha": 0.5, "min_size": "half"}, 10),
    ({"kind": "quantity", "alpha": 0.5}, 10),
    ({"kind": "classes", "per_client": 2}, 10),
    ({"kind": "feddf_dirichlet", "alpha": 0.5}, 10),
]


@pytest.mark.parametrize("case", SEEDED_SPECS, ids=[_id(c) for c in SEEDED_SPECS])
def test_same_seed_same_partition_different_seed_different(case):
    spec, m = case
    labels = LABELS["balanced"]
    a = make_partition(labels, m, dict(spec), seed=11)
    b = make_partition(labels.copy(), m, dict(spec), seed=11)
    c = make_partition(labels, m, dict(spec), seed=12)
    assert all(np.array_equal(x, y) for x, y in zip(a.indices, b.indices))
    np.testing.assert_array_equal(a.counts, b.counts)
    assert not all(np.array_equal(x, z) for x, z in zip(a.indices, c.indices))


def test_partition_does_not_touch_global_numpy_rng():
    np.random.seed(0)
    before = np.random.random()
    np.random.seed(0)
    make_partition(LABELS["balanced"], 10, {"kind": "dirichlet", "alpha": 0.5}, seed=0)
    assert np.random.random() == before


# -------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kind", ["dirichlet", "quantity", "feddf_dirichlet"])
@pytest.mark.parametrize("alpha", [0, -1, 0.0, float("nan"), float("inf")])
def test_non_positive_or_non_finite_alpha_raises(kind, alpha):
    with pytest.raises(PartitionError, match="'alpha' must be a number > 0"):
        make_partition(LABELS["balanced"], 10, {"kind": kind, "alpha": alpha}, seed=0)


@pytest.mark.parametrize("kind", ["dirichlet", "quantity", "feddf_dirichlet"])
def test_missing_alpha_raises(kind):
    with pytest.raises(PartitionError, match=f"partition kind '{kind}' needs 'alpha'"):
        make_partition(LABELS["balanced"], 10, {"kind": kind}, seed=0)


@pytest.mark.parametrize(
    "spec",
    [{"kind": "iid"}, {"kind": "dirichlet", "alpha": 1.0, "min_size": 0}, {"kind": "classes", "per_client": 1}],
)
def test_more_clients_than_samples_raises(spec):
    labels = np.array([0, 1, 0, 1, 2])
    with pytest.raises(PartitionError, match="6 clients but only 5 training samples"):
        make_partition(labels, 6, spec, seed=0)


def test_zero_clients_raises():
    with pytest.raises(PartitionError, match="clients must be a positive integer"):
        make_partition(LABELS["balanced"], 0, {"kind": "iid"}, seed=0)


def test_classes_per_client_above_num_classes_raises():
    with pytest.raises(PartitionError, match=re.escape("classes(per_client=11) needs 1 <= C <= 10")):
        make_partition(LABELS["balanced"], 10, {"kind": "classes", "per_client": 11}, seed=0)


@pytest.mark.parametrize("per_client", [0, -1])
def test_classes_per_client_below_one_raises(per_client):
    with pytest.raises(PartitionError, match=rf"per_client.*{per_client}"):
        make_partition(LABELS["balanced"], 10, {"kind": "classes", "per_client": per_client}, seed=0)


def test_classes_without_per_client_raises():
    with pytest.raises(PartitionError, match="per_client"):
        make_partition(LABELS["balanced"], 10, {"kind": "classes"}, seed=0)


@pytest.mark.parametrize("kind", ["dirichlet", "quantity"])
def test_impossible_min_size_raises(kind):
    labels = LABELS["balanced"]  # N = 5000
    with pytest.raises(PartitionError, match=re.escape("min_size=501 is impossible: 10 clients x 501 > 5000 samples")):
        make_partition(labels, 10, {"kind": kind, "alpha": 1.0, "min_size": 501}, seed=0)


def test_min_size_equal_to_the_average_is_allowed():
    # clients x min_size == N is not "impossible" (only > N is); balanced dirichlet with a tiny
    # alpha then hands each client one whole class.
    labels = np.repeat(np.arange(C), 10)
    p = make_partition(labels, 10, {"kind": "dirichlet", "alpha": 0.01, "min_size": 10}, seed=0)
    np.testing.assert_array_equal(p.sizes, 10)


def test_negative_min_size_raises():
    with pytest.raises(PartitionError, match=r"min_size must be .*'half', got -1"):
        make_partition(LABELS["balanced"], 10, {"kind": "dirichlet", "alpha": 1.0, "min_size": -1}, seed=0)


@pytest.mark.parametrize("spec", [{"kind": "nope"}, {"kind": "IID"}, {}, {"alpha": 1.0}])
def test_unknown_kind_lists_valid_kinds(spec):
    with pytest.raises(PartitionError, match="unknown partition kind") as info:
        make_partition(LABELS["balanced"], 10, spec, seed=0)
    message = str(info.value)
    for kind in PARTITION_KINDS:
        assert kind in message
    assert ", ".join(PARTITION_KINDS) in message


@pytest.mark.parametrize(
    ("spec", "extra"),
    [
        ({"kind": "iid", "alpha": 1}, "['alpha']"),
        ({"kind": "2c/c", "per_client": 2}, "['per_client']"),
        ({"kind": "classes", "per_client": 2, "alpha": 1.0}, "['alpha']"),
        ({"kind": "quantity", "alpha": 1.0, "balance": True}, "['balance']"),
        ({"kind": "dirichlet", "alpha": 1.0, "seed": 3, "beta": 2}, "['beta', 'seed']"),
    ],
)
def test_extra_keys_raise(spec, extra):
    with pytest.raises(PartitionError, match=re.escape(f"partition '{spec['kind']}' does not take {extra}")):
        make_partition(LABELS["balanced"], 5, spec, seed=0)


def test_partition_error_is_a_value_error():
    assert issubclass(PartitionError, ValueError)


@pytest.mark.parametrize(
    "labels",
    [np.array([], dtype=np.int64), np.array([-1, 0, 1, 1])],
    ids=["empty", "negative"],
)
def test_invalid_label_arrays_raise_partition_error(labels):
    with pytest.raises(PartitionError):
        make_partition(labels, 1, {"kind": "iid"}, seed=0)


# --------------------------------------------------------------------------------- stats


def test_stats_is_json_serialisable_and_matches_counts():
    p = make_partition(LABELS["unbalanced"], 6, {"kind": "dirichlet", "alpha": 0.5}, seed=0)
    stats = p.stats()
    assert set(stats) == {"num_classes", "counts"}
    assert stats["num_classes"] == C
    assert isinstance(stats["counts"], list)
    assert all(isinstance(row, list) and len(row) == C for row in stats["counts"])
    assert all(type(v) is int for row in stats["counts"] for v in row)
    assert stats["counts"] == p.counts.tolist()
    round_trip = json.loads(json.dumps(stats))
    assert round_trip == stats
    assert sum(map(sum, round_trip["counts"])) == len(LABELS["unbalanced"])
