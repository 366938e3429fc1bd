"""Users' own datasets without code: an image folder (``kind: folder``) or an array file (``kind: arrays``).

``dataset: {kind: folder, path: DIR}`` reads the ImageFolder layout, ``DIR/train/<class>/*.png|jpg|jpeg|bmp``
and ``DIR/test/<class>/...``, classes sorted by name (as torchvision does); ``channels`` (1 or 3; default:
1 when every image is grayscale) and ``image_size`` (a side in pixels; default: the images' own, which
must then be square and all equal) say how the images are stored. ``dataset: {kind: arrays, path:
FILE.npz}`` reads ``x_train``, ``y_train``, ``x_test``, ``y_test`` (uint8 N x H x W, NHWC or NCHW, or
floats in [0, 1]; integer labels 0..C-1) and an optional ``classes``.

Both end as the same uint8 :class:`~hetfl.data.base.DatasetSplits` as the built-in loaders, read once into
memory, with ``sha256`` over the files' names and bytes so that the upload cache stays exact when a file
changes. Inputs stay in [0, 1] as for the built-in sets (no per-dataset normalisation). Every problem is a
:class:`~hetfl.data.base.DataFormatError` naming the file or folder, raised before any training.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetfl.data.base import DataFormatError, DatasetSplits, ImageDataset
from hetfl.data.formats import IMAGE_SUFFIXES

USER_KINDS = ("folder", "arrays")
FOLDER_KEYS = {"kind", "path", "channels", "image_size"}
ARRAYS_KEYS = {"kind", "path"}
GRAY_MODES = {"1", "L", "LA", "I", "I;16", "F", "P;L"}
ARRAY_NAMES = ("x_train", "y_train", "x_test", "y_test")


def check_spec(spec: dict[str, Any]) -> None:
    """The keys of a ``dataset:`` mapping (not the files: :func:`load_user_dataset` reads those)."""
    kind = spec.get("kind")
    if kind not in USER_KINDS:
        raise ValueError(f"dataset.kind: {kind!r} is not one of {', '.join(USER_KINDS)} (or name a dataset)")
    valid = FOLDER_KEYS if kind == "folder" else ARRAYS_KEYS
    if unknown := sorted(set(spec) - valid):
        raise ValueError(f"dataset: unknown key(s) {unknown} for kind {kind}; valid: {', '.join(sorted(valid))}")
    if not isinstance(spec.get("path"), str) or not spec["path"]:
        raise ValueError(f"dataset.path: a {'folder' if kind == 'folder' else '.npz file'} is required")
    if spec.get("channels") not in (None, 1, 3):
        raise ValueError(f"dataset.channels: {spec['channels']!r} is not 1 or 3")
    size = spec.get("image_size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ValueError(f"dataset.image_size: {size!r} is not a positive integer")


def dataset_label(spec: str | dict[str, Any]) -> str:
    """A dataset's name in summaries and tables: the registered name, or ``folder:DIR`` / ``arrays:FILE``."""
    return spec if isinstance(spec, str) else f"{spec['kind']}:{spec['path']}"


def load_user_dataset(spec: dict[str, Any], test_only: bool = False) -> DatasetSplits:
    """``test_only``: the test split alone (a Flower server whose SuperNodes serve their own data); the
    training split is then empty, with the test split's classes."""
    check_spec(spec)
    path = Path(spec["path"]).expanduser()
    if spec["kind"] == "folder":
        return load_folder(path, spec.get("channels"), spec.get("image_size"), test_only)
    return load_arrays(path, test_only)


def _empty_like(test: ImageDataset) -> ImageDataset:
    return ImageDataset(test.x[:0], test.y[:0], test.num_classes, test.name, test.class_names)


def load_node_folder(path: Path, classes: Sequence[str], shape: Sequence[int]) -> ImageDataset:
    """A Flower SuperNode's own training data, ``path/train/<class>/<image>``: any subset of the run's
    ``classes`` (a node holds the classes it has), labelled by the run's class order and converted to the
    run's ``shape`` (channels, side, side). A class the run does not know is a DataFormatError."""
    split_dir = path / "train"
    if not split_dir.is_dir():
        raise DataFormatError(f"{split_dir}: the node's training folder not found (expected "
                              f"{split_dir}/<class>/<image>)")
    by_class = _class_files(split_dir)
    if unknown := [c for c in by_class if c not in classes]:
        raise DataFormatError(f"{split_dir / unknown[0]}: class {unknown[0]!r} is not among the run's classes "
                              f"({', '.join(classes)})")
    mode, side = "L" if int(shape[0]) == 1 else "RGB", int(shape[1])
    files = [f for fs in by_class.values() for f in fs]
    y = np.concatenate([np.full(len(fs), list(classes).index(c), dtype=np.int64) for c, fs in by_class.items()])
    x = _read_split(files, mode, side, hashlib.sha256(), path)
    return ImageDataset(torch.from_numpy(x), torch.from_numpy(y), len(classes), f"folder:{path.name}", list(classes))


