"""The machine a run used, as its summary records it (``environment``): versions, the code's git
revision, thread count, the processor and its bf16 units, allocator and denormal settings, the
accelerator. Timings are only comparable between runs whose environments agree.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

import hetfl
from hetfl.fl.precision import bf16_native
from hetfl.host import flush_denormal_setting, malloc_setting


def run_environment(device: torch.device) -> dict[str, Any]:
    """What a summary records of the machine a run on ``device`` used (its ``environment``): versions,
    thread count, processor and its bf16 units, allocator and denormal settings, accelerator."""
    return {"hetfl": hetfl.__version__, "code": code_revision(), "torch": torch.__version__,
            "device": str(device), "threads": torch.get_num_threads(),
            "machine": platform.machine(), "python": platform.python_version(),
            "cpu": processor_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_bf16": cpu_bf16_units(),
            "bf16_native": bf16_native(device.type), "malloc": malloc_setting(),
            "flush_denormal": flush_denormal_setting(),
            "accelerator": accelerator_name(device)}


@functools.lru_cache(maxsize=1)
def code_revision(package: str | None = None) -> str | None:
    """The git commit (12 hex digits) of the checkout hetfl runs from, with ``+dirty`` when its tracked
    files under the package differ from it; None outside a git checkout (an installed wheel) or
    without git. Read once per process (a simulator reads it as it starts: the code the run imported).
    ``package``: another folder, for tests."""
    folder = Path(package or Path(hetfl.__file__).parent)
    try:
        head = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        changed = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no", "--", "."],
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if changed.stdout.strip() else "")


def cpuinfo_value(key: str, cpuinfo: str | None = None) -> str | None:
    """The value of the first ``key : value`` line of ``/proc/cpuinfo`` (``cpuinfo``: that file's text,
    for tests); None without such a line or a readable file (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return None


def processor_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else :func:`platform.processor`): timings
    recorded in a summary are only comparable on the same processor."""
    return cpuinfo_value("model name") or platform.processor() or "unknown"


# /proc/cpuinfo flags that decide bf16 speed on a CPU, weakest first: torch's ``get_cpu_capability()``
# reads AVX512 on all three kinds of machine this project met (AVX-512 alone, with avx512_bf16, with
# AMX), whose bf16 convolutions differ by several times (docs/BENCHMARKS.md).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_units(cpuinfo: str | None = None) -> list[str]:
    """The :data:`BF16_FLAGS` in the CPU's ``flags`` (:func:`cpuinfo_value`); empty without any."""
    flags = set((cpuinfo_value("flags", cpuinfo) or "").split())
    return [f for f in BF16_FLAGS if f in flags]


def accelerator_name(device: torch.device) -> str | None:
    """The GPU's name (``NVIDIA H100 80GB HBM3``) for a CUDA device, else None: "cuda" alone does not
    say which card the recorded minutes are from."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)
