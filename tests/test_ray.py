"""Ray: grids of cells as Ray tasks on a two-node cluster (``hetfl reproduce --ray``) and a round's clients
on Ray workers through Flower's simulation runtime (``hetfl flower sim``)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hetfl.cli import main
from hetfl.engine.flower_local import free_port
from hetfl.reproduce.paper import cell_config, load_paper
from hetfl.reproduce.ray_grid import cell_task, folder_files, write_files

ray = pytest.importorskip("ray")

GRID = ["reproduce", "kdia", "--budget", "smoke", "--settings", "0.5", "--seeds", "0,1,2,3", "--methods",
        "fedavg,moon", "--no-cache", "--quiet"]


def session_processes(sid: int) -> list[int]:
    """Live processes whose sid is ``sid``: all that a ``ray start`` started with ``start_new_session`` made."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def start_node(*args: str) -> subprocess.Popen:
    ray_cli = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    return subprocess.Popen([ray_cli, "start", "--block", "--num-cpus=1", "--node-ip-address=127.0.0.1", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)


def wait_for_nodes(address: str, count: int, seconds: float = 90) -> None:
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    deadline = time.monotonic() + seconds
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    try:
        while sum(n["Alive"] for n in ray.nodes()) < count:
            assert time.monotonic() < deadline, f"the Ray cluster did not reach {count} nodes"
            time.sleep(0.5)
    finally:
        ray.shutdown()


def without_timings(page: str) -> str:
    """A results page with its measured times (minutes per cell, seconds per round) blanked."""
    page = re.sub(r"minutes per cell [^;]*;", "minutes per cell T;", page)
    lines, column = page.splitlines(), None
    for i, line in enumerate(lines):
        cells = line.split(" | ")
        if "s / round" in cells:
            column = cells.index("s / round")
        elif column is not None and line.startswith("| ") and not line.startswith("|---"):
            cells[column] = "T"
            lines[i] = " | ".join(cells)
        elif not line.startswith("|"):
            column = None
    return "\n".join(lines)


@pytest.mark.slow
def test_a_grid_on_a_two_node_ray_cluster_uses_both_nodes_and_equals_a_local_run(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    monkeypatch.setattr("hetfl.reproduce.runner.usable_cpus", lambda: 1)  # one thread a cell, as on the nodes
    assert main([*GRID, "--out", str(tmp_path / "local"), "--results", str(tmp_path / "local-page" / "kdia.md")]) == 0
    port = free_port()
    temp = tempfile.mkdtemp(prefix="/tmp/hetfl-ray-")  # short: Ray's socket paths live under it
    head = start_node("--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}",
                      f"--ray-client-server-port={free_port()}", "--disable-usage-stats")
    nodes = [head]
    try:
        time.sleep(2)
        nodes.append(start_node(f"--address=127.0.0.1:{port}"))
        wait_for_nodes(f"127.0.0.1:{port}", 2)
        assert main([*GRID, "--out", str(tmp_path / "ray"), "--results", str(tmp_path / "ray-page" / "kdia.md"),
                     "--ray", f"127.0.0.1:{port}"]) == 0
        assert not ray.is_initialized()  # the driver let go of the cluster
    finally:
        for node in nodes:
            os.killpg(node.pid, signal.SIGTERM)
        for node in nodes:
            node.wait(60)
    deadline = time.monotonic() + 30
    while any(session_processes(n.pid) for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(session_processes(n.pid) for n in nodes), "a Ray process the test started is left"
    shutil.rmtree(temp, ignore_errors=True)  # the cluster's logs
    summaries = [json.loads(p.read_text()) for p in sorted((tmp_path / "ray").glob("*/summary.json"))]
    assert len(summaries) == 4 and len({s["ray"]["node_id"] for s in summaries}) == 2  # both nodes ran cells
    assert not list((tmp_path / "ray").glob(".hetfl-ray-*"))  # the shared-folder marker is gone
    local = (tmp_path / "local-page" / "kdia.md").read_text()
    ours = (tmp_path / "ray-page" / "kdia.md").read_text()
    assert without_timings(ours) == without_timings(local)


def test_a_cell_on_a_node_without_the_runs_folder_returns_its_files_and_skips_finished_methods(tmp_path: Path) -> None:
    cfg = cell_config(load_paper("kdia"), "synthetic", "0.5", 0, "smoke", ["fedavg", "moon"])
    cfg["methods"]["fedavg"]["rounds"] = cfg["methods"]["moon"]["rounds"] = 1
    root = tmp_path / "runs"
    first = cell_task({**cfg, "methods": {"fedavg": cfg["methods"]["fedavg"]}}, str(root), ".absent", None,
                      None, None, "cpu", 1, False)
    assert not root.exists()  # ran in a temporary folder: its files came back instead
    assert "summary.json" in first["files"] and "metrics.jsonl" in first["files"]
    assert not any(name.endswith(".safetensors") for name in first["files"])
    write_files(root / cfg["name"], first["files"])
    prior = (root / cfg["name"] / "summary.json").read_text()
    second = cell_task(cfg, str(root), ".absent", prior, None, None, "cpu", 1, False)
    summary = json.loads(second["files"]["summary.json"])
    assert set(summary["results"]) == {"fedavg", "moon"}
    assert summary["results"]["fedavg"] == json.loads(prior)["results"]["fedavg"]  # not run again
    assert not any(name.startswith("fedavg/") for name in second["files"])
    with pytest.raises(ValueError, match="leaves its folder"):
        write_files(root, {"../escape.txt": b"x"})
    assert set(folder_files(root / cfg["name"], keep_models=True)) >= set(first["files"])


def test_ray_options_without_the_extra_name_it(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert main([*GRID, "--out", str(tmp_path), "--ray"]) == 2
    assert "install the extra with pip install 'hetfl[ray]'" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: x\n")
    assert main(["flower", "sim", str(cfg)]) == 2
    assert "hetfl flower sim needs Ray: install the extra with pip install 'hetfl[ray]'" in capsys.readouterr().err
    assert main([*GRID, "--out", str(tmp_path), "--jobs", "2", "--ray", "auto"]) == 2


SIM = {
    "name": "sim-test", "seed": 0, "dataset": "synthetic",
    "data": {"classes": 4, "channels": 1, "size": 16, "train_per_class": 30, "test_per_class": 20, "noise": 0.2},
    "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}, "clients": 5,
    "client": {"model": "simplecnn", "epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
    "server": {"model": "simplecnn"},
    "methods": {"fedavg": {"rounds": 3, "sample_ratio": 0.6}, "moon": {"rounds": 3, "sample_ratio": 0.6}},
}


@pytest.mark.slow
def test_flower_sim_on_ray_workers_equals_hetfl_run(tmp_path: Path) -> None:
    import yaml

    cfg = tmp_path / "sim.yaml"
    cfg.write_text(yaml.safe_dump(copy.deepcopy(SIM)))
    assert main(["run", str(cfg), "--out", str(tmp_path / "run"), "--no-cache", "--quiet"]) == 0
    assert main(["flower", "sim", str(cfg), "--out", str(tmp_path / "sim"), "--workers", "2"]) == 0
    ref = json.loads((tmp_path / "run" / "summary.json").read_text())
    ours = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert ours["engine"]["runtime"] == "simulation" and ours["engine"]["workers"] == 2
    assert set(ours["results"]) == {"fedavg", "moon"}
    for name, result in ours["results"].items():
        assert result["accuracy"] == pytest.approx(ref["results"][name]["accuracy"], abs=1e-6), name
        assert result["tensor_bytes"] == ref["results"][name]["tensor_bytes"], name
        assert result["bytes_up"] == ref["results"][name]["bytes_up"] > 0, name
    from safetensors.torch import load_file

    for name in ("fedavg", "moon"):  # the models themselves, not only their accuracy
        mine, theirs = (load_file(root / name / f"{name}.safetensors") for root in (tmp_path / "sim", tmp_path / "run"))
        assert mine.keys() == theirs.keys() and all((mine[k] - theirs[k]).abs().max() <= 1e-6 for k in mine), name
    assert not ray.is_initialized()


@pytest.mark.slow
def test_hetfl_run_of_several_configs_on_ray_equals_them_one_after_another(tmp_path: Path, tiny_config, capsys) -> None:
    import yaml

    paths = []
    for name, alpha in (("a", 0.5), ("b", 1.0)):
        cfg = {**copy.deepcopy(tiny_config), "name": name, "partition": {"kind": "dirichlet", "alpha": alpha,
                                                                         "min_size": 5}}
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(cfg))
    args = [str(p) for p in paths] + ["--no-cache", "--quiet", "--methods", "fedavg"]
    assert main(["run", *args, "--out", str(tmp_path / "seq")]) == 0
    assert main(["run", *args, "--out", str(tmp_path / "ray"), "--ray", "local"]) == 0  # not another test's cluster
    for name in ("a", "b"):
        seq, ours = (json.loads((tmp_path / kind / name / "summary.json").read_text()) for kind in ("seq", "ray"))
        assert ours["results"]["fedavg"]["accuracy"] == seq["results"]["fedavg"]["accuracy"]
        assert ours["ray"]["node_id"] and list(ours["results"]) == ["fedavg"]
    assert "a (" in capsys.readouterr().out
    assert main(["run", str(paths[0]), str(paths[0]), "--out", str(tmp_path / "dup")]) == 2
    assert "configs share a name (a)" in capsys.readouterr().err
