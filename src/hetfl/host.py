"""Process-wide settings of the host that make CPU runs faster: one that changes no result
(:func:`keep_freed_memory`, always on) and one that changes the last bits (:func:`flush_denormals`,
on where a config asks for it).

glibc's ``malloc`` serves every block above its mmap threshold (128 KiB, rising to at most 32 MiB)
with a fresh ``mmap`` and returns it to the kernel on ``free``. A synthetic batch of 256 images
passing through a generator and five client models allocates and frees tens of such tensors per
step, and each one is page-faulted in again. :func:`keep_freed_memory` tells glibc to serve large
blocks from its heap and to keep freed memory for reuse (timings in docs/BENCHMARKS.md). The cost is
that the process's resident memory stays at its peak.

Opt out with ``HETFL_MALLOC=default``. Elsewhere than glibc (macOS, musl) it does nothing.

Subnormal floats (below 1.2e-38 in magnitude) take a slow path in x86 arithmetic. A client whose
loss has reached 0, as a one-class client's does after a few epochs, computes mostly with them, many
times slower; flushed to zero, the training ends with the same parameters up to the last bits
(docs/BENCHMARKS.md, "Subnormal floats"). :func:`flush_denormals` sets
the CPU's flush-to-zero and denormals-are-zero flags. They belong to each thread, and torch's
worker threads copy them when they start, so the flags reach every thread only when they are set
before torch's first parallel operation: the command line does that where the config asks for
them (``simulator.flush_denormal``), before it loads any data.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_state: dict[str, str] = {"malloc": "default", "flush_denormal": "off"}


def keep_freed_memory() -> str:
    """Configure glibc malloc (no mmap per block, no trimming below 1 GiB, 64 MiB top pad) once per
    process; returns ``'glibc <version>: kept'`` when applied, else ``'default'`` (see the module
    docstring)."""
    if _state["malloc"] != "default" or os.environ.get("HETFL_MALLOC", "").lower() in ("default", "off", "0"):
        return _state["malloc"]
    if not sys.platform.startswith("linux"):
        return _state["malloc"]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        gnu_get_libc_version = libc.gnu_get_libc_version  # present in glibc only
    except (OSError, AttributeError):
        return _state["malloc"]
    gnu_get_libc_version.restype = ctypes.c_char_p
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    if all(mallopt(option, value) == 1 for option, value in settings):
        _state["malloc"] = f"glibc {gnu_get_libc_version().decode()}: kept"
    return _state["malloc"]


def malloc_setting() -> str:
    """What :func:`keep_freed_memory` did in this process (recorded in run summaries)."""
    return _state["malloc"]


def flush_denormals() -> bool:
    """Flush subnormal floats to zero from now on in this process (see the module docstring; call it
    before torch's first parallel operation to reach its worker threads too); False where the CPU
    cannot (torch's ``set_flush_denormal``: x86 with SSE3, and ARM)."""
    if _state["flush_denormal"] == "on":
        return True
    import torch

    if not torch.set_flush_denormal(True):
        return False
    _state["flush_denormal"] = "on"
    return True


def flush_denormal_setting() -> bool:
    """Whether :func:`flush_denormals` is on in this process (recorded in run summaries)."""
    return _state["flush_denormal"] == "on"


@contextlib.contextmanager
def denormals_flushed(on: bool) -> Iterator[None]:
    """:func:`flush_denormals` for one run of the Python API, the process's setting restored after (so
    that two runs in one process do not leak it into each other)."""
    before = _state["flush_denormal"]
    if on:
        flush_denormals()
    try:
        yield
    finally:
        if on and before != "on":
            import torch

            torch.set_flush_denormal(False)
            _state["flush_denormal"] = before


def peak_gib() -> float:
    """This process's peak resident memory in GiB: VmHWM of its own address space (``ru_maxrss`` would
    also count the parent it was forked from, which Linux carries over an exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
