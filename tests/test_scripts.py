"""The device scripts (scripts/device-cells.sh, scripts/device-trials.sh): their contracts, without a device."""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device-cells.sh"


def test_device_script_parses_and_requires_cells(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "CELLS"})
    assert done.returncode != 0 and "CELLS='dataset:setting:seed ...' is required" in done.stderr


def test_device_script_skips_cells_past_the_deadline_and_still_packs_its_logs(tmp_path):
    env = {**os.environ, "CELLS": "mnist:0.5:0 fmnist:0.1:2", "DL": "10", "DEV": "cpu", "PY": sys.executable,
           "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skip mnist 0.5 0: deadline" in done.stdout and "skip fmnist 0.1 2: deadline" in done.stdout
    with tarfile.open(tmp_path / "out" / "cells.tgz") as tar:
        names = set(tar.getnames())
    assert {"device-work/logs/cell1.log", "device-work/logs/cell2.log", "device-work/logs/env.txt"} <= names


def test_device_script_passes_jobs_and_packs_the_cache_on_request(tmp_path):
    entry = tmp_path / "device-work" / "cache" / "1" / "ab" / "ab12.safetensors"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"upload")
    env = {**os.environ, "CELLS": "fmnist:0.5,0.3:0", "PAPER": "fedhydra", "JOBS": "8", "PACK_CACHE": "1",
           "BATCH": "1", "CLIENT_JOBS": "5", "DL": "60", "DEV": "cpu", "PY": "echo",
           "OUT": str(tmp_path / "out")}  # echo: no run
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "device-work" / "logs" / "cell1.log").read_text()
    assert "reproduce fedhydra" in log and "--settings 0.5,0.3 --seeds 0" in log and "--jobs 8" in log
    assert "--batch-clients" in log and "--client-jobs 5" in log
    with tarfile.open(tmp_path / "out" / "cells.tgz") as tar:
        assert "device-work/cache/1/ab/ab12.safetensors" in tar.getnames()


TRIALS = SCRIPT.with_name("device-trials.sh")


def test_trials_script_parses_and_requires_its_variables(tmp_path):
    assert subprocess.run(["bash", "-n", str(TRIALS)]).returncode == 0
    env = {k: v for k, v in os.environ.items() if k not in ("TRIALS", "CONFIG", "METHOD")}
    done = subprocess.run(["bash", str(TRIALS)], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode != 0 and "TRIALS='name:KEY=VALUE,KEY=VALUE ...' is required" in done.stderr
    done = subprocess.run(["bash", str(TRIALS)], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "TRIALS": "a:", "CONFIG": "c.yaml"})
    assert done.returncode != 0 and "METHOD (the config's method the trials run) is required" in done.stderr


