"""Process-wide settings of the host that make CPU runs faster without changing any result.

glibc's ``malloc`` serves every block above its mmap threshold (128 KiB, rising to at most 32 MiB)
with a fresh ``mmap`` and returns it to the kernel on ``free``. A synthetic batch of 256 images
passing through a generator and five client models allocates and frees tens of such tensors per
step, and each one is page-faulted in again (about 100,000 minor faults per generator step at batch
256 in fp32, measured). :func:`keep_freed_memory` tells glibc to serve large blocks from its heap
and to keep freed memory for reuse: on a 2-vCPU AMD EPYC one FedHydra generator step at batch 256
went from 814-935 ms to 706-716 ms (fp32) and from 556-588 ms to 499-543 ms (bf16)
(docs/BENCHMARKS.md). The cost is that the process's resident memory stays at its peak.

Opt out with ``HETFL_MALLOC=default``. Elsewhere than glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_state: dict[str, str] = {"malloc": "default"}


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
