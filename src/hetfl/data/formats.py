"""Low-level readers for the on-disk formats of the supported datasets.

Every reader returns plain numpy arrays and turns every problem a user can cause (missing
file, truncated file, wrong magic number, wrong keys, mismatched counts, mixed image sizes)
into a :class:`~hetfl.data.base.DataFormatError` whose message names the file, the expected
format and, through ``hint``, where to get the dataset.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import pickle
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hetfl.data.base import DataFormatError

__all__ = [
    "IMAGE_SUFFIXES",
    "read_cifar_meta",
    "read_cifar_pickle",
    "read_idx",
    "read_image_files",
    "read_image_folder",
    "read_svhn_mat",
]

# IDX type codes -> big-endian numpy dtypes.
_IDX_DTYPES: dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}
_GZIP_MAGIC = b"\x1f\x8b"
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm"})
_PROGRESS_MIN_FILES = 5000


def _fail(path: Path | str, problem: str, expected: str, hint: str = "") -> DataFormatError:
    """A :class:`DataFormatError` that names the file, the problem and the expected format."""
    message = f"{path}: {problem}. Expected {expected}."
    if hint:
        message += f" {hint}"
    return DataFormatError(message)


def _read_bytes(path: Path, expected: str, hint: str) -> bytes:
    """The file's bytes, transparently gunzipped when it starts with the gzip magic."""
    try:
        data = path.read_bytes()
    except FileNotFoundError as err:
        raise _fail(path, "file not found", expected, hint) from err
    except OSError as err:
        raise _fail(path, f"cannot read file ({err.strerror or err})", expected, hint) from err
    if data[:2] == _GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as err:
            raise _fail(path, f"corrupt or truncated gzip data ({err})", expected, hint) from err
    return data


# ----------------------------------------------------------------------------------------- IDX


def read_idx(path: str | Path, hint: str = "") -> np.ndarray:
    """Read an IDX file (the MNIST container), plain or gzipped.

    Layout: two zero bytes, a type code (0x08 ubyte, 0x09 byte, 0x0B int16, 0x0C int32,
    0x0D float32, 0x0E float64), the number of dimensions, one big-endian uint32 per
    dimension, then the row-major payload. Returns an array in native byte order.
    """
    path = Path(path)
    expected = "an IDX file (magic 0x00 0x00 <type> <ndim>, big-endian sizes, payload)"
    data = _read_bytes(path, expected, hint)
    if len(data) < 4:
        raise _fail(path, f"file too short for an IDX header ({len(data)} bytes)", expected, hint)
    zero0, zero1, code, ndim = data[:4]
    if zero0 or zero1:
        raise _fail(path, f"wrong magic number 0x{data[:4].hex()}", expected, hint)
    if code not in _IDX_DTYPES:
        raise _fail(path, f"unsupported IDX type code 0x{code:02x}", expected, hint)
    header = 4 + 4 * ndim
    if len(data) < header:
        raise _fail(path, "truncated IDX header", expected, hint)
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[code])
    want = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    have = len(data) - header
    if have != want:
        state = "truncated" if have < want else "has trailing bytes"
        raise _fail(
            path,
            f"file {state}: header says {dims} ({want} payload bytes), found {have}",
            expected,
            hint,
        )
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return array.astype(dtype.newbyteorder("="), copy=True)


# --------------------------------------------------------------------------------------- CIFAR


def _read_pickle_dict(path: Path, expected: str, hint: str) -> dict:
    # SECURITY: unpickling can execute arbitrary code. The CIFAR python-version archives are
    # pickles by design; only read dataset files that come from a source you trust.
    try:
        with path.open("rb") as f:
            obj = pickle.load(f, encoding="bytes")
    except FileNotFoundError as err:
        raise _fail(path, "file not found", expected, hint) from err
    except Exception as err:  # pickle raises almost anything on bad input
        raise _fail(
            path, f"not a readable pickle ({type(err).__name__}: {err})", expected, hint
        ) from err
    if not isinstance(obj, dict):
        raise _fail(path, f"pickle holds a {type(obj).__name__}, not a dict", expected, hint)
    return obj


