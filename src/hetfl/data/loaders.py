"""One loader per supported dataset, reading the official files from a local folder.

Nothing is downloaded: each ``load_X(root)`` expects the dataset's official distribution
already extracted under ``root`` (the layout is in each docstring) and returns the official
train and test splits as :class:`~hetfl.data.base.DatasetSplits` of uint8 images
(N x C x H x W) and int64 labels 0..C-1.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hetfl.data.base import DataFormatError, DatasetSplits, ImageDataset
from hetfl.data.formats import (
    read_cifar_meta,
    read_cifar_pickle,
    read_idx,
    read_image_files,
    read_image_folder,
    read_svhn_mat,
)

__all__ = [
    "EMNIST_SPLITS",
    "LOADERS",
    "load_cifar10",
    "load_cifar100",
    "load_cinic10",
    "load_emnist",
    "load_fmnist",
    "load_mnist",
    "load_svhn",
    "load_tinyimagenet",
]

DIGITS = [str(d) for d in range(10)]
UPPER = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
LOWER = [chr(c) for c in range(ord("a"), ord("z") + 1)]
FMNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip
CIFAR10_CLASSES = [
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip
# Class names of each EMNIST split, in label order (the merged splits keep the lower-case
# letters whose shapes differ from their capitals).
_MERGED = DIGITS + UPPER + list("abdefghnqrt")
EMNIST_SPLITS: dict[str, list[str]] = {
    "balanced": _MERGED,
    "byclass": DIGITS + UPPER + LOWER,
    "bymerge": _MERGED,
    "digits": DIGITS,
    "mnist": DIGITS,
    "letters": UPPER,
}

_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _dataset_dir(root: str | Path, sub: str, layout: str, source: str) -> Path:
    """``root/sub``, or a DataFormatError describing the expected layout and the source."""
    path = Path(root).expanduser() / sub
    if not path.is_dir():
        raise DataFormatError(f"{path}: folder not found. Expected layout: {layout}. {source}")
    return path


def _idx_file(folder: Path, name: str, source: str) -> Path:
    """``folder/name`` or ``folder/name.gz``, whichever exists."""
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise DataFormatError(
        f"{folder / name}: file not found (nor {name}.gz). Expected an IDX file. {source}"
    )


def _check_labels(labels: np.ndarray, num_classes: int, path: Path, source: str) -> None:
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataFormatError(
            f"{path}: labels must lie in 0..{num_classes - 1}, got "
            f"{labels.min()}..{labels.max()}. {source}"
        )


def _dataset(
    x: np.ndarray, y: np.ndarray, num_classes: int, name: str, classes: list[str] | None
) -> ImageDataset:
    return ImageDataset(
        torch.from_numpy(np.ascontiguousarray(x, dtype=np.uint8)),
        torch.from_numpy(np.asarray(y, dtype=np.int64)),
        num_classes,
        name,
        classes,
    )


def _read_idx_pair(
    folder: Path, images_name: str, labels_name: str, source: str
) -> tuple[np.ndarray, np.ndarray, Path]:
    """Images (N x H x W) and labels (N) from an IDX image file and an IDX label file."""
    images_path = _idx_file(folder, images_name, source)
    labels_path = _idx_file(folder, labels_name, source)
    images = read_idx(images_path, hint=source)
    labels = read_idx(labels_path, hint=source)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DataFormatError(
            f"{images_path}: expected N x H x W uint8 images, got {images.dtype} "
            f"{images.shape}. {source}"
        )
    if labels.ndim != 1:
        raise DataFormatError(f"{labels_path}: expected 1-d labels, got {labels.shape}. {source}")
    if len(labels) != len(images):
        raise DataFormatError(
            f"{labels_path}: {len(labels)} labels but {images_path.name} holds "
            f"{len(images)} images. {source}"
        )
    return images, labels.astype(np.int64), labels_path


def _load_mnist_like(
    root: str | Path, sub: str, name: str, classes: list[str], source: str
) -> DatasetSplits:
    layout = f"<root>/{sub}/" + "{" + ", ".join(sum(_MNIST_FILES.values(), ())) + "}[.gz]"
    folder = _dataset_dir(root, sub, layout, source)
    splits = []
    for images_name, labels_name in _MNIST_FILES.values():
        x, y, labels_path = _read_idx_pair(folder, images_name, labels_name, source)
        _check_labels(y, len(classes), labels_path, source)
        splits.append(_dataset(x[:, None], y, len(classes), name, classes))
    return DatasetSplits(*splits)


def load_mnist(root: str | Path) -> DatasetSplits:
    """MNIST: 60k/10k handwritten digits, 1 x 28 x 28, 10 classes.

    Layout: ``<root>/mnist/{train-images-idx3-ubyte, train-labels-idx1-ubyte,
    t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte}``, each plain or gzipped (``.gz``).
    """
    source = (
        "Get the four IDX files of the MNIST database (gzipped or not) and put them in "
        "<root>/mnist/."
    )
    return _load_mnist_like(root, "mnist", "mnist", DIGITS, source)


def load_fmnist(root: str | Path) -> DatasetSplits:
    """Fashion-MNIST: 60k/10k Zalando article images, 1 x 28 x 28, 10 classes.

    Layout: ``<root>/fashion-mnist/`` with the same four IDX file names as MNIST
    (``train-images-idx3-ubyte`` ... ``t10k-labels-idx1-ubyte``), plain or ``.gz``.
    """
    source = (
        "Get the four IDX files of Zalando's Fashion-MNIST distribution (gzipped or not) and "
        "put them in <root>/fashion-mnist/."
    )
    return _load_mnist_like(root, "fashion-mnist", "fmnist", FMNIST_CLASSES, source)


def load_emnist(root: str | Path, split: str = "balanced") -> DatasetSplits:
    """EMNIST (NIST's extension of MNIST to letters), 1 x 28 x 28.

    ``split`` is one of ``balanced`` (47 classes), ``byclass`` (62), ``bymerge`` (47),
    ``digits`` (10), ``mnist`` (10), ``letters`` (26; the files' labels 1..26 become 0..25).
    Layout: ``<root>/emnist/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte``,
    plain or ``.gz`` (the files of NIST's "gzip" distribution). The stored images are
    transposed; they are flipped back so that characters are upright.
    """
    if split not in EMNIST_SPLITS:
        raise DataFormatError(
            f"unknown EMNIST split {split!r}; valid splits: {', '.join(EMNIST_SPLITS)}"
        )
    classes = EMNIST_SPLITS[split]
    source = (
        "Get NIST's EMNIST 'gzip' distribution and extract its emnist-*-ubyte.gz files into "
        "<root>/emnist/."
    )
    layout = f"<root>/emnist/emnist-{split}-{{train,test}}-{{images-idx3,labels-idx1}}-ubyte[.gz]"
    folder = _dataset_dir(root, "emnist", layout, source)
    splits = []
    for part in ("train", "test"):
        x, y, labels_path = _read_idx_pair(
            folder,
            f"emnist-{split}-{part}-images-idx3-ubyte",
            f"emnist-{split}-{part}-labels-idx1-ubyte",
            source,
        )
        if split == "letters":
            y = y - 1
        _check_labels(y, len(classes), labels_path, source)
        x = np.ascontiguousarray(x.transpose(0, 2, 1)[:, None])
        splits.append(_dataset(x, y, len(classes), "emnist", classes))
    return DatasetSplits(*splits)


def load_cifar10(root: str | Path) -> DatasetSplits:
    """CIFAR-10: 50k/10k colour images, 3 x 32 x 32, 10 classes.

    Layout: ``<root>/cifar-10-batches-py/{data_batch_1 ... data_batch_5, test_batch}`` and
    optionally ``batches.meta`` (class names), i.e. the extracted "python version" archive.
    """
    source = (
        "Get the official 'CIFAR-10 python version' archive and extract it so that "
        "<root>/cifar-10-batches-py/data_batch_1 exists."
    )
    layout = "<root>/cifar-10-batches-py/{data_batch_1..data_batch_5, test_batch}"
    folder = _dataset_dir(root, "cifar-10-batches-py", layout, source)
    classes = CIFAR10_CLASSES
    if (folder / "batches.meta").is_file():
        classes = read_cifar_meta(folder / "batches.meta", "label_names", hint=source)
    parts = []
    for path in [*(folder / f"data_batch_{i}" for i in range(1, 6)), folder / "test_batch"]:
        x, y = read_cifar_pickle(path, "labels", hint=source)
        _check_labels(y, 10, path, source)
        parts.append((x, y))
    test_x, test_y = parts.pop()
    train_x = np.concatenate([x for x, _ in parts])
    train_y = np.concatenate([y for _, y in parts])
    return DatasetSplits(
        _dataset(train_x, train_y, 10, "cifar10", classes),
        _dataset(test_x, test_y, 10, "cifar10", classes),
    )


def load_cifar100(root: str | Path) -> DatasetSplits:
    """CIFAR-100 with its 100 fine labels: 50k/10k colour images, 3 x 32 x 32.

    Layout: ``<root>/cifar-100-python/{train, test}`` and optionally ``meta`` (class names),
    i.e. the extracted "python version" archive.
    """
    source = (
        "Get the official 'CIFAR-100 python version' archive and extract it so that "
        "<root>/cifar-100-python/train exists."
    )
    folder = _dataset_dir(root, "cifar-100-python", "<root>/cifar-100-python/{train, test}", source)
    classes = None
    if (folder / "meta").is_file():
        classes = read_cifar_meta(folder / "meta", "fine_label_names", hint=source)
    splits = []
    for part in ("train", "test"):
        x, y = read_cifar_pickle(folder / part, "fine_labels", hint=source)
        _check_labels(y, 100, folder / part, source)
        splits.append(_dataset(x, y, 100, "cifar100", classes))
    return DatasetSplits(*splits)


def load_svhn(root: str | Path) -> DatasetSplits:
    """SVHN cropped digits: 73,257/26,032 house-number digits, 3 x 32 x 32, 10 classes.

    Layout: ``<root>/svhn/{train_32x32.mat, test_32x32.mat}`` (the "format 2" files;
    ``extra_32x32.mat`` is not used). Label 10 in the files is the digit 0 and becomes 0.
    """
    source = (
        "Get the SVHN 'cropped digits' (format 2) files train_32x32.mat and test_32x32.mat "
        "and put them in <root>/svhn/."
    )
    folder = _dataset_dir(root, "svhn", "<root>/svhn/{train_32x32.mat, test_32x32.mat}", source)
    splits = []
    for part in ("train", "test"):
        x, y = read_svhn_mat(folder / f"{part}_32x32.mat", hint=source)
        splits.append(_dataset(x, y, 10, "svhn", DIGITS))
    return DatasetSplits(*splits)


def load_cinic10(root: str | Path, include_valid: bool = False) -> DatasetSplits:
    """CINIC-10: 90k/90k colour images (CIFAR-10 + downsampled ImageNet), 3 x 32 x 32.

    Layout: ``<root>/cinic-10/{train,test}/<class>/*.png`` (plus ``valid/``, ignored unless
    ``include_valid=True``, which appends it to the training split). Classes are the folder
    names sorted. Decoded arrays are cached as ``<root>/cinic-10/.hetfl-cache-<split>.npz``.
    """
    source = (
        "Get the official CINIC-10 archive and extract it so that "
        "<root>/cinic-10/train/airplane/ exists."
    )
    layout = "<root>/cinic-10/{train,test}/<class>/*.png"
    folder = _dataset_dir(root, "cinic-10", layout, source)
    for part in ("train", "test") + (("valid",) if include_valid else ()):
        _dataset_dir(folder, part, layout, source)
    train_x, train_y, classes = read_image_folder(folder / "train", hint=source)
    test_x, test_y, _ = read_image_folder(folder / "test", classes=classes, hint=source)
    if include_valid:
        valid_x, valid_y, _ = read_image_folder(folder / "valid", classes=classes, hint=source)
        train_x = np.concatenate([train_x, valid_x])
        train_y = np.concatenate([train_y, valid_y])
    n = len(classes)
    return DatasetSplits(
        _dataset(train_x, train_y, n, "cinic10", classes),
        _dataset(test_x, test_y, n, "cinic10", classes),
    )


def load_tinyimagenet(root: str | Path) -> DatasetSplits:
    """Tiny ImageNet: 100k/10k colour images, 3 x 64 x 64, 200 classes.

    Layout: ``<root>/tiny-imagenet-200/`` with ``wnids.txt``, ``train/<wnid>/images/*.JPEG``,
    ``val/images/*.JPEG`` and ``val/val_annotations.txt`` (tab-separated: file name, wnid,
    box). The official test labels are not public, so the returned test split is the
    labelled validation set. Class order is the sorted wnids of ``wnids.txt``; class names
    are the wnids. Decoded arrays are cached as ``.hetfl-cache-{train,val}.npz`` there.
    """
    source = (
        "Get the official tiny-imagenet-200 archive and extract it so that "
        "<root>/tiny-imagenet-200/wnids.txt exists."
    )
    layout = (
        "<root>/tiny-imagenet-200/{wnids.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG, "
        "val/val_annotations.txt}"
    )
    folder = _dataset_dir(root, "tiny-imagenet-200", layout, source)
    wnids_path = folder / "wnids.txt"
    annotations_path = folder / "val" / "val_annotations.txt"
    for path in (wnids_path, annotations_path):
        if not path.is_file():
            raise DataFormatError(f"{path}: file not found. Expected layout: {layout}. {source}")
    wnids = sorted({w.strip() for w in wnids_path.read_text().split() if w.strip()})
    if not wnids:
        raise DataFormatError(f"{wnids_path}: no wnids listed (one per line). {source}")
    index = {w: i for i, w in enumerate(wnids)}
    train_x, train_y, _ = read_image_folder(folder / "train", classes=wnids, hint=source)

    files, labels = [], []
    for line_no, line in enumerate(annotations_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise DataFormatError(
                f"{annotations_path}:{line_no}: expected '<file>\\t<wnid from wnids.txt>\\t...', "
                f"got {line!r}. {source}"
            )
        files.append(folder / "val" / "images" / fields[0])
        labels.append(index[fields[1]])
    test_x, test_y = read_image_files(
        files, labels, cache_file=folder / ".hetfl-cache-val.npz", hint=source, desc="decoding val"
    )
    n = len(wnids)
    return DatasetSplits(
        _dataset(train_x, train_y, n, "tinyimagenet", wnids),
        _dataset(test_x, test_y, n, "tinyimagenet", wnids),
    )


LOADERS: dict[str, Callable[..., DatasetSplits]] = {
    "mnist": load_mnist,
    "fmnist": load_fmnist,
    "emnist": load_emnist,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "svhn": load_svhn,
    "cinic10": load_cinic10,
    "tinyimagenet": load_tinyimagenet,
}