def test_trials_script_passes_each_trials_overrides_and_packs_the_method_logs(tmp_path):
    logged = tmp_path / "device-work" / "trials" / "runs" / "a" / "dense" / "metrics.jsonl"
    logged.parent.mkdir(parents=True)
    logged.write_text('{"method": "dense", "step": 1, "accuracy": 50.0}\n')
    (logged.parent / "dense.safetensors").write_bytes(b"model")
    env = {**os.environ, "TRIALS": "a:partition.alpha=0.3,methods.dense.lr=0.005 b: c", "CONFIG": "x.yaml",
           "METHOD": "dense", "CACHE": "cache/gpu", "DL": "60", "DEV": "cpu", "PY": "echo",
           "OUT": str(tmp_path / "out")}  # echo: the command line, no run
    done = subprocess.run(["bash", str(TRIALS)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    logs = tmp_path / "device-work" / "trials" / "logs"
    a, b, c = ((logs / f"{n}.log").read_text() for n in "abc")
    assert "run x.yaml --device cpu --cache-dir cache/gpu --methods dense" in a
    assert "--set partition.alpha=0.3 --set methods.dense.lr=0.005 --out device-work/trials/runs/a" in a
    assert "trial b (as configured)" in b and "--set" not in b and "--set" not in c
    with tarfile.open(tmp_path / "out" / "trials.tgz") as tar:
        names = set(tar.getnames())
    assert {"device-work/trials/out/a.jsonl", "device-work/trials/out/a.safetensors",
            "device-work/trials/logs/b.log"} <= names
    assert "device-work/trials/out/b.jsonl" not in names  # b logged nothing


def test_trials_script_skips_trials_past_the_deadline(tmp_path):
    env = {**os.environ, "TRIALS": "a: b:", "CONFIG": "x.yaml", "METHOD": "dense", "DL": "5", "DEV": "cpu",
           "PY": "echo", "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(TRIALS)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "skip a: deadline" in done.stdout and "skip b: deadline" in done.stdout


def test_trials_script_writes_a_cells_config_and_imports_its_archived_uploads(tmp_path):
    """CELL: the trials run the reproduction's own config of a 2c/c cell (which `--set` could not make
    from a Dirichlet config), on the archived cell's uploads re-keyed for DEV."""
    import json

    archived = Path(__file__).resolve().parents[1] / "docs" / "results" / "fedhydra-runs" / "uploads"
    env = {**os.environ, "TRIALS": "cfg: lr5:methods.fedhydra_dense_log1p.lr=0.005", "CELL": "fmnist:2c/c:0",
           "PAPER": "fedhydra", "BUDGET": "paper", "METHOD": "fedhydra_dense_log1p", "CACHE": "cache/c",
           "UPLOADS": str(archived), "DL": "1", "DEV": "cpu", "PY": sys.executable, "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(TRIALS)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skip cfg: deadline" in done.stdout and "skip lr5: deadline" in done.stdout  # DL=1: set-up only
    cfg = json.loads((tmp_path / "device-work" / "trials" / "cell.json").read_text())
    assert cfg["name"] == "fedhydra-fmnist-2cc-s0-paper" and cfg["partition"] == {"kind": "2c/c"}
    assert cfg["methods"]["fedhydra_dense_log1p"]["temperature"] == 20.0  # the budget's setting of ours
    imported = sorted(p.name for p in (tmp_path / "cache" / "c").rglob("*.safetensors"))
    assert len(imported) == 5 == len(list((archived / cfg["name"]).rglob("*.safetensors")))
    bad = subprocess.run(["bash", str(TRIALS)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**env, "PAPER": "nope", "UPLOADS": ""})
    assert bad.returncode == 1 and "CELL=fmnist:2c/c:0 (PAPER=nope): no config" in bad.stderr


def test_device_script_merges_a_worker_that_finished_as_the_deadline_stopped_its_cell(tmp_path, tiny_config):
    from hetfl.methods.checks import validate
    from hetfl.reproduce.common import run_missing_methods

    cfg = validate({**tiny_config, "device": "cpu", "methods": {"ensemble": {}, "fedavg": {}}})
    root, cache = tmp_path / "device-work" / "runs" / "1", tmp_path / "cache"
    run_missing_methods({**cfg, "methods": {"ensemble": {}}}, root / "tiny", cache, None, True)
    run_missing_methods({**cfg, "methods": {"fedavg": {}}}, root / ".parts" / "tiny" / "fedavg", cache, None, True)
    env = {**os.environ, "CELLS": "mnist:0.5:0", "DL": "10", "DEV": "cpu", "PY": sys.executable,
           "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "merged after the deadline: tiny: fedavg" in (tmp_path / "device-work" / "logs" / "env.txt").read_text()
    with tarfile.open(tmp_path / "out" / "cells.tgz") as tar:
        names = set(tar.getnames())
    assert "device-work/runs/1/tiny/fedavg/metrics.jsonl" in names
    assert not any(".parts" in n for n in names)


def test_averaging_gap_with_one_client_of_the_architecture_averages_to_that_client(tmp_path):
    """scripts/averaging_gap.py: one cnn2 client, so its ensemble and both averages are that client;
    the vote with the lenet5 average is reported; a snapshot past client.epochs fails early."""
    import json

    script = Path(__file__).resolve().parents[1] / "scripts" / "averaging_gap.py"
    config = Path(__file__).resolve().parents[1] / "configs" / "fedmho-synthetic.yaml"
    out = tmp_path / "gap.json"
    args = [sys.executable, str(script), str(config), "--set", "client.model=[cnn2,lenet5,lenet5,lenet5]",
            "--set", "client.epochs=2", "--snapshots", "1,2", "--vote", "--out", str(out)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["clients"] == [0] and set(result["snapshots"]) == {"1", "2"}
    for row in result["snapshots"].values():
        (client,) = row["clients"]
        assert row["ensemble"] == row["average_uniform"] == row["average_samples"] == client
        assert 0 <= row["vote_uniform"] <= 100 and row["distance_from_init"][0] > 0
    assert result["other_archs"]["lenet5"]["clients"] == [1, 2, 3]
    bad = subprocess.run(args[:-2] + ["--snapshots", "3", "--out", str(out)], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "snapshots must lie in 1..2" in bad.stderr

    # the same clients trained in two processes, then evaluated together: the same result
    snaps, split = tmp_path / "snaps", tmp_path / "split.json"
    base = args[:-2] + ["--snap-dir", str(snaps)]
    early = subprocess.run(base + ["--evaluate-only", "--out", str(split)], capture_output=True, text=True, timeout=300)
    assert early.returncode != 0 and "no snapshot" in early.stderr and "--clients" in early.stderr
    for ids in ("0,2", "1,3"):
        done = subprocess.run(base + ["--clients", ids], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    assert sorted(f.name for f in snaps.iterdir())[:3] == ["cnn2-client0-e1.safetensors", "cnn2-client0-e2.safetensors",
                                                           "lenet5-client1-e2.safetensors"]
    done = subprocess.run(base + ["--evaluate-only", "--out", str(split)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    machine = ("minutes", "processor", "threads")
    together = {k: v for k, v in json.loads(split.read_text()).items() if k not in machine}
    assert together == {k: v for k, v in result.items() if k not in machine}


def test_class_ownership_counts_owners_falling_with_alpha_and_checks_the_group(tmp_path):
    """scripts/class_ownership.py on the synthetic dataset: at Dir(100) no client of the group owns
    a class and the largest share is near 1/5; at Dir(0.1) shares are far larger; a bad group fails."""
    import json

    script = Path(__file__).resolve().parents[1] / "scripts" / "class_ownership.py"
    out = tmp_path / "own.json"
    args = [sys.executable, str(script), "--datasets", "synthetic", "--alphas", "0.1,100", "--seeds", "3",
            "--show", "0,7", "--out", str(out)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {(r["alpha"], r["kind"]): r for r in json.loads(out.read_text())["rows"]["synthetic"]}
    assert set(rows) == {(a, k) for a in (0.1, 100.0) for k in ("dirichlet", "feddf_dirichlet")}
    for kind in ("dirichlet", "feddf_dirichlet"):
        flat, skewed = rows[(100.0, kind)], rows[(0.1, kind)]
        assert flat["owned_mean"] == 0 and flat["seeds_without"] == 3 and abs(flat["top_share_mean"] - 0.2) < 0.1
        assert skewed["top_share_mean"] > 0.5 and set(skewed["shown"]) == {"0", "7"}
    bad = subprocess.run(args[:2] + ["--datasets", "synthetic", "--group", "0,10"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--group must list client ids in 0..9" in bad.stderr


def test_device_averaging_script_trains_one_process_per_client_and_evaluates_them_together(tmp_path):
    """scripts/device-averaging.sh on the CPU: four tiny clients in four processes, then one
    evaluation of both snapshots with the vote; the logs are packed."""
    import json

    root = Path(__file__).resolve().parents[1]
    script = root / "scripts" / "device-averaging.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    done = subprocess.run(["bash", str(script)], cwd=root, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k not in ("CONFIG", "CLIENTS")})
    assert done.returncode != 0 and "CONFIG (the config whose clients train) is required" in done.stderr
    env = {**os.environ, "CONFIG": "configs/fedmho-synthetic.yaml", "CLIENTS": "0 1 2 3", "SNAPS": "1,2",
           "SETS": "client.model=[cnn2,cnn2,lenet5,lenet5] client.epochs=2", "DEV": "cpu", "DL": "280",
           "EVAL_S": "60", "PY": sys.executable, "OUT": str(tmp_path / "out"), "SNAP_DIR": str(tmp_path / "snaps")}
    work = tmp_path / "tree"
    (work / "scripts").mkdir(parents=True)
    for name in ("device-averaging.sh", "averaging_gap.py"):
        (work / "scripts" / name).write_text((root / "scripts" / name).read_text())
    (work / "configs").mkdir()
    (work / "configs" / "fedmho-synthetic.yaml").write_text((root / "configs" / "fedmho-synthetic.yaml").read_text())
    done = subprocess.run(["bash", "scripts/device-averaging.sh"], cwd=work, capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "out" / "averaging.json").read_text())
    assert result["clients"] == [0, 1] and set(result["snapshots"]) == {"1", "2"}
    assert "vote_uniform" in result["snapshots"]["2"] and result["other_archs"]["lenet5"]["clients"] == [2, 3]
    with tarfile.open(tmp_path / "out" / "logs.tgz") as tar:
        assert {"device-work/logs/client0.log", "device-work/logs/evaluate.log"} <= set(tar.getnames())


def test_batch_clients_benchmark_reports_both_ways(tmp_path):
    """scripts/bench_batch_clients.py: a JSON line with both timings and their ratio."""
    import json

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_batch_clients.py"
    args = [sys.executable, str(script), "--arch", "lenet5", "--clients", "2", "--steps", "2", "--batch-size", "8",
            "--size", "16", "--repeats", "1", "--precision", "fp32", "--device", "cpu"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["clients"] == 2 and row["device"] == "cpu" and row["alone_s"] > 0 and row["grouped_s"] > 0
    assert row["speedup"] == round(row["alone_s"] / row["grouped_s"], 2)


RERUN = SCRIPT.with_name("rerun-method.sh")


def test_rerun_script_runs_fedavg_and_the_methods_then_merges_and_skips_started_cells(tmp_path):
    assert subprocess.run(["bash", "-n", str(RERUN)]).returncode == 0
    env = {k: v for k, v in os.environ.items() if k not in ("BUDGET", "METHODS", "FORCE")}
    done = subprocess.run(["bash", str(RERUN), "mnist:0.5:0"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode != 0 and "BUDGET is required" in done.stderr
    env = {**env, "BUDGET": "reduced-t60", "METHODS": "coboosting", "HETFL": "echo", "OUT": "runs/x"}
    (tmp_path / "runs" / "x" / "fedhydra-mnist-2cc-s1-reduced-t60").mkdir(parents=True)  # started elsewhere
    done = subprocess.run(["bash", str(RERUN), "fmnist:0.5:0", "mnist:2c/c:1"], cwd=tmp_path, capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert ("reproduce fedhydra --budget reduced-t60 --datasets fmnist --settings 0.5 --seeds 0 --methods "
            "fedavg,coboosting --device cpu --out runs/x --cache-dir cache/rerun --results runs/x/fedhydra.md") in out
    assert ("archive-merge fedhydra runs/x/fedhydra-fmnist-0.5-s0-reduced-t60 --methods coboosting --folder one-cache"
            in out)
    assert "skip mnist:2c/c:1 (runs/x/fedhydra-mnist-2cc-s1-reduced-t60 exists)" in out and "--settings 2c/c" not in out
    done = subprocess.run(["bash", str(RERUN), "mnist:2c/c:1"], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "FORCE": "1"}, timeout=60)
    assert "--datasets mnist --settings 2c/c --seeds 1" in done.stdout  # resumed on request
    done = subprocess.run(["bash", str(RERUN), "fmnist:0.5:2:10", "mnist:0.5:1:5"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=60)
    assert "--settings 0.5 --seeds 2 --clients 10 --methods" in done.stdout  # the client-count sweep
    assert "archive-merge fedhydra runs/x/fedhydra-fmnist-0.5-m10-s2-reduced-t60 " in done.stdout
    assert "--settings 0.5 --seeds 1 --methods" in done.stdout and "-m5-" not in done.stdout
    done = subprocess.run(["bash", str(RERUN), "fmnist:0.1:2"], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "PAPER": "fedmho"}, timeout=60)
    assert "archive-merge fedmho runs/x/fedmho-fmnist-a0.1-s2-reduced-t60 --methods coboosting --folder" in done.stdout
    done = subprocess.run(["bash", str(RERUN), "fmnist:0.1:2:10"], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "PAPER": "fedmho"}, timeout=60)
    assert "skip fmnist:0.1:2:10 (a client count is for fedhydra's sweep only)" in done.stdout
    assert "reproduce" not in done.stdout
    done = subprocess.run(["bash", str(RERUN), "fmnist:0.1:2", "fmnist:0.1:1"], cwd=tmp_path, capture_output=True,
                          text=True, env={**env, "HETFL": "false", "FORCE_CPU": "1"}, timeout=60)
    assert done.stdout.count(" failed fmnist:0.1:") == 2  # a failed cell does not stop the others
    fake = tmp_path / "fake-hetfl"  # archive-check says the second cell ran on another processor
    fake.write_text('#!/bin/bash\n[ "$1" = archive-check ] && [[ "$3" == *s1* ]] && exit 1\necho "$@"\n')
    fake.chmod(0o755)
    done = subprocess.run(["bash", str(RERUN), "fmnist:0.1:2", "fmnist:0.1:1"], cwd=tmp_path, capture_output=True,
                          text=True, env={**env, "HETFL": str(fake)}, timeout=60)
    assert "archive-check fedhydra fedhydra-fmnist-0.1-s2-reduced-t60 --folder one-cache" in done.stdout
    assert "--settings 0.1 --seeds 2" in done.stdout and "--seeds 1" not in done.stdout
    assert "skip fmnist:0.1:1 (clients retrained here would not give its uploads" in done.stdout
    done = subprocess.run(["bash", str(RERUN), "fmnist:0.1:1"], cwd=tmp_path, capture_output=True,
                          text=True, env={**env, "HETFL": str(fake), "FORCE_CPU": "1"}, timeout=60)
    assert "--settings 0.1 --seeds 1" in done.stdout and "archive-check" not in done.stdout
