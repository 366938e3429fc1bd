"""Precision settings: which precisions a loop may run in, whether this device runs bf16 natively, and
bf16 autocast (warning once where bf16 is only emulated); also the check that ``torch.compile`` can
run here.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import warnings

import torch

PRECISIONS = ("fp32", "bf16")


def check_precision(precision: object, key: str = "precision") -> None:
    """The one check of a precision setting (named ``key`` in the message), shared by every loop that
    autocasts."""
    if precision not in PRECISIONS:
        raise ValueError(f"{key} must be fp32 or bf16, got {precision!r}")


def check_compile(device: torch.device) -> None:
    """``torch.compile`` on a CPU generates C++: fail before any training where no compiler is found."""
    compilers = (os.environ.get("CXX"), "g++", "c++", "clang++")
    if device.type == "cpu" and not any(c and shutil.which(c) for c in compilers):
        raise ValueError("compile: true needs a C++ compiler (g++, c++ or clang++ on the PATH, or $CXX) for "
                         "torch.compile on a CPU; set compile: false")


@functools.cache
def bf16_native(device_type: str) -> bool:
    """Whether bf16 convolutions and matmuls run on native kernels on this kind of device. A CPU needs
    oneDNN's bf16 instructions (AVX-512 or AMX); without them torch emulates bf16, many times slower
    than fp32 (docs/BENCHMARKS.md)."""
    if device_type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # private op: fall back on the reported ISA
            return torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX"))
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return True


_WARNED_EMULATED: set[str] = set()


def warn_if_bf16_emulated(device: torch.device) -> None:
    """One ``RuntimeWarning`` per process and device kind when bf16 is asked of a device that only
    emulates it: the run is correct but may take tens of times longer than in fp32."""
    if device.type in _WARNED_EMULATED or bf16_native(device.type):
        return
    _WARNED_EMULATED.add(device.type)
    isa = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else device.type
    warnings.warn(f"precision bf16 on a {device.type} without native bf16 kernels ({isa}): torch emulates "
                  "them, many times slower than fp32. "
                  "Use precision fp32 on this machine; bf16 results compare only with bf16 runs.",
                  RuntimeWarning, stacklevel=3)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``precision == "bf16"`` (warning once where bf16 is emulated), else nothing."""
    if precision == "bf16":
        warn_if_bf16_emulated(device)
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
