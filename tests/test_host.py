"""hetfl.host: the process-wide malloc and subnormal-float settings (each applied in a fresh interpreter:
they are process-wide)."""

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


FLUSH = ("import sys, torch\n"
         "from hetfl.host import flush_denormal_setting, flush_denormals\n"
         "before = flush_denormal_setting()\n"
         "on = flush_denormals() if sys.argv[1] == 'on' else False\n"
         "torch.set_num_threads(2)\n"
         "x = torch.full((1 << 20,), 1e-39)  # subnormal in float32; 2 threads share the product\n"
         "y = x * 0.5\n"
         "print(before, on, flush_denormal_setting(), int((y == 0).sum()), y.numel(), flush_denormals())")


@pytest.mark.parametrize("mode", ["on", "off"])
def test_flush_denormals_zeroes_subnormal_results_on_every_thread(mode):
    out = subprocess.run([sys.executable, "-c", FLUSH, mode], capture_output=True, text=True, check=True)
    before, on, after, zeros, n, again = out.stdout.split()
    assert before == "False"
    if mode == "off" or on == "False":  # a CPU that cannot flush (torch's set_flush_denormal: False)
        assert int(zeros) == 0 and after == str(mode == "on" and on == "True")
        return
    assert (after, again) == ("True", "True")  # on, and idempotent
    assert int(zeros) == int(n)  # set before torch's first parallel operation: the worker thread flushes too


def test_hetfl_run_flushes_subnormals_where_the_config_asks_and_records_it(tmp_path):
    import json

    import torch

    from tests.conftest import TINY_CONFIG

    if not torch.set_flush_denormal(False):  # (False: the default, so nothing changes in this process)
        pytest.skip("this CPU cannot flush subnormal floats (torch.set_flush_denormal)")
    cfg = {**TINY_CONFIG, "client": {**TINY_CONFIG["client"], "epochs": 1}, "methods": {"fedavg": {}}}
    runs = {}
    for flush in (False, True):
        path = tmp_path / f"{flush}.json"
        path.write_text(json.dumps({**cfg, "simulator": {"flush_denormal": flush}}))
        out = tmp_path / f"run-{flush}"
        subprocess.run([sys.executable, "-c", "import sys; from hetfl.cli import main; sys.exit(main(sys.argv[1:]))",
                        "run", str(path), "--out", str(out), "--no-cache", "--quiet", "--device", "cpu"],
                       check=True, capture_output=True, text=True)
        runs[flush] = json.loads((out / "summary.json").read_text())
    assert runs[False]["environment"]["flush_denormal"] is False
    assert runs[True]["config"]["simulator"]["flush_denormal"] is True
    assert runs[True]["environment"]["flush_denormal"] is True
