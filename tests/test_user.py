"""Users' own data, models and code: image folders and array files, ``module:factory`` models, plugins that
register datasets, models and methods, and the Python API (tiny data written by the tests)."""

from __future__ import annotations

import copy
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import hetfl
from hetfl.cli import main
from hetfl.data import load_dataset
from tests.test_flower import task_identity  # noqa: F401  (a fixture: the fake Flower grid's task identity)

CLASSES = ("cat", "dog", "owl")


def write_folder(root: Path, size: int = 12, per_class: tuple[int, ...] = (14, 9, 6), test: int = 4,
                 mode: str = "L") -> Path:
    """Three classes of PNGs (unequal counts), each class a brightness band plus noise."""
    rng = np.random.default_rng(0)
    for split, counts in (("train", per_class), ("test", (test,) * len(per_class))):
        for c, (name, n) in enumerate(zip(CLASSES, counts)):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                base = 40 + 80 * c
                img = np.clip(base + rng.normal(0, 20, (size, size, 1 if mode == "L" else 3)), 0, 255)
                img = img.astype(np.uint8).squeeze(-1) if mode == "L" else img.astype(np.uint8)
                Image.fromarray(img, mode).save(folder / f"{i:03d}.png")
    return root


def write_npz(path: Path, nhwc: bool = True, floats: bool = False, **change: np.ndarray) -> Path:
    rng = np.random.default_rng(1)
    arrays = {}
    for split, n in (("train", 30), ("test", 12)):
        y = np.arange(n) % 3
        x = np.clip(40 + 80 * y[:, None, None, None] + rng.normal(0, 20, (n, 12, 12, 1)), 0, 255).astype(np.uint8)
        arrays[f"x_{split}"] = (x if nhwc else x.transpose(0, 3, 1, 2))
        if floats:
            arrays[f"x_{split}"] = arrays[f"x_{split}"].astype(np.float32) / 255
        arrays[f"y_{split}"] = y
    arrays["classes"] = np.array(CLASSES)
    arrays.update(change)
    np.savez(path, **arrays)
    return path


def user_config(dataset: dict | str, **methods: dict) -> dict:
    return {"name": "user", "seed": 0, "dataset": dataset,
            "partition": {"kind": "dirichlet", "alpha": 1.0, "min_size": 2}, "clients": 3,
            "client": {"model": "simplecnn", "epochs": 1, "batch_size": 8, "lr": 0.05},
            "server": {"model": "simplecnn"}, "methods": methods or {"fedavg": {"rounds": 2}}}


METHODS = {"fedavg": {"rounds": 2, "sample_ratio": 1.0},
           "kdia": {"rounds": 2, "gen_epochs": 1, "gen_batches": 2, "gen_batch_size": 8},
           "dense": {"epochs": 1, "generator_steps": 1, "batch_size": 8}}


def test_a_folder_reads_as_uint8_splits_with_sorted_classes_and_a_content_digest(tmp_path):
    root = write_folder(tmp_path / "pets")
    splits = load_dataset({"kind": "folder", "path": str(root)})
    assert splits.train.class_names == list(CLASSES) and splits.shape == (1, 12, 12)
    assert splits.train.label_counts().tolist() == [14, 9, 6] and len(splits.test) == 12
    again = load_dataset({"kind": "folder", "path": str(root), "channels": 3, "image_size": 8})
    assert again.shape == (3, 8, 8) and again.sha256 != splits.sha256
    Image.fromarray(np.zeros((12, 12), np.uint8), "L").save(root / "train" / "cat" / "000.png")
    assert load_dataset({"kind": "folder", "path": str(root)}).sha256 != splits.sha256  # contents count


def test_arrays_nhwc_nchw_and_floats_give_the_same_images(tmp_path):
    a = load_dataset({"kind": "arrays", "path": str(write_npz(tmp_path / "a.npz"))})
    b = load_dataset({"kind": "arrays", "path": str(write_npz(tmp_path / "b.npz", nhwc=False))})
    c = load_dataset({"kind": "arrays", "path": str(write_npz(tmp_path / "c.npz", floats=True))})
    assert a.shape == (1, 12, 12) and a.train.class_names == list(CLASSES)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.train.x, c.train.x)
    assert torch.equal(a.test.y, b.test.y)


