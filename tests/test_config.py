import pytest
import yaml

from hetfl.config import ConfigError, apply_overrides, client_archs
from hetfl.methods.checks import load_config, validate


def write(tmp_path, cfg):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_defaults_are_filled(tiny_config):
    cfg = validate(tiny_config)
    assert cfg["device"] == "auto" and cfg["eval_every"] == 1 and cfg["data_root"] == "data"
    assert cfg["methods"] == {"fedavg": {}, "ensemble": {}}


def test_set_overrides_any_key_with_yaml_types(tmp_path, tiny_config):
    cfg = load_config(write(tmp_path, tiny_config), ["client.epochs=7", "partition.alpha=0.1",
                                                    "methods.fedavg.rounds=3", "client.model=[cnn2, lenet5]"])
    assert cfg["client"]["epochs"] == 7 and isinstance(cfg["client"]["epochs"], int)
    assert cfg["partition"]["alpha"] == 0.1
    assert cfg["methods"]["fedavg"] == {"rounds": 3}
    assert client_archs(cfg) == ["cnn2", "lenet5", "cnn2"]


def test_exponent_floats_without_a_dot_are_numbers_in_files_and_overrides(tmp_path, tiny_config):
    path = tmp_path / "c.yaml"  # PyYAML alone reads `1e-5` as a string (YAML 1.1 wants `1.0e-5`)
    path.write_text(yaml.safe_dump({k: v for k, v in tiny_config.items() if k != "client"})
                    + "client: {model: cnn2, weight_decay: 1e-5}\n")
    cfg = load_config(path, ["client.lr=5E-3"])
    assert cfg["client"]["weight_decay"] == 1e-5 and cfg["client"]["lr"] == 5e-3
    assert load_config(path, ["name=1e5x"])["name"] == "1e5x"  # not a number: stays a string


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("bogus=1", "unknown key 'bogus'"),
        ("client.epochz=1", r"client: unknown key\(s\) \['epochz'\]"),
        ("dataset=imagenet", "unknown 'imagenet'; choose one of: mnist, fmnist"),
        ("client.model=resnet999", "unknown model 'resnet999'; choose one of: cnn2"),
        ("server.model=nope", "server.model: unknown model 'nope'"),
        ("partition.kind=shards", "unknown partition kind 'shards'; choose one of: iid, dirichlet"),
        ("partition.alpha=0", "'alpha' must be a number > 0"),
        ("partition.beta=1", "does not take"),
        ("methods.fedavg.mu=1", "methods.fedavg.mu: unknown key; valid: init, rounds, sample_ratio"),
        ("methods.fedavg.rounds=0", "rounds must be a positive integer"),
        ("methods.nope={}", "unknown method 'nope'; choose one of: central, coboosting, dense, dynafed, ensemble"),
        ("clients=0", "clients: 0: must be >= 1"),
        ("client.lr=-1", "client.lr: -1: must be > 0"),
        ("client.precision=fp8", "client.precision: 'fp8': must be one of 'fp32' or 'bf16'"),
        ("eval_every=0", "eval_every: 0: must be >= 1"),
        ("device=gpu", "device: 'gpu' is not one of auto, cpu, cuda, cuda:N, mps"),
        ("device=cuda:x", "device: 'cuda:x' is not one of"),
    ],
)
def test_bad_configs_fail_with_the_documented_message(tmp_path, tiny_config, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, tiny_config), [override])


def test_missing_required_keys_and_files(tmp_path, tiny_config):
    del tiny_config["methods"]
    with pytest.raises(ConfigError, match="'methods' is required"):
        load_config(write(tmp_path, tiny_config))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["noequals"])


def test_shipped_configs_are_valid():
    from pathlib import Path

    configs = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
    assert configs, "the repository ships example configs"
    for path in configs:
        load_config(path)


def test_a_device_this_machine_lacks_fails_before_any_data_is_loaded(monkeypatch, tiny_config, tmp_path):
    import torch

    from hetfl.engine.experiment import prepare, resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("hetfl.engine.experiment.load_dataset", lambda *a: pytest.fail("data loaded"))
    cfg = load_config(write(tmp_path, tiny_config), ["device=cuda"])
    with pytest.raises(ConfigError, match="device: 'cuda' asked for, but torch .* sees no CUDA GPU here"):
        prepare(cfg)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="'cuda:1' asked for, but this machine has 1 CUDA device"):
        resolve_device("cuda:1")
    with pytest.raises(ConfigError, match="'gpu' is not one of"):
        resolve_device("gpu")


def test_a_label_whose_method_is_unknown_fails_with_the_list_of_methods(tiny_config):
    tiny_config["methods"] = {"mine": {"method": "fedavgg"}}
    with pytest.raises(ConfigError, match=r"methods.mine: unknown method 'fedavgg'; choose one of: central, "
                                          r"coboosting, .* \(presets: fedhydra_dense, "):
        validate(tiny_config)
    tiny_config["methods"] = {"a": {"method": "dense", "epochs": 2}, "b": {"method": "dense", "epochs": 3}}
    assert validate(tiny_config)["methods"]["b"] == {"method": "dense", "epochs": 3}


@pytest.mark.parametrize(("override", "line"), [
    ("client.epochs=ten", "client.epochs: 'ten': input should be a valid integer"),
    ("client.lr=fast", "client.lr: 'fast': input should be a valid number"),
    ("client.lr=-0.05", "client.lr: -0.05: must be > 0"),
    ("client.batch_size=0", "client.batch_size: 0: must be >= 1"),
    ("client.epochs=0", "client.epochs: 0: must be >= 1"),
    ("client.momentum=high", "client.momentum: 'high': input should be a valid number"),
    ("methods.dense.epochs=ten", "methods.dense.epochs: 'ten': input should be a valid integer"),
    ("methods.central.client.epochs=ten", "methods.central.client.epochs: 'ten': input should be a valid integer"),
    ("methods.dense.lr=-1", "methods.dense.lr: -1: must be > 0"),
    ("methods.feddf.steps=-5", "methods.feddf.steps: -5: must be >= 1"),
    ("methods.dense.nope=1", "methods.dense.nope: unknown key; valid: "),
    ("flower.timeout=0", "flower.timeout: 0: must be > 0"),
    ("simulator.batch_clients=often", "simulator.batch_clients: 'often': input should be a valid boolean"),
])
def test_a_bad_value_fails_before_any_data_loads_with_one_line_naming_key_value_and_range(
        tmp_path, tiny_config, capsys, override, line):
    """The data root does not exist: a check that ran after loading would fail on the data instead."""
    import yaml

    from hetfl.cli import main

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**tiny_config, "dataset": "mnist", "data": {},
                                    "methods": {"dense": {}, "central": {}, "feddf": {}}}))
    assert main(["run", str(path), "--data-root", str(tmp_path / "no-data"), "--set", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hetfl: error: {line}"), err
