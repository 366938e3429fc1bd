"""hetfl.host: the process-wide malloc setting (applied in a fresh interpreter: it is process-wide)."""

import os
import subprocess
import sys

import pytest

SCRIPT = ("from hetfl.host import keep_freed_memory, malloc_setting\n"
          "before = malloc_setting(); first = keep_freed_memory(); second = keep_freed_memory()\n"
          "print(before, '|', first, '|', second)")


def _run(env_value: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "HETFL_MALLOC"}
    if env_value is not None:
        env["HETFL_MALLOC"] = env_value
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return [part.strip() for part in out.stdout.split("|")]


def test_keep_freed_memory_applies_once_on_glibc_and_reports_it():
    before, first, second = _run(None)
    assert before == "default"
    assert first == second  # idempotent
    if "CS_GNU_LIBC_VERSION" in os.confstr_names and os.confstr("CS_GNU_LIBC_VERSION"):
        assert first.startswith("glibc ") and first.endswith(": kept")
    else:
        assert first == "default"


@pytest.mark.parametrize("value", ["default", "off", "0"])
def test_keep_freed_memory_opt_out(value):
    assert _run(value) == ["default", "default", "default"]