@pytest.mark.parametrize(("kind", "make", "message"), [
    ("folder", lambda p: p, "dataset folder not found"),
    ("folder", lambda p: (write_folder(p), __import__("shutil").rmtree(p / "test"))[0], "split folder not found"),
    ("folder", lambda p: (write_folder(p), (p / "test" / "bat").mkdir(),
                          Image.fromarray(np.zeros((12, 12), np.uint8)).save(p / "test" / "bat" / "0.png"))[0],
     "class 'bat' is in test but not in"),
    ("folder", lambda p: (write_folder(p), (p / "train" / "emu").mkdir())[0], "class 'emu' has no images"),
    ("folder", lambda p: (write_folder(p), (p / "train" / "cat" / "notes.txt").write_text("x"))[0],
     "notes.txt: not an image file"),
    ("folder", lambda p: (write_folder(p), (p / "train" / "dog" / "bad.png").write_bytes(b"not a png"))[0],
     "bad.png: cannot read image"),
    ("folder", lambda p: (write_folder(p), Image.fromarray(np.zeros((10, 10), np.uint8)).save(
        p / "train" / "owl" / "small.png"))[0], "set dataset.image_size"),
    ("arrays", lambda p: p / "none.npz", "array file not found"),
    ("arrays", lambda p: write_npz(p.with_suffix(".npz"), y_test=np.array([0, 1, 5] * 4)), "outside 0..2"),
    ("arrays", lambda p: write_npz(p.with_suffix(".npz"), y_train=np.arange(29) % 3), "has 29 labels but"),
    ("arrays", lambda p: write_npz(p.with_suffix(".npz"), y_train=np.arange(30) % 2), "class 2 ('owl') has no "
     "training samples but appears in y_test"),
    ("arrays", lambda p: write_npz(p.with_suffix(".npz"), x_test=np.full((12, 12, 12), 2.0)), "outside [0, 1]"),
])
def test_bad_user_data_fails_before_training_with_one_line_and_exit_2(tmp_path, capsys, kind, make, message):
    path = make(tmp_path / "data")
    cfg = tmp_path / "cfg.json"  # YAML is a superset of JSON
    cfg.write_text(json.dumps(user_config({"kind": kind, "path": str(path)})))
    assert main(["run", str(cfg), "--out", str(tmp_path / "out"), "--quiet", "--no-cache"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and str(path.name) in err
    assert not (tmp_path / "out" / "fedavg").exists()


@pytest.mark.parametrize("spec", [{"kind": "folder"}, {"kind": "zip", "path": "x"}, {"kind": "arrays", "path": "x",
                                                                                      "channels": 1}])
def test_bad_dataset_keys_name_the_key(tmp_path, capsys, spec):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(user_config(spec)))
    assert main(["run", str(cfg), "--out", str(tmp_path / "out")]) == 2
    assert "dataset" in capsys.readouterr().err


def untimed(result: dict) -> dict:
    """A method's result without what the clock decides (seconds, timings, the cache's trained counts)."""
    return {k: untimed(v) if isinstance(v, dict) else v for k, v in result.items()
            if "seconds" not in k and k not in ("minutes", "cached_uploads", "timing")}


@pytest.mark.parametrize("kind", ["folder", "arrays"])
def test_user_data_runs_fedavg_kdia_and_dense_the_same_from_the_cli_and_from_python(tmp_path, kind):
    path = write_folder(tmp_path / "pets") if kind == "folder" else write_npz(tmp_path / "pets.npz")
    cfg = user_config({"kind": kind, "path": str(path)}, **copy.deepcopy(METHODS))
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert main(["run", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "cli"), "--quiet",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    result = hetfl.run(cfg, out=tmp_path / "api", cache_dir=None)
    cli = hetfl.load_run(tmp_path / "cli")
    assert result.methods == cli.methods == list(METHODS)
    for method in METHODS:  # identical but for the clock
        assert untimed(result.summary["results"][method]) == untimed(cli.summary["results"][method])
    assert result.summary["data"] == cli.summary["data"] and result.summary["clients"] == cli.summary["clients"]
    assert cli.summary["data"]["class_names"] == list(CLASSES) and cli.summary["data"]["sha256"]
    model = result.model("fedavg")
    assert model(torch.zeros(2, 1, 12, 12)).shape == (2, 3)


class Plain(nn.Module):
    """A user's model with forward only."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def plain(in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    return Plain(in_channels, image_size, num_classes)


def test_a_module_factory_runs_fedavg_and_dense_and_kdia_says_what_it_lacks(tmp_path, capsys):
    path = write_npz(tmp_path / "pets.npz")
    cfg = user_config({"kind": "arrays", "path": str(path)}, fedavg=METHODS["fedavg"], dense=METHODS["dense"])
    cfg["client"]["model"] = cfg["server"]["model"] = "tests.test_user:plain"
    result = hetfl.run(cfg, out=tmp_path / "ok", cache_dir=None)
    assert set(result.methods) == {"fedavg", "dense"} and result.accuracy("fedavg") is not None
    assert isinstance(result.model("dense"), Plain)
    cfg["methods"] = {"fedavg": METHODS["fedavg"], "kdia": METHODS["kdia"]}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert main(["run", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "bad"), "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "kdia needs models with extract, classify, feature_shape" in err and "lacks extract" in err
    assert "hetfl.models.HetflModel" in err and not (tmp_path / "bad" / "fedavg").exists()


@pytest.mark.parametrize(("model", "message"), [("tests.nowhere:net", "cannot import 'tests.nowhere'"),
                                                ("tests.test_user:nothing", "has no 'nothing'")])
def test_a_bad_factory_is_named(tmp_path, capsys, model, message):
    cfg = user_config("synthetic")
    cfg["client"]["model"] = model
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert main(["run", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "client.model" in err and message in err


PLUGIN = '''
    import hetfl
    from hetfl.data.synthetic import load_synthetic
    from hetfl.methods.fedavg import FedAvgRounds
    from torch import nn


    @hetfl.register_dataset("plugin_blobs")
    def blobs(root, classes=3):
        return load_synthetic(classes=classes, channels=1, size=12, train_per_class=20, test_per_class=8, seed=5)


    @hetfl.register_model("plugin_linear")
    def linear(in_channels, image_size, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, num_classes))


    @hetfl.register_method("plugin_avg")
    class PluginAvg(FedAvgRounds):
        """FedAvg under another name: a user's method."""
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "myplugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "myplugin"
    sys.modules.pop("myplugin", None)
    from hetfl.data import _REGISTERED
    from hetfl.fl.method import METHODS
    from hetfl.models import _REGISTRY

    _REGISTERED.pop("plugin_blobs", None)
    _REGISTRY.pop("plugin_linear", None)
    METHODS.pop("plugin_avg", None)


def test_a_plugin_registers_a_dataset_a_model_and_a_method(tmp_path, capsys, plugin):
    assert main(["list", "--plugin", plugin]) == 0
    listed = capsys.readouterr().out
    assert "plugin_blobs" in listed and "plugin_linear" in listed and "plugin_avg" in listed
    cfg = {**user_config("plugin_blobs", plugin_avg={"rounds": 2, "sample_ratio": 1.0},
                         fedavg={"rounds": 2, "sample_ratio": 1.0}), "plugins": [plugin]}
    cfg["client"]["model"] = cfg["server"]["model"] = "plugin_linear"
    result = hetfl.run(cfg, out=tmp_path / "run", cache_dir=None)
    assert result.accuracy("plugin_avg") == result.accuracy("fedavg")  # FedAvg under another name
    assert result.summary["results"]["plugin_avg"]["method"] == "plugin_avg"


def test_two_python_runs_in_one_process_equal_their_cli_runs(tmp_path, tiny_config):
    tiny_config["client"]["epochs"] = 1
    other = copy.deepcopy(tiny_config)
    other["seed"], other["simulator"] = 3, {"flush_denormal": True}
    from hetfl.host import flush_denormal_setting

    results = [hetfl.run(cfg, out=tmp_path / f"api{i}", cache_dir=None) for i, cfg in enumerate((tiny_config, other))]
    assert not flush_denormal_setting()  # the second run's setting did not outlive it
    for i, cfg in enumerate((tiny_config, other)):
        (tmp_path / f"c{i}.json").write_text(json.dumps(cfg))
        assert main(["run", str(tmp_path / f"c{i}.json"), "--out", str(tmp_path / f"cli{i}"), "--quiet",
                     "--no-cache"]) == 0
        cli = hetfl.load_run(tmp_path / f"cli{i}")
        assert [cli.accuracy(m) for m in cli.methods] == [results[i].accuracy(m) for m in results[i].methods]
    with pytest.raises(KeyError, match="it ran fedavg, ensemble"):
        results[0].accuracy("kdia")


@pytest.mark.parametrize(("script", "args"), [
    ("own_folder.py", lambda p: [str(write_folder(p / "pets", per_class=(20, 14, 12))), "--clients", "3",
                                 "--rounds", "1", "--set", "methods.kdia.gen_epochs=1",
                                 "--set", "methods.kdia.gen_batches=2"]),
    ("own_model.py", lambda p: ["--dataset", str(write_npz(p / "pets.npz")), "--clients", "3", "--epochs", "1",
                                "--set", "methods.dense.generator_steps=2", "--set", "methods.dense.batch_size=16"]),
])
def test_the_examples_run(tmp_path, script, args):
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(repo / "examples" / script), *args(tmp_path), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out" / "summary.json").is_file() and "fedavg" in done.stdout


PLAIN_METHODS = {
    "fedprox": {"rounds": 1}, "fedavgm": {"rounds": 1}, "feddisco": {"rounds": 1}, "fedgkd": {"rounds": 1},
    "fedcog": {"rounds": 1, "start_round": 1}, "fedseq": {"rounds": 1, "clusters": 1},
    "hfldd": {"rounds": 1, "aux_size": 20, "pretrain_epochs": 1, "distilled_size": 4, "kip_steps": 1, "clusters": 2},
    "dynafed": {"rounds": 2, "trajectory_rounds": 1, "syn_iterations": 1, "ipc": 1, "expert_epochs": 1,
                "syn_steps": 1, "distill_iter": 1},
    "feddf": {"steps": 2}, "ensemble": {}, "coboosting": {"epochs": 1, "generator_steps": 1},
    "fedhydra": {"epochs": 1, "generator_steps": 1, "batch_size": 16},
    "fedmho_md": {"cvae_epochs": 1, "num_samples": 40, "epochs": 1}, "central": {},
}


def test_a_plain_module_runs_every_method_that_needs_only_forward(tmp_path, tiny_config):
    cfg = {**tiny_config, "methods": copy.deepcopy(PLAIN_METHODS)}
    cfg["client"] = {**cfg["client"], "model": "tests.test_user:plain", "epochs": 1}
    cfg["server"] = {"model": "tests.test_user:plain"}
    result = hetfl.run(cfg, out=tmp_path, cache_dir=None)
    assert result.methods == list(PLAIN_METHODS)
    assert all(0 <= result.accuracy(m) <= 100 for m in PLAIN_METHODS)


@pytest.mark.usefixtures("task_identity")
def test_a_plugin_method_on_a_users_array_file_runs_on_flower_as_in_the_simulator(tmp_path, plugin):
    from hetfl.methods.checks import validate
    from tests.test_flower import assert_same_results, serve, simulate

    cfg = {**user_config({"kind": "arrays", "path": str(write_npz(tmp_path / "pets.npz"))},
                         plugin_avg={"rounds": 2, "sample_ratio": 1.0}), "plugins": [plugin]}
    cfg["client"]["model"] = cfg["server"]["model"] = "plugin_linear"
    cfg = validate(cfg)
    flower = serve(cfg, tmp_path / "fl")
    assert flower["engine"]["name"] == "flower" and set(flower["results"]) == {"plugin_avg"}
    assert_same_results(flower, simulate(cfg, tmp_path / "sim"))


# ---- Flower SuperNodes that serve their own folders -------------------------------------------------
NODE_COUNTS = ({"cat": 9, "dog": 4}, {"dog": 6, "owl": 7}, {"cat": 3, "owl": 8})


def write_node(root: Path, counts: dict[str, int]) -> Path:
    """A node's own data: root/train/<class>/*.png, some of the run's classes."""
    rng = np.random.default_rng(len(counts) + sum(counts.values()))
    for name, n in counts.items():
        folder = root / "train" / name
        folder.mkdir(parents=True, exist_ok=True)
        base = 40 + 80 * (CLASSES.index(name) if name in CLASSES else 1)
        for i in range(n):
            img = np.clip(base + rng.normal(0, 20, (12, 12)), 0, 255).astype(np.uint8)
            Image.fromarray(img, "L").save(folder / f"{i:03d}.png")
    return root


def node_data_config(tmp_path: Path, **changes: object) -> dict:
    """A run whose server holds only a test folder (three classes) and whose nodes serve their own data."""
    server = write_folder(tmp_path / "server")
    __import__("shutil").rmtree(server / "train")
    cfg = user_config({"kind": "folder", "path": str(server)}, fedavg={"rounds": 2, "sample_ratio": 1.0},
                      kdia=METHODS["kdia"])
    cfg["flower"] = {"node_data": True, "timeout": 60, "node_wait": 1}
    cfg.update(changes)
    return cfg


def serve_nodes(cfg: dict, folders: list[Path], out: Path) -> dict:
    from flwr.app import Context, RecordDict

    from hetfl.engine import flower_app as fa
    from hetfl.methods.checks import validate
    from tests.test_flower import FakeGrid

    cfg = validate(cfg)
    grid = FakeGrid(cfg)
    for nid, folder in zip(sorted(grid.contexts), folders):
        grid.contexts[nid].node_config = {"data-dir": str(folder)}
    fa.server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                 run_config={"hetfl-config": json.dumps(cfg), "out-dir": str(out)}))
    return json.loads((out / "summary.json").read_text())


