"""Dataset loaders on tiny files written in each dataset's real on-disk format."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
from PIL import Image

from hetfl.data import formats
from hetfl.data.base import DataFormatError
from hetfl.data.loaders import (
    EMNIST_SPLITS,
    FMNIST_CLASSES,
    LOADERS,
    load_cifar10,
    load_cifar100,
    load_cinic10,
    load_emnist,
    load_fmnist,
    load_mnist,
    load_svhn,
    load_tinyimagenet,
)

N_TRAIN, N_TEST = 6, 4


def _pixels(n: int, *shape: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, *shape), dtype=np.uint8)


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    """An IDX ubyte file written by hand: 0x0000, type 0x08, ndim, big-endian dims, data."""
    raw = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    raw += struct.pack(f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        raw = gzip.compress(raw)
    path.write_bytes(raw)
    return path


def write_mnist_like(folder: Path, prefix: str = "", names: dict | None = None) -> dict:
    """Train/test IDX files (train gzipped, test plain); returns the arrays written."""
    folder.mkdir(parents=True, exist_ok=True)
    names = names or {
        "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
    }
    arrays = {}
    for seed, (part, n) in enumerate([("train", N_TRAIN), ("test", N_TEST)]):
        x = _pixels(n, 28, 28, seed=seed)
        y = np.arange(n, dtype=np.uint8) % 10
        write_idx(folder / names[part][0], x, gz=part == "train")
        write_idx(folder / names[part][1], y, gz=part == "train")
        arrays[part] = (x, y)
    return arrays


# ------------------------------------------------------------------------------ IDX family


@pytest.mark.parametrize(("loader", "sub"), [(load_mnist, "mnist"), (load_fmnist, "fashion-mnist")])
def test_mnist_like(tmp_path: Path, loader, sub: str) -> None:
    arrays = write_mnist_like(tmp_path / sub)
    splits = loader(tmp_path)
    for part, ds in (("train", splits.train), ("test", splits.test)):
        x, y = arrays[part]
        assert ds.x.shape == (len(x), 1, 28, 28) and ds.x.dtype == torch.uint8
        assert ds.y.dtype == torch.int64 and ds.y.tolist() == y.tolist()
        assert ds.num_classes == 10
        assert int(ds.x[1, 0, 3, 17]) == x[1, 3, 17]
        assert torch.equal(ds.x[:, 0], torch.from_numpy(x))
    if sub == "fashion-mnist":
        assert splits.train.class_names == FMNIST_CLASSES and splits.train.name == "fmnist"


def test_emnist_transpose_and_letters(tmp_path: Path) -> None:
    folder = tmp_path / "emnist"
    folder.mkdir()
    for part, n in (("train", N_TRAIN), ("test", N_TEST)):
        x = np.zeros((n, 28, 28), dtype=np.uint8)
        x[0, 2, 5] = 200  # stored row 2, column 5 -> upright row 5, column 2
        write_idx(folder / f"emnist-letters-{part}-images-idx3-ubyte", x, gz=True)
        write_idx(folder / f"emnist-letters-{part}-labels-idx1-ubyte", np.arange(1, n + 1))
        write_idx(folder / f"emnist-digits-{part}-images-idx3-ubyte", x)
        write_idx(folder / f"emnist-digits-{part}-labels-idx1-ubyte", np.arange(n))
    letters = load_emnist(tmp_path, split="letters")
    assert letters.num_classes == 26 and letters.train.class_names[0] == "A"
    assert letters.train.y.tolist() == list(range(N_TRAIN))  # 1..26 shifted to 0..25
    assert letters.train.x.shape == (N_TRAIN, 1, 28, 28)
    assert int(letters.train.x[0, 0, 5, 2]) == 200 and int(letters.train.x[0, 0, 2, 5]) == 0
    assert int(letters.test.x[0, 0, 5, 2]) == 200
    digits = load_emnist(tmp_path, split="digits")
    assert digits.num_classes == 10 and digits.test.y.tolist() == list(range(N_TEST))
    assert {k: len(v) for k, v in EMNIST_SPLITS.items()} == {
        "balanced": 47, "byclass": 62, "bymerge": 47, "digits": 10, "mnist": 10, "letters": 26,
    }  # fmt: skip
    with pytest.raises(ValueError, match="balanced"):
        load_emnist(tmp_path, split="nope")


def test_read_idx_other_dtype_and_gzip_by_magic(tmp_path: Path) -> None:
    values = np.array([[1, -2, 300], [70000, 5, -6]], dtype=">i4")
    raw = struct.pack(">BBBB", 0, 0, 0x0C, 2) + struct.pack(">2I", 2, 3) + values.tobytes()
    path = tmp_path / "ints.idx"  # gzipped, but without the .gz suffix
    path.write_bytes(gzip.compress(raw))
    out = formats.read_idx(path)
    assert out.dtype == np.int32 and out.tolist() == values.tolist()


def test_idx_errors(tmp_path: Path) -> None:
    arrays = write_mnist_like(tmp_path / "mnist")
    x, _ = arrays["test"]
    images = tmp_path / "mnist" / "t10k-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-10])
    with pytest.raises(DataFormatError, match="t10k-images-idx3-ubyte.*truncated"):
        load_mnist(tmp_path)
    images.write_bytes(b"\x01\x02\x08\x03" + images.read_bytes()[4:])
    with pytest.raises(DataFormatError, match="t10k-images-idx3-ubyte.*magic"):
        load_mnist(tmp_path)
    images.unlink()
    with pytest.raises(DataFormatError, match="t10k-images-idx3-ubyte.*not found"):
        load_mnist(tmp_path)
    write_idx(images, x[:3])  # 3 images but 4 labels
    with pytest.raises(DataFormatError, match="4 labels but"):
        load_mnist(tmp_path)
    bad_gz = tmp_path / "bad.gz"
    bad_gz.write_bytes(gzip.compress(b"\0\0\x08\x01" + b"\0" * 50)[:20])
    with pytest.raises(DataFormatError, match="bad.gz.*gzip"):
        formats.read_idx(bad_gz)


def test_missing_folder_names_path_and_layout(tmp_path: Path) -> None:
    for name, loader in LOADERS.items():
        with pytest.raises(DataFormatError) as info:
            loader(tmp_path)
        message = str(info.value)
        assert str(tmp_path) in message and "Expected layout" in message, name
    with pytest.raises(DataFormatError, match="cifar-10-batches-py/data_batch_1 exists"):
        load_cifar10(tmp_path)


# ------------------------------------------------------------------------------------ CIFAR


def write_cifar_batch(path: Path, x: np.ndarray, labels: list[int], key: bytes) -> None:
    batch = {b"data": x.reshape(len(x), -1), key: labels, b"batch_label": b"test"}
    path.write_bytes(pickle.dumps(batch))


def test_cifar10(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i in range(1, 6):
        x = np.zeros((2, 3 * 32 * 32), dtype=np.uint8)
        x[0, 1024 + 5 * 32 + 7] = i  # green channel, row 5, column 7
        x[1, 2 * 1024] = 100 + i  # blue channel, row 0, column 0
        write_cifar_batch(folder / f"data_batch_{i}", x, [i, 9 - i], b"labels")
    write_cifar_batch(folder / "test_batch", _pixels(N_TEST, 3, 32, 32, seed=3), [3] * 4, b"labels")
    names = [f"c{i}" for i in range(10)]
    (folder / "batches.meta").write_bytes(
        pickle.dumps({b"label_names": [n.encode() for n in names]})
    )
    splits = load_cifar10(tmp_path)
    train = splits.train
    assert train.x.shape == (10, 3, 32, 32) and train.x.dtype == torch.uint8
    assert train.y.tolist() == [1, 8, 2, 7, 3, 6, 4, 5, 5, 4]
    assert [int(train.x[2 * k, 1, 5, 7]) for k in range(5)] == [1, 2, 3, 4, 5]
    assert int(train.x[0, 0, 5, 7]) == 0 and int(train.x[9, 2, 0, 0]) == 105
    assert splits.test.x.shape == (N_TEST, 3, 32, 32) and splits.test.y.tolist() == [3] * 4
    assert train.num_classes == 10 and train.class_names == names and train.name == "cifar10"


def test_cifar100_and_missing_keys(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    x = _pixels(N_TRAIN, 3, 32, 32, seed=4)
    write_cifar_batch(folder / "train", x, [0, 99, 5, 6, 7, 42], b"fine_labels")
    write_cifar_batch(folder / "test", x[:N_TEST], [1, 2, 3, 4], b"fine_labels")
    splits = load_cifar100(tmp_path)
    assert splits.num_classes == 100 and splits.train.y.tolist() == [0, 99, 5, 6, 7, 42]
    assert torch.equal(splits.train.x, torch.from_numpy(x))
    assert int(splits.test.x[3, 2, 31, 30]) == x[3, 2, 31, 30]

    (folder / "test").write_bytes(pickle.dumps({b"data": x.reshape(N_TRAIN, -1)}))
    with pytest.raises(DataFormatError, match=r"test: missing key.*fine_labels"):
        load_cifar100(tmp_path)
    (folder / "test").write_bytes(b"not a pickle at all")
    with pytest.raises(DataFormatError, match="test: not a readable pickle"):
        load_cifar100(tmp_path)
    write_cifar_batch(folder / "test", x, [1, 2], b"fine_labels")
    with pytest.raises(DataFormatError, match="6 images but 2 labels"):
        load_cifar100(tmp_path)


# ------------------------------------------------------------------------------------- SVHN


def test_svhn(tmp_path: Path) -> None:
    folder = tmp_path / "svhn"
    folder.mkdir()
    for part, n in (("train", N_TRAIN), ("test", N_TEST)):
        X = np.zeros((32, 32, 3, n), dtype=np.uint8)
        X[3, 4, 2, 1] = 250  # row 3, column 4, blue, image 1
        X[0, 31, 0, 0] = 7
        y = (np.arange(n) % 10 + 1).reshape(n, 1).astype(np.uint8)  # 1..n, 10 means 0
        y[0] = 10
        scipy.io.savemat(folder / f"{part}_32x32.mat", {"X": X, "y": y})
    splits = load_svhn(tmp_path)
    assert splits.train.x.shape == (N_TRAIN, 3, 32, 32) and splits.train.x.dtype == torch.uint8
    assert splits.train.y.tolist() == [0, 2, 3, 4, 5, 6] and splits.test.y.tolist() == [0, 2, 3, 4]
    assert int(splits.train.x[1, 2, 3, 4]) == 250 and int(splits.test.x[0, 0, 0, 31]) == 7
    assert int(splits.train.x.sum()) == 257 and splits.num_classes == 10

    scipy.io.savemat(folder / "test_32x32.mat", {"X": np.zeros((32, 32, 3, 2), np.uint8)})
    with pytest.raises(DataFormatError, match=r"test_32x32.mat: missing variable.*'y'"):
        load_svhn(tmp_path)


# ---------------------------------------------------------------------------- image folders


def write_png(path: Path, value: tuple[int, int, int], size: tuple[int, int] = (32, 32)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    image[...] = value
    image[1, 2] = (value[0] ^ 255, 17, 33)  # row 1, column 2 differs
    Image.fromarray(image).save(path)


CINIC_CLASSES = ["airplane", "cat", "dog"]


def write_cinic(root: Path) -> None:
    for part, per_class in (("train", 2), ("test", 1), ("valid", 1)):
        for c, name in enumerate(CINIC_CLASSES):
            for k in range(per_class):
                value = (10 * c + k, 100 + k, {"train": 1, "test": 2, "valid": 3}[part])
                write_png(root / "cinic-10" / part / name / f"img{k}.png", value)


def test_cinic10_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_cinic(tmp_path)
    (tmp_path / "cinic-10" / "train" / "cat" / "notes.txt").write_text("ignored")
    splits = load_cinic10(tmp_path)
    train = splits.train
    assert train.x.shape == (6, 3, 32, 32) and train.x.dtype == torch.uint8
    assert train.y.tolist() == [0, 0, 1, 1, 2, 2] and splits.test.y.tolist() == [0, 1, 2]
    assert train.class_names == CINIC_CLASSES and train.num_classes == 3
    assert train.x[3, :, 0, 0].tolist() == [11, 101, 1]  # cat/img1.png
    assert train.x[3, :, 1, 2].tolist() == [11 ^ 255, 17, 33]
    assert splits.test.x[2, :, 5, 5].tolist() == [20, 100, 2]

    cache = tmp_path / "cinic-10" / ".hetfl-cache-train.npz"
    assert cache.is_file() and (tmp_path / "cinic-10" / ".hetfl-cache-test.npz").is_file()

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded an image although the cache is valid")

    with monkeypatch.context() as m:
        m.setattr(formats, "_decode", no_decoding)
        again = load_cinic10(tmp_path)
    assert torch.equal(again.train.x, train.x) and torch.equal(again.train.y, train.y)
    assert torch.equal(again.test.x, splits.test.x)

    # A new file invalidates the cache; the valid split is merged on request.
    write_png(tmp_path / "cinic-10" / "train" / "dog" / "img9.png", (1, 2, 3))
    merged = load_cinic10(tmp_path, include_valid=True)
    assert len(merged.train) == 7 + 3 and merged.train.y.tolist()[-3:] == [0, 1, 2]
    assert merged.train.x[-1, :, 0, 0].tolist() == [20, 100, 3]
    with np.load(cache) as z:
        assert int(z["n_files"]) == 7


def test_image_folder_unwritable_cache_is_skipped(tmp_path: Path) -> None:
    write_cinic(tmp_path)
    blocker = tmp_path / "cinic-10" / ".hetfl-cache-train.npz"
    blocker.mkdir()  # neither readable nor replaceable as a file
    first = load_cinic10(tmp_path)
    second = load_cinic10(tmp_path)
    assert torch.equal(first.train.x, second.train.x) and blocker.is_dir()
    assert not list(blocker.parent.glob("*.tmp-*"))


def test_image_folder_errors(tmp_path: Path) -> None:
    write_png(tmp_path / "data" / "a" / "0.png", (1, 2, 3))
    write_png(tmp_path / "data" / "b" / "1.png", (1, 2, 3), size=(16, 32))
    with pytest.raises(DataFormatError, match=r"1.png: image is 16x32 but 0.png is 32x32"):
        formats.read_image_folder(tmp_path / "data")
    (tmp_path / "data" / "b" / "1.png").write_bytes(b"garbage")
    with pytest.raises(DataFormatError, match=r"1.png: cannot decode image"):
        formats.read_image_folder(tmp_path / "data", cache=False)
    with pytest.raises(DataFormatError, match="folder not found"):
        formats.read_image_folder(tmp_path / "nothing")
    write_cinic(tmp_path)
    write_png(tmp_path / "cinic-10" / "test" / "cat" / "odd.png", (0, 0, 0), size=(30, 32))
    with pytest.raises(DataFormatError, match=r"odd.png: image is 30x32"):
        load_cinic10(tmp_path)


def test_tinyimagenet(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-imagenet-200"
    wnids = ["n02", "n01", "n03"]  # file order is not the class order: classes are sorted
    (folder / "val" / "images").mkdir(parents=True)
    (folder / "wnids.txt").write_text("\n".join(wnids) + "\n")
    colours = {"n01": (200, 30, 30), "n02": (30, 200, 30), "n03": (30, 30, 200)}
    for wnid in wnids:
        for k in range(2):
            path = folder / "train" / wnid / "images" / f"{wnid}_{k}.JPEG"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (64, 64), colours[wnid]).save(path, quality=95)
        (folder / "train" / wnid / f"{wnid}_boxes.txt").write_text("box\n")
    rows = []
    for k, wnid in enumerate(["n03", "n01", "n01", "n02"]):
        Image.new("L" if k == 0 else "RGB", (64, 64), 128 if k == 0 else colours[wnid]).save(
            folder / "val" / "images" / f"val_{k}.JPEG"
        )
        rows.append(f"val_{k}.JPEG\t{wnid}\t0\t0\t63\t63")
    (folder / "val" / "val_annotations.txt").write_text("\n".join(rows) + "\n")

    splits = load_tinyimagenet(tmp_path)
    assert splits.train.x.shape == (6, 3, 64, 64) and splits.test.x.shape == (4, 3, 64, 64)
    assert splits.train.y.tolist() == [0, 0, 1, 1, 2, 2]
    assert splits.test.y.tolist() == [2, 0, 0, 1]
    assert splits.train.class_names == ["n01", "n02", "n03"] and splits.num_classes == 3
    assert np.allclose(splits.train.x[2, :, 10, 10].numpy(), colours["n02"], atol=6)
    assert np.allclose(splits.test.x[1, :, 63, 0].numpy(), colours["n01"], atol=6)
    assert np.allclose(splits.test.x[0, :, 5, 5].numpy(), 128, atol=3)  # grayscale -> RGB
    assert (folder / ".hetfl-cache-val.npz").is_file()

    (folder / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn99\n")
    with pytest.raises(DataFormatError, match=r"val_annotations.txt:1: .*n99"):
        load_tinyimagenet(tmp_path)
