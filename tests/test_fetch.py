"""hetfl.data.fetch without the network: IDX writing, the MNIST pickle conversion, dispatch."""

from __future__ import annotations

import gzip
import hashlib
import pickle
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfl.cli import main
from hetfl.data import fetch as fetch_mod
from hetfl.data.fetch import (
    IDX_FILES,
    FetchError,
    convert_mnist_pickle,
    fetch,
    fetch_fmnist,
    fetch_mnist,
    sha256,
    write_idx,
)
from hetfl.data.formats import read_idx
from hetfl.data.loaders import load_fmnist, load_mnist


def _pixels(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 28, 28), dtype=np.uint8)


@pytest.fixture
def no_subprocess(monkeypatch):
    """Fail the test if anything tries to run a command (apt-get, dpkg-deb, pip)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"subprocess.run called: {args} {kwargs}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(fetch_mod.subprocess, "run", refuse)


# ------------------------------------------------------------------------------ write_idx


def test_write_idx_header_and_payload(tmp_path):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / "a.gz"
    write_idx(path, array)
    raw = gzip.decompress(path.read_bytes())
    assert raw[:4] == bytes([0, 0, 0x08, 3])
    assert struct.unpack(">3I", raw[4:16]) == (2, 3, 4)
    assert raw[16:] == array.tobytes()
    np.testing.assert_array_equal(read_idx(path), array)


def test_write_idx_one_dimensional_and_casts_to_uint8(tmp_path):
    labels = np.array([0, 9, 3, 255], dtype=np.int64)
    path = tmp_path / "labels.gz"
    write_idx(path, labels)
    raw = gzip.decompress(path.read_bytes())
    assert raw[:8] == bytes([0, 0, 0x08, 1]) + struct.pack(">I", 4)
    back = read_idx(path)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, labels)


def test_write_idx_then_load_mnist_round_trip(tmp_path):
    folder = tmp_path / "mnist"
    folder.mkdir()
    x_train, x_test = _pixels(7, seed=0), _pixels(5, seed=1)
    y_train = np.array([0, 1, 2, 3, 9, 8, 7], dtype=np.uint8)
    y_test = np.array([5, 5, 0, 9, 1], dtype=np.uint8)
    write_idx(folder / "train-images-idx3-ubyte.gz", x_train)
    write_idx(folder / "train-labels-idx1-ubyte.gz", y_train)
    write_idx(folder / "t10k-images-idx3-ubyte.gz", x_test)
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", y_test)

    splits = load_mnist(tmp_path)
    assert splits.train.x.dtype == torch.uint8
    assert splits.train.y.dtype == torch.int64
    assert tuple(splits.train.x.shape) == (7, 1, 28, 28)
    assert tuple(splits.test.x.shape) == (5, 1, 28, 28)
    np.testing.assert_array_equal(splits.train.x[:, 0].numpy(), x_train)
    np.testing.assert_array_equal(splits.test.x[:, 0].numpy(), x_test)
    np.testing.assert_array_equal(splits.train.y.numpy(), y_train)
    np.testing.assert_array_equal(splits.test.y.numpy(), y_test)
    assert splits.num_classes == 10


# -------------------------------------------------------------------- convert_mnist_pickle


def _fake_classic_pickle(path: Path, sizes=(6, 4, 3), seed: int = 0, scale: float = 256.0):
    """A gzip pickle shaped like the classic mnist.pkl.gz; returns the integer pixels k and labels."""
    rng = np.random.default_rng(seed)
    ks, ys, parts = [], [], []
    for n in sizes:
        k = rng.integers(0, 256, size=(n, 784))
        k[0, :256] = np.arange(256)  # every value 0..255 appears
        y = rng.integers(0, 10, size=n).astype(np.int64)
        ks.append(k.astype(np.uint8))
        ys.append(y)
        parts.append(((k / scale).astype(np.float32), y))
    with gzip.open(path, "wb") as f:
        pickle.dump(tuple(parts), f, protocol=2)
    return ks, ys


def test_convert_mnist_pickle_exact_values_and_train_valid_concatenation(tmp_path):
    pkl = tmp_path / "mnist.pkl.gz"
    (k_tr, k_va, k_te), (y_tr, y_va, y_te) = _fake_classic_pickle(pkl)
    target = tmp_path / "root" / "mnist"
    convert_mnist_pickle(pkl, target)

    assert sorted(p.name for p in target.iterdir()) == sorted(IDX_FILES)
    train_x = read_idx(target / "train-images-idx3-ubyte.gz")
    train_y = read_idx(target / "train-labels-idx1-ubyte.gz")
    test_x = read_idx(target / "t10k-images-idx3-ubyte.gz")
    test_y = read_idx(target / "t10k-labels-idx1-ubyte.gz")
    assert train_x.dtype == np.uint8 and train_x.shape == (10, 28, 28)
    assert test_x.shape == (3, 28, 28)
    # train = train then valid, in order; pixels are exactly k.
    np.testing.assert_array_equal(train_x, np.concatenate([k_tr, k_va]).reshape(-1, 28, 28))
    np.testing.assert_array_equal(train_y, np.concatenate([y_tr, y_va]))
    np.testing.assert_array_equal(test_x, k_te.reshape(-1, 28, 28))
    np.testing.assert_array_equal(test_y, y_te)

    # And the result is what load_mnist reads.
    splits = load_mnist(tmp_path / "root")
    np.testing.assert_array_equal(splits.train.x[:, 0].numpy(), train_x)
    np.testing.assert_array_equal(splits.test.y.numpy(), y_te)


def test_convert_mnist_pickle_rejects_values_not_multiples_of_1_256(tmp_path):
    pkl = tmp_path / "bad.pkl.gz"
    _fake_classic_pickle(pkl, scale=255.0)  # k/255 is not k'/256 for most k
    with pytest.raises(FetchError, match="not k/256"):
        convert_mnist_pickle(pkl, tmp_path / "out")


def test_convert_mnist_pickle_rejects_a_single_off_grid_value(tmp_path):
    rng = np.random.default_rng(0)
    parts = []
    for n in (2, 2, 2):
        parts.append(((rng.integers(0, 256, (n, 784)) / 256).astype(np.float32), np.zeros(n, np.int64)))
    parts[2][0][1, 100] = 0.5 / 256  # halfway between two grid points, in the test split
    pkl = tmp_path / "one-off.pkl.gz"
    with gzip.open(pkl, "wb") as f:
        pickle.dump(tuple(parts), f)
    with pytest.raises(FetchError, match="not k/256"):
        convert_mnist_pickle(pkl, tmp_path / "out")


@pytest.mark.parametrize("value", [1.0, -1 / 256])
def test_convert_mnist_pickle_rejects_out_of_range_values(tmp_path, value):
    parts = [(np.zeros((1, 784), np.float32), np.zeros(1, np.int64)) for _ in range(3)]
    parts[0][0][0, 0] = value  # 256/256 does not fit a uint8; negatives are not pixels
    pkl = tmp_path / "range.pkl.gz"
    with gzip.open(pkl, "wb") as f:
        pickle.dump(tuple(parts), f)
    with pytest.raises(FetchError, match="not k/256"):
        convert_mnist_pickle(pkl, tmp_path / "out")


# ----------------------------------------------------------------------------------- sha256


def test_sha256_matches_hashlib(tmp_path):
    small = tmp_path / "small.bin"
    small.write_bytes(b"hetfl\n" * 10)
    assert sha256(small) == hashlib.sha256(b"hetfl\n" * 10).hexdigest()

    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert sha256(empty) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

    # Larger than the 1 MiB read chunk, not a multiple of it.
    big = tmp_path / "big.bin"
    payload = np.random.default_rng(0).integers(0, 256, size=(5 << 19) + 17, dtype=np.uint8).tobytes()
    big.write_bytes(payload)
    assert sha256(big) == hashlib.sha256(payload).hexdigest()


# ----------------------------------------------------------------------- fetchers/dispatch


def _write_complete(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True)
    contents = {}
    for name in IDX_FILES:
        contents[name] = gzip.compress(f"placeholder {name}".encode(), mtime=0)
        (folder / name).write_bytes(contents[name])
    return contents


def _trust(monkeypatch, dataset: str, folder: Path) -> None:
    """Make the files in ``folder`` the known-good content of ``dataset``."""
    sums = {name.removesuffix(".gz"): fetch_mod.content_sha256(folder / name) for name in IDX_FILES}
    monkeypatch.setitem(fetch_mod.CONTENT_SHA256, dataset, sums)


def test_fetch_fmnist_with_files_present_does_nothing(tmp_path, no_subprocess, monkeypatch):
    monkeypatch.setattr(fetch_mod, "FMNIST_SYSTEM_DIR", tmp_path / "no-such-system-dir")
    before = _write_complete(tmp_path / "fashion-mnist")
    _trust(monkeypatch, "fmnist", tmp_path / "fashion-mnist")
    messages: list[str] = []
    out = fetch_fmnist(tmp_path, log=messages.append)
    assert out == tmp_path / "fashion-mnist"
    assert len(messages) == 1 and "already" in messages[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_fetch_mnist_with_files_present_does_nothing(tmp_path, no_subprocess, monkeypatch):
    before = _write_complete(tmp_path / "mnist")
    _trust(monkeypatch, "mnist", tmp_path / "mnist")
    messages: list[str] = []
    out = fetch_mnist(tmp_path, log=messages.append)
    assert out == tmp_path / "mnist"
    assert len(messages) == 1 and "already" in messages[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_fetch_fmnist_copies_and_verifies_from_a_system_folder(tmp_path, no_subprocess, monkeypatch):
    system = tmp_path / "system"
    _write_complete(system)
    sums = {name: sha256(system / name) for name in IDX_FILES}
    monkeypatch.setattr(fetch_mod, "FMNIST_SYSTEM_DIR", system)
    monkeypatch.setattr(fetch_mod, "FMNIST_SHA256", sums)
    _trust(monkeypatch, "fmnist", system)
    out = fetch_fmnist(tmp_path / "root", log=lambda _: None)
    assert out == tmp_path / "root" / "fashion-mnist"
    for name in IDX_FILES:
        assert (out / name).read_bytes() == (system / name).read_bytes()


def test_fetch_fmnist_rejects_a_bad_checksum(tmp_path, no_subprocess, monkeypatch):
    system = tmp_path / "system"
    _write_complete(system)
    monkeypatch.setattr(fetch_mod, "FMNIST_SYSTEM_DIR", system)  # real checksums: will not match
    with pytest.raises(FetchError, match="sha256"):
        fetch_fmnist(tmp_path / "root", log=lambda _: None)


def test_fetched_fmnist_layout_is_what_load_fmnist_reads(tmp_path, no_subprocess, monkeypatch):
    system = tmp_path / "system"
    system.mkdir()
    x, y = _pixels(3, seed=5), np.array([0, 4, 9], np.uint8)
    for name, arr in zip(IDX_FILES, (x, y, x[:2], y[:2])):
        write_idx(system / name, arr)
    monkeypatch.setattr(fetch_mod, "FMNIST_SYSTEM_DIR", system)
    monkeypatch.setattr(fetch_mod, "FMNIST_SHA256", {n: sha256(system / n) for n in IDX_FILES})
    _trust(monkeypatch, "fmnist", system)
    fetch(["fmnist"], tmp_path / "root", log=lambda _: None)
    splits = load_fmnist(tmp_path / "root")
    np.testing.assert_array_equal(splits.train.x[:, 0].numpy(), x)
    np.testing.assert_array_equal(splits.test.y.numpy(), y[:2])


def test_damaged_files_are_caught_by_verify_and_fetched_again(tmp_path, no_subprocess, monkeypatch):
    system = tmp_path / "system"
    good = _write_complete(system)
    monkeypatch.setattr(fetch_mod, "FMNIST_SYSTEM_DIR", system)
    monkeypatch.setattr(fetch_mod, "FMNIST_SHA256", {n: sha256(system / n) for n in IDX_FILES})
    _trust(monkeypatch, "fmnist", system)
    out = fetch_fmnist(tmp_path, log=lambda _: None)
    assert fetch_mod.verify("fmnist", tmp_path) == []
    raw = out / "t10k-images-idx3-ubyte"  # a plain IDX file beside the .gz, one pixel byte flipped
    content = bytearray(gzip.decompress(good["t10k-images-idx3-ubyte.gz"]))
    content[-1] ^= 1
    raw.write_bytes(bytes(content))
    (out / "train-labels-idx1-ubyte.gz").write_bytes(b"not gzip")
    problems = fetch_mod.verify("fmnist", tmp_path)
    assert len(problems) == 2 and any("t10k-images-idx3-ubyte: sha256 of its content is" in p for p in problems)
    assert any("train-labels-idx1-ubyte.gz: unreadable" in p for p in problems)
    messages: list[str] = []
    fetch(["fmnist"], tmp_path, log=messages.append)  # names the damage, removes it, fetches again
    assert any("fetching again" in m for m in messages) and not raw.exists()
    assert fetch_mod.verify("fmnist", tmp_path) == []
    assert main(["data", "verify", "fmnist", "--root", str(tmp_path)]) == 0
    raw.write_bytes(bytes(content))
    assert main(["data", "verify", "fmnist", "--root", str(tmp_path)]) == 1


@pytest.mark.parametrize("names", [["cifar10"], ["mnist", "cifar10"], ["svhn", "emnist"]])
def test_fetch_unknown_dataset_raises_naming_what_can_be_fetched(tmp_path, names, monkeypatch):
    called = []
    monkeypatch.setitem(fetch_mod.FETCHERS, "mnist", lambda root, log: called.append(root))
    with pytest.raises(FetchError, match="cannot fetch") as info:
        fetch(names, tmp_path)
    message = str(info.value)
    assert "['fmnist', 'mnist']" in message
    for name in names:
        if name != "mnist":
            assert name in message
    assert called == [], "nothing is fetched when any name is unknown"


def test_fetch_dispatches_in_order(tmp_path, monkeypatch):
    calls = []

    def fake(name):
        def run(root, log):
            calls.append((name, root))
            return root / name

        return run

    monkeypatch.setitem(fetch_mod.FETCHERS, "mnist", fake("mnist"))
    monkeypatch.setitem(fetch_mod.FETCHERS, "fmnist", fake("fmnist"))
    out = fetch(["fmnist", "mnist"], str(tmp_path))
    assert out == [tmp_path / "fmnist", tmp_path / "mnist"]
    assert calls == [("fmnist", tmp_path), ("mnist", tmp_path)]