@pytest.mark.usefixtures("task_identity")
def test_supernodes_serving_their_own_folders_train_and_report_their_true_label_histograms(tmp_path):
    folders = [write_node(tmp_path / f"node{i}", counts) for i, counts in enumerate(NODE_COUNTS)]
    summary = serve_nodes(node_data_config(tmp_path), folders, tmp_path / "out")
    served = summary["engine"]["node_data"]
    for cid, counts in enumerate(NODE_COUNTS):
        assert served[str(cid)]["label_counts"] == [counts.get(c, 0) for c in CLASSES]
        assert served[str(cid)]["num_samples"] == sum(counts.values())
    assert set(summary["results"]) == {"fedavg", "kdia"} and summary["data"]["test"] == 12
    assert not summary["results"]["kdia"].get("missing_clients")


@pytest.mark.usefixtures("task_identity")
def test_a_node_with_a_class_the_run_lacks_is_refused_and_min_clients_decides(tmp_path):
    folders = [write_node(tmp_path / f"node{i}", counts) for i, counts in enumerate(NODE_COUNTS[:2])]
    folders.append(write_node(tmp_path / "stray", {"cat": 4, "bat": 5}))
    summary = serve_nodes(node_data_config(tmp_path, methods={"ensemble": {}}), folders, tmp_path / "goes-on")
    (reason,) = summary["engine"]["refused_nodes"].values()
    assert "class 'bat' is not among the run's classes (cat, dog, owl)" in reason and "stray" in reason
    assert summary["engine"]["missing_nodes"] == [2] and "ensemble" in summary["results"]
    with pytest.raises(RuntimeError, match="min_clients = 3"):
        serve_nodes(node_data_config(tmp_path, methods={"ensemble": {}}, min_clients=3), folders, tmp_path / "stops")


