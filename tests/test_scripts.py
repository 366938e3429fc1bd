"""The scripts under scripts/: their contracts, on tiny synthetic data."""

import os
import subprocess
import sys
import tarfile
from pathlib import Path


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




def test_bench_client_layout_reports_both_layouts_and_equal_logits():
    import json

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_client_layout.py"
    done = subprocess.run([sys.executable, str(script), "--repeats", "1", "--eval", "200"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for name in ("evaluate", "fedcog", "kd"):
        assert result[name]["nchw_ms"] > 0 and result[name]["nhwc_ms"] > 0
    assert result["evaluate"]["max_logit_diff"] < 1e-4


def test_bench_feature_generator_reports_both_forms_and_equal_outputs():
    import json

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_feature_generator.py"
    done = subprocess.run([sys.executable, str(script), "--repeats", "1", "--heads", "2", "--batch", "8"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for name in ("train", "generate"):
        assert result[name]["library_ms"] > 0 and result[name]["gemm_ms"] > 0
    assert result["max_diff"] < 1e-5