# ------------------------------------------------------------------------------ folders


def _class_files(split_dir: Path) -> dict[str, list[Path]]:
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataFormatError(f"{split_dir}: no class folders (expected {split_dir}/<class>/<image>)")
    files = {}
    for name in classes:
        found = sorted(p for p in (split_dir / name).rglob("*") if p.is_file() and not p.name.startswith("."))
        for f in found:
            if f.suffix.lower() not in IMAGE_SUFFIXES:
                raise DataFormatError(f"{f}: not an image file (expected {', '.join(sorted(IMAGE_SUFFIXES))})")
        if not found:
            raise DataFormatError(f"{split_dir / name}: class {name!r} has no images")
        files[name] = found
    return files


def _open(path: Path, data: bytes | None = None) -> Any:
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data) if data is not None else path)
        if data is not None:
            img.load()
        return img
    except Exception as err:  # Pillow raises many types on bad files
        raise DataFormatError(f"{path}: cannot read image ({type(err).__name__}: {err})") from err


def _geometry(files: Sequence[Path], image_size: int | None) -> tuple[bool, int]:
    """(every image grayscale, the side to store) from the images' headers."""
    gray, first, side = True, None, image_size
    for f in files:
        with _open(f) as img:
            gray &= img.mode in GRAY_MODES
            if image_size is None:
                if img.size[0] != img.size[1]:
                    raise DataFormatError(f"{f}: image is {img.size[0]}x{img.size[1]}, not square; set "
                                          "dataset.image_size to resize every image to one square side")
                if first is None:
                    first, side = f, img.size[0]
                elif img.size[0] != side:
                    raise DataFormatError(f"{f}: image is {img.size[0]}x{img.size[1]} but {first} is "
                                          f"{side}x{side}; set dataset.image_size to resize every image")
    return gray, int(side)  # type: ignore[arg-type]


def _read_split(files: Sequence[Path], mode: str, side: int, digest: Any, root: Path) -> np.ndarray:
    from PIL import Image
    from tqdm.auto import tqdm

    x = np.empty((len(files), 1 if mode == "L" else 3, side, side), dtype=np.uint8)
    for i, f in enumerate(tqdm(files, desc=f"reading {root.name}", unit="img", disable=len(files) < 2000)):
        data = f.read_bytes()
        digest.update(f"{f.relative_to(root).as_posix()}\t{len(data)}\n".encode())
        digest.update(data)
        with _open(f, data) as img:
            img = img.convert(mode)
            if img.size != (side, side):
                img = img.resize((side, side), Image.BILINEAR)
            arr = np.asarray(img)
        x[i] = arr[None] if mode == "L" else arr.transpose(2, 0, 1)
    return x


def load_folder(path: Path, channels: int | None = None, image_size: int | None = None,
                test_only: bool = False) -> DatasetSplits:
    """``path/{train,test}/<class>/<image>`` as uint8 splits (see the module docstring)."""
    if not path.is_dir():
        raise DataFormatError(f"{path}: dataset folder not found (expected {path}/train/<class>/<image> and "
                              f"{path}/test/<class>/<image>)")
    per_split = {}
    for split in ("test",) if test_only else ("train", "test"):
        if not (path / split).is_dir():
            raise DataFormatError(f"{path / split}: split folder not found (expected {path}/{split}/<class>/<image>)")
        per_split[split] = _class_files(path / split)
    classes = list(per_split["test" if test_only else "train"])
    if extra := sorted(set(per_split["test"]) - set(classes)):
        raise DataFormatError(f"{path / 'test' / extra[0]}: class {extra[0]!r} is in test but not in "
                              f"{path / 'train'} (train classes: {', '.join(classes)})")
    all_files = [f for split in per_split.values() for fs in split.values() for f in fs]
    gray, side = _geometry(all_files, image_size)
    mode = {1: "L", 3: "RGB", None: "L" if gray else "RGB"}[channels]
    digest = hashlib.sha256(f"folder {mode} {side}\n".encode())
    out = []
    for by_class in per_split.values():
        files = [f for fs in by_class.values() for f in fs]
        y = np.concatenate([np.full(len(fs), classes.index(c), dtype=np.int64) for c, fs in by_class.items()])
        x = _read_split(files, mode, side, digest, path)
        out.append(ImageDataset(torch.from_numpy(x), torch.from_numpy(y), len(classes), f"folder:{path.name}",
                                classes))
    if test_only:
        out.insert(0, _empty_like(out[0]))
    return DatasetSplits(out[0], out[1], sha256=digest.hexdigest())