def _as_key(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else key


def read_cifar_pickle(
    path: str | Path, label_key: str | bytes = "labels", hint: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR python-version batch (``data_batch_1``, ``test_batch``, ``train`` ...).

    The pickle holds a dict with bytes keys: ``b'data'`` (N x 3072 uint8, the 1024 red, then
    green, then blue values of each 32 x 32 image, row-major) and ``label_key``
    (``b'labels'`` for CIFAR-10, ``b'fine_labels'`` for CIFAR-100).
    Returns images (uint8, N x 3 x 32 x 32) and labels (int64, N).
    """
    path = Path(path)
    key = _as_key(label_key)
    expected = (
        f"a CIFAR python-version batch: a pickled dict with keys b'data' (N x 3072 uint8) "
        f"and {key!r}"
    )
    batch = _read_pickle_dict(path, expected, hint)
    missing = [k for k in (b"data", key) if k not in batch]
    if missing:
        found = sorted(map(repr, batch))[:8]
        raise _fail(path, f"missing key(s) {missing} (found {found})", expected, hint)
    try:
        data = np.asarray(batch[b"data"])
        labels = np.asarray(batch[key])
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
            raise ValueError(f"b'data' is {data.dtype} of shape {data.shape}")
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"{key!r} is {labels.dtype} of shape {labels.shape}")
        if len(labels) != len(data):
            raise ValueError(f"{len(data)} images but {len(labels)} labels")
    except (ValueError, TypeError) as err:
        raise _fail(path, str(err), expected, hint) from err
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32))
    return images, labels.astype(np.int64)


def read_cifar_meta(path: str | Path, names_key: str | bytes, hint: str = "") -> list[str]:
    """Class names from a CIFAR ``batches.meta`` / ``meta`` pickle (``label_names`` etc.)."""
    path = Path(path)
    key = _as_key(names_key)
    expected = f"a CIFAR meta pickle: a dict with key {key!r} (list of class names)"
    meta = _read_pickle_dict(path, expected, hint)
    if key not in meta:
        raise _fail(path, f"missing key {key!r}", expected, hint)
    return [n.decode() if isinstance(n, bytes) else str(n) for n in meta[key]]


# ---------------------------------------------------------------------------------------- SVHN


def read_svhn_mat(path: str | Path, hint: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Read an SVHN cropped-digits ``.mat`` file (``train_32x32.mat`` / ``test_32x32.mat``).

    ``X`` is 32 x 32 x 3 x N uint8 and ``y`` is N x 1 with labels 1..10, where 10 is the
    digit 0. Returns images (uint8, N x 3 x 32 x 32) and labels (int64, N, digit 0 -> 0).
    """
    from scipy.io import loadmat

    path = Path(path)
    expected = "an SVHN cropped-digits .mat file with X (32 x 32 x 3 x N uint8) and y (N x 1)"
    if not path.is_file():
        raise _fail(path, "file not found", expected, hint)
    try:
        mat = loadmat(path, variable_names=["X", "y"])
    except Exception as err:  # scipy raises many types on bad files
        raise _fail(
            path, f"not a readable .mat file ({type(err).__name__}: {err})", expected, hint
        ) from err
    missing = [k for k in ("X", "y") if k not in mat]
    if missing:
        raise _fail(path, f"missing variable(s) {missing}", expected, hint)
    x, y = np.asarray(mat["X"]), np.asarray(mat["y"]).reshape(-1)
    if x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise _fail(path, f"X has shape {x.shape}", expected, hint)
    if len(y) != x.shape[3]:
        raise _fail(path, f"{x.shape[3]} images but {len(y)} labels", expected, hint)
    if x.dtype != np.uint8:
        if x.size and (x.min() < 0 or x.max() > 255):
            raise _fail(path, f"X values outside 0..255 (dtype {x.dtype})", expected, hint)
        x = x.astype(np.uint8)
    labels = y.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() > 10):
        raise _fail(
            path, f"labels outside 1..10 ([{labels.min()}, {labels.max()}])", expected, hint
        )
    labels[labels == 10] = 0
    return np.ascontiguousarray(x.transpose(3, 2, 0, 1)), labels


# ------------------------------------------------------------------------------ image folders


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".")


def _decode(path: Path, expected: str, hint: str) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as img:
            return np.asarray(img.convert("RGB"))
    except Exception as err:  # Pillow raises many types on bad files
        raise _fail(
            path, f"cannot decode image ({type(err).__name__}: {err})", expected, hint
        ) from err


def _signature(files: Sequence[Path], labels: np.ndarray) -> str:
    digest = hashlib.sha256()
    for f, label in zip(files, labels.tolist(), strict=True):
        digest.update(f"{f.name}\t{label}\n".encode())
    return digest.hexdigest()