def test_node_data_takes_no_validation_share(tmp_path, capsys):
    (tmp_path / "cfg.json").write_text(json.dumps({**node_data_config(tmp_path), "validation": 0.1}))
    assert main(["run", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "out")]) == 2
    assert "no validation share" in capsys.readouterr().err


@pytest.mark.slow
def test_flower_local_with_client_data_folders_runs_fedavg_and_kdia_over_tls(tmp_path, capsys):
    """Real SuperLink and SuperNodes on 127.0.0.1: one per folder, one of them with a class the run lacks."""
    folders = [write_node(tmp_path / f"node{i}", counts) for i, counts in enumerate(NODE_COUNTS[:2])]
    folders.append(write_node(tmp_path / "stray", {"cat": 4, "bat": 5}))
    cfg = node_data_config(tmp_path, methods={"fedavg": {"rounds": 1, "sample_ratio": 1.0},
                                              "kdia": {**METHODS["kdia"], "rounds": 1, "sample_ratio": 1.0}})
    cfg["flower"] = {"timeout": 120, "node_wait": 60}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert main(["flower", "local", str(tmp_path / "cfg.json"), "--tls", "--out", str(tmp_path / "o"),
                 "--client-data", ",".join(map(str, folders))]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["engine"]["tls"] is True and set(summary["results"]) == {"fedavg", "kdia"}
    served = summary["engine"]["node_data"]
    assert [served[str(c)]["label_counts"] for c in range(2)] == [[n.get(c, 0) for c in CLASSES]
                                                                  for n in NODE_COUNTS[:2]]
    (reason,) = summary["engine"]["refused_nodes"].values()
    assert "class 'bat' is not among the run's classes" in reason and summary["engine"]["missing_nodes"] == [2]
    assert {f["client"] for f in summary["results"]["fedavg"]["client_failures"]} == {2}


def test_hetfl_partition_divides_what_a_run_divides(tmp_path, capsys):
    cfg = {**user_config({"kind": "arrays", "path": str(write_npz(tmp_path / "pets.npz"))}), "validation": 0.2}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert main(["partition", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "part")]) == 0
    from hetfl.engine.simulator import prepare
    from hetfl.methods.checks import validate

    exp = prepare(validate(cfg))
    assert json.loads((tmp_path / "part" / "partition.json").read_text())["counts"] == exp.partition.counts.tolist()