# ------------------------------------------------------------------------------ array files


def _images(path: Path, name: str, x: np.ndarray) -> np.ndarray:
    """uint8 N x C x H x W from N x H x W, NHWC or NCHW, uint8 or floats in [0, 1]."""
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise DataFormatError(f"{path}: {name} has shape {x.shape}; expected N x H x W, N x H x W x C or N x C x H x W")
    if x.shape[1] not in (1, 3) and x.shape[3] in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    if x.shape[1] not in (1, 3):
        raise DataFormatError(f"{path}: {name} has shape {x.shape}; expected 1 or 3 channels (NHWC or NCHW)")
    if x.shape[2] != x.shape[3]:
        raise DataFormatError(f"{path}: {name} images are {x.shape[3]}x{x.shape[2]}, not square")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    if np.issubdtype(x.dtype, np.floating):
        if x.size and (not np.isfinite(x).all() or x.min() < 0 or x.max() > 1):
            raise DataFormatError(f"{path}: {name} holds floats outside [0, 1] (min {x.min():.4g}, max "
                                  f"{x.max():.4g}); give uint8 0..255 or floats in [0, 1]")
        return np.ascontiguousarray(np.rint(x * 255.0).astype(np.uint8))
    raise DataFormatError(f"{path}: {name} is {x.dtype}; expected uint8 or floats in [0, 1]")


def _labels(path: Path, name: str, y: np.ndarray, n: int) -> np.ndarray:
    if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer) or y.dtype == bool):
        raise DataFormatError(f"{path}: {name} must be a 1-d array of integer labels, got {y.dtype} {y.shape}")
    if len(y) != n:
        raise DataFormatError(f"{path}: {name} has {len(y)} labels but x_{name[2:]} has {n} images")
    return y.astype(np.int64)


def load_arrays(path: Path, test_only: bool = False) -> DatasetSplits:
    """``x_train``, ``y_train``, ``x_test``, ``y_test`` (and ``classes``) of an .npz file; ``test_only``:
    ``x_test`` and ``y_test`` alone are needed and read."""
    if not path.is_file():
        raise DataFormatError(f"{path}: array file not found (expected an .npz with {', '.join(ARRAY_NAMES)})")
    data = path.read_bytes()
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as err:
        raise DataFormatError(f"{path}: not a readable .npz without pickled objects ({type(err).__name__}: "
                              f"{err})") from err
    splits = ("test",) if test_only else ("train", "test")
    if missing := [k for k in ARRAY_NAMES if k not in arrays and k[2:] in splits]:
        raise DataFormatError(f"{path}: no array {missing[0]!r} (has: {', '.join(sorted(arrays)) or 'none'})")
    xs = {s: _images(path, f"x_{s}", arrays[f"x_{s}"]) for s in splits}
    ys = {s: _labels(path, f"y_{s}", arrays[f"y_{s}"], len(xs[s])) for s in splits}
    if test_only:
        xs["train"], ys["train"] = xs["test"][:0], ys["test"][:0]
    elif xs["train"].shape[1:] != xs["test"].shape[1:]:
        raise DataFormatError(f"{path}: x_train images are {xs['train'].shape[1:]} but x_test's are "
                              f"{xs['test'].shape[1:]} (C x H x W)")
    classes = [str(c) for c in arrays["classes"].tolist()] if "classes" in arrays else None
    high = max(int(y.max()) if len(y) else -1 for y in ys.values())
    n = len(classes) if classes is not None else high + 1
    for split, y in ys.items():
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= n):
            raise DataFormatError(f"{path}: y_{split} labels lie in {int(y.min())}..{int(y.max())}, outside "
                                  f"0..{n - 1}" + (f" ({n} classes named)" if classes is not None else ""))
    counts = np.bincount(ys["test" if test_only else "train"], minlength=n)
    if not test_only and (empty := np.flatnonzero(counts == 0)).size:
        c = int(empty[0])
        in_test = bool((ys["test"] == c).any())
        raise DataFormatError(f"{path}: class {c}{f' ({classes[c]!r})' if classes else ''} has no training "
                              "samples" + (" but appears in y_test" if in_test else ""))
    digest = hashlib.sha256(b"arrays\n" + data).hexdigest()
    splits = [ImageDataset(torch.from_numpy(xs[s]), torch.from_numpy(ys[s]), n, f"arrays:{path.stem}", classes)
              for s in ("train", "test")]
    return DatasetSplits(*splits, sha256=digest)