def _load_cache(
    cache_file: Path, n_files: int, signature: str
) -> tuple[np.ndarray, np.ndarray] | None:
    try:
        with np.load(cache_file, allow_pickle=False) as z:
            if int(z["n_files"]) != n_files or str(z["signature"]) != signature:
                return None
            return z["x"], z["y"]
    except Exception:  # a missing or corrupt cache is simply rebuilt
        return None


def _save_cache(cache_file: Path, x: np.ndarray, y: np.ndarray, signature: str) -> None:
    tmp = cache_file.with_name(f"{cache_file.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            np.savez(f, x=x, y=y, n_files=np.int64(len(y)), signature=np.str_(signature))
        os.replace(tmp, cache_file)
    except OSError:  # read-only folder, full disk ...: caching is best-effort
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def read_image_files(
    files: Sequence[Path],
    labels: Sequence[int] | np.ndarray,
    cache_file: str | Path | None = None,
    hint: str = "",
    desc: str = "decoding images",
) -> tuple[np.ndarray, np.ndarray]:
    """Decode ``files`` (PNG/JPEG ...) to RGB and stack them; all must have the same size.

    Returns images (uint8, N x 3 x H x W) and labels (int64, N). When ``cache_file`` is
    given, the decoded arrays are stored there as an uncompressed ``.npz`` and reused while
    the list of file names and labels is unchanged; an unwritable location skips caching.
    """
    files = [Path(f) for f in files]
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(y) != len(files):
        raise ValueError(f"{len(files)} files but {len(y)} labels")
    if not files:
        raise DataFormatError(f"no image files to read. {hint}".strip())
    signature = _signature(files, y)
    if cache_file is not None:
        cached = _load_cache(Path(cache_file), len(files), signature)
        if cached is not None:
            return cached
    expected = "RGB or grayscale images (PNG/JPEG) that all have the same width and height"
    x: np.ndarray | None = None
    from tqdm.auto import tqdm

    progress = tqdm(files, desc=desc, unit="img", disable=len(files) <= _PROGRESS_MIN_FILES)
    for i, f in enumerate(progress):
        img = _decode(f, expected, hint)
        if x is None:
            x = np.empty((len(files), 3, *img.shape[:2]), dtype=np.uint8)
        elif img.shape[:2] != x.shape[2:]:
            h, w = x.shape[2:]
            raise _fail(
                f,
                f"image is {img.shape[1]}x{img.shape[0]} but {files[0].name} is {w}x{h}",
                expected,
                hint,
            )
        x[i] = img.transpose(2, 0, 1)
    assert x is not None
    if cache_file is not None:
        _save_cache(Path(cache_file), x, y, signature)
    return x, y


def read_image_folder(
    root: str | Path,
    classes: Sequence[str] | None = None,
    cache: bool = True,
    hint: str = "",
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Read a class-per-subfolder image tree ``root/<class>/**/<image>``.

    Classes are the sub-folder names sorted by name (or ``classes``, in that order); images
    are found recursively inside each class folder, converted to RGB and must all have the
    same size. With ``cache`` the decoded arrays are kept in ``<root>/../.hetfl-cache-
    <root name>.npz`` (rebuilt when the file list changes; skipped if read-only).
    Returns images (uint8, N x 3 x H x W), labels (int64, N) and the class names.
    """
    root = Path(root)
    expected = "a folder with one sub-folder of images (PNG/JPEG) per class"
    if not root.is_dir():
        raise _fail(root, "folder not found", expected, hint)
    if classes is None:
        classes = sorted(
            p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
        )
        if not classes:
            raise _fail(root, "no class sub-folders", expected, hint)
    files: list[Path] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        class_dir = root / name
        if not class_dir.is_dir():
            raise _fail(class_dir, f"class folder {name!r} not found", expected, hint)
        found = sorted(p for p in class_dir.rglob("*") if _is_image(p) and p.is_file())
        files += found
        labels += [label] * len(found)
    if not files:
        raise _fail(root, "no image files in the class sub-folders", expected, hint)
    cache_file = root.parent / f".hetfl-cache-{root.name}.npz" if cache else None
    x, y = read_image_files(files, labels, cache_file, hint, desc=f"decoding {root.name}")
    return x, y, list(classes)
