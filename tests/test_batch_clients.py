"""Batched client training (``simulator.batch_clients``): several clients as one vectorised network."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from hetfl.config import ConfigError
from hetfl.data.base import ImageDataset
from hetfl.engine.simulator import Simulator, config_hash, prepare
from hetfl.fl.client import ClientEnv, group_key, handle, handle_group, train_message
from hetfl.fl.train_config import TrainConfig
from hetfl.fl.training import clip_per_client, counting_sample_passes, local_train, local_train_group
from hetfl.methods.checks import validate
from hetfl.models import build_model


def client_data(synthetic: ImageDataset, k: int, size: int | list[int]) -> list[ImageDataset]:
    g = torch.Generator().manual_seed(7)
    order = torch.randperm(len(synthetic), generator=g)
    sizes = size if isinstance(size, list) else [size] * k
    starts = [sum(sizes[:i]) for i in range(k)]
    return [synthetic.subset(order[a:a + n]) for a, n in zip(starts, sizes)]


def fresh(arch: str, k: int) -> list[nn.Module]:
    models = []
    for i in range(k):
        torch.manual_seed(100 + i)
        models.append(build_model(arch, 1, 16, 4))
    return models


@pytest.mark.parametrize("arch", ["cnn2", "lenet5"])  # with BatchNorm (running statistics) and without
@pytest.mark.parametrize("sizes", [[50, 50, 50], [50, 37, 64]])  # 3 x 16 + 2; 2 x 16 + 5; 4 x 16
def test_group_training_equals_one_client_at_a_time(synthetic_small, arch, sizes):
    datas = client_data(synthetic_small.train, 3, sizes)
    # lr 0.01: at 0.05 this tiny BN net amplifies float-order noise to 1e-3 within two epochs, as much
    # between two one-client runs that differ only in memory layout
    cfg = TrainConfig(epochs=2, batch_size=16, lr=0.01, momentum=0.9, weight_decay=1e-4, channels_last=False)
    alone, grouped = fresh(arch, 3), fresh(arch, 3)
    losses, passes = [], []
    for m, d, s in zip(alone, datas, (1, 2, 3)):
        with counting_sample_passes() as meter:
            losses.append(local_train(m, d, cfg, torch.device("cpu"), seed=s)["loss"])
        passes.append(meter[0])
    with counting_sample_passes() as meter:
        stats = local_train_group(grouped, datas, cfg, torch.device("cpu"), seeds=[1, 2, 3])
    assert [s["loss"] for s in stats] == pytest.approx(losses, rel=1e-4)
    assert [meter[k] for k in range(3)] == passes == [2 * n for n in sizes]  # each client under its index
    for a, b in zip(alone, grouped):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for name in sa:  # parameters and BN running statistics, each client its own
            torch.testing.assert_close(sb[name], sa[name], rtol=1e-4, atol=1e-5)
        assert all(p.is_contiguous() for p in b.parameters())
    # the clients really differ (not one model trained thrice)
    w = [m.state_dict()[next(iter(m.state_dict()))] for m in grouped]
    assert not torch.allclose(w[0], w[1])


def test_per_client_clipping_equals_clip_grad_norm():
    torch.manual_seed(0)
    grads = [torch.randn(3, 4, 5) * 3, torch.randn(3, 7)]
    stacked = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(stacked, grads):
        p.grad = g.clone()
    clip_per_client(stacked, 2.0)
    for k in range(3):
        ref = [nn.Parameter(torch.zeros_like(g[k])) for g in grads]
        for p, g in zip(ref, grads):
            p.grad = g[k].clone()
        nn.utils.clip_grad_norm_(ref, 2.0)
        for p, r in zip(stacked, ref):
            torch.testing.assert_close(p.grad[k], r.grad)


def test_group_training_errors(synthetic_small):
    datas = client_data(synthetic_small.train, 2, 40)
    cfg = TrainConfig(epochs=1, batch_size=16)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="non-empty dataset"):
        local_train_group(fresh("cnn2", 2), [datas[0], datas[1].subset(torch.arange(0))], cfg, cpu, [1, 2])
    with pytest.raises(ValueError, match="one architecture"):
        local_train_group([*fresh("cnn2", 1), *fresh("lenet5", 1)], datas, cfg, cpu, [1, 2])
    with pytest.raises(ValueError, match="one dataset and one seed"):
        local_train_group(fresh("cnn2", 2), datas, cfg, cpu, [1])


def test_group_task_stamps_uploads_like_one_client_and_groups_only_what_can(synthetic_small):
    datas = client_data(synthetic_small.train, 3, 40)
    cfg = TrainConfig(epochs=1, batch_size=16, channels_last=False)
    envs = [ClientEnv(i, d, torch.device("cpu")) for i, d in enumerate(datas)]
    messages = [train_message("cnn2", (1, 16, 16), 4, cfg, init_seed=5 + i, seed=9 + i) for i in range(3)]
    assert len({group_key(m, e) for m, e in zip(messages, envs)}) == 1
    uploads = handle_group(messages, envs)
    singles = [handle(m, e) for m, e in zip(messages, envs)]
    for up, one in zip(uploads, singles):
        assert {k: v for k, v in up.meta.items() if k != "train_loss"} == \
            {k: v for k, v in one.meta.items() if k != "train_loss"}
        for name in one.tensors:
            torch.testing.assert_close(up.tensors[name], one.tensors[name], rtol=1e-4, atol=2e-5)
    # what cannot join a group: a request with weights (a multi-round step), another size or config
    with_weights = train_message("cnn2", (1, 16, 16), 4, cfg, 5, 9, weights=singles[0].tensors)
    assert group_key(with_weights, envs[0]) is None
    small = ClientEnv(3, datas[0].subset(torch.arange(20)), torch.device("cpu"))
    assert group_key(messages[0], small) == group_key(messages[0], envs[0])  # sizes may differ
    other = train_message("cnn2", (1, 16, 16), 4, TrainConfig(epochs=2, batch_size=16), 5, 9)
    assert group_key(other, envs[0]) != group_key(messages[0], envs[0])
    with pytest.raises(ValueError, match="one group key"):
        handle_group([messages[0], other], envs[:2])


def test_simulator_batches_equal_clients_and_caches_them_apart(tmp_path, tiny_config):
    cfg = copy.deepcopy(tiny_config)
    cfg["partition"] = {"kind": "iid"}  # 3 clients of 160 / 3: sizes 54, 53, 53, one batch of three
    cfg["client"]["channels_last"] = False
    cache = tmp_path / "cache"
    plain = Simulator(prepare(validate(cfg)), tmp_path / "a", cache, quiet=True).run()
    cfg["simulator"] = {"batch_clients": True}
    batched = Simulator(prepare(validate(cfg)), tmp_path / "b", cache, quiet=True).run()
    assert batched["engine"] == {"name": "simulator", "batch_clients": True}
    assert plain["engine"] == {"name": "simulator"}
    assert batched["config"]["simulator"] == {"batch_clients": True, "flush_denormal": False, "state_memory_mb": 2048.0}
    assert batched["results"]["fedavg"]["cached_uploads"] == 0  # keyed apart from one-at-a-time uploads
    assert len(list(cache.rglob("*.safetensors"))) == 6
    infos = [json.loads(p.read_text()) for p in cache.rglob("*.json")]
    assert sorted(i["fingerprint"].get("batched", False) for i in infos) == [False] * 3 + [True] * 3
    # the same functions up to float order: the ensemble of the uploads predicts alike
    assert batched["results"]["ensemble"]["accuracy"] == pytest.approx(plain["results"]["ensemble"]["accuracy"],
                                                                       abs=2.0)
    again = Simulator(prepare(validate(cfg)), tmp_path / "c", cache, quiet=True).run()
    assert again["results"]["fedavg"]["cached_uploads"] == 3
    assert again["results"]["fedavg"]["uploads_sha256"] == batched["results"]["fedavg"]["uploads_sha256"]


def test_simulator_config_key(tiny_config):
    cfg = validate(copy.deepcopy(tiny_config))
    assert cfg["simulator"] == {"batch_clients": False, "flush_denormal": False, "state_memory_mb": 2048.0}
    # the defaults leave the resume hashes of earlier runs as they were
    earlier = {k: v for k, v in cfg.items() if k != "simulator"}
    assert config_hash(cfg, "fedavg") == config_hash(earlier, "fedavg")
    batched = config_hash({**cfg, "simulator": {"batch_clients": True}}, "fedavg")
    assert batched != config_hash(cfg, "fedavg")
    # ... and the hashes of earlier batched runs (whose simulator setting had one key) too
    assert config_hash({**cfg, "simulator": {"batch_clients": True, "flush_denormal": False}}, "fedavg") == batched
    assert config_hash({**cfg, "simulator": {"batch_clients": False, "flush_denormal": True}},
                       "fedavg") != config_hash(cfg, "fedavg")
    for key in ("batch_clients", "flush_denormal"):
        with pytest.raises(ConfigError, match=f"simulator.{key}: .*: input should be a valid boolean"):
            validate({**copy.deepcopy(tiny_config), "simulator": {key: "yes"}})
    with pytest.raises(ConfigError, match="simulator"):
        validate({**copy.deepcopy(tiny_config), "simulator": {"batch": True}})


def test_group_training_in_bf16_autocast_tracks_fp32_weights(synthetic_small):
    """bf16 autocast over the vectorised forward: the stacked weights stay fp32, the losses stay
    near the one-at-a-time bf16 run's (other rounding, same training)."""
    datas = client_data(synthetic_small.train, 2, 48)
    cfg = TrainConfig(epochs=2, batch_size=16, lr=0.01, precision="bf16", channels_last=False)
    alone, grouped = fresh("lenet5", 2), fresh("lenet5", 2)
    losses = [local_train(m, d, cfg, torch.device("cpu"), seed=s)["loss"] for m, d, s in zip(alone, datas, (1, 2))]
    stats = local_train_group(grouped, datas, cfg, torch.device("cpu"), seeds=[1, 2])
    assert [s["loss"] for s in stats] == pytest.approx(losses, rel=0.05)
    assert all(p.dtype == torch.float32 for m in grouped for p in m.parameters())


def test_flushed_subnormals_cache_their_uploads_apart(tmp_path, tiny_config, monkeypatch):
    """``simulator.flush_denormal``: other bits, so other cache keys; the flag itself is process-wide and
    tested in a fresh interpreter (test_host.py, test_cli.py), so here it is only recorded as asked."""
    import hetfl.engine.uploads as uploads

    asked: list[bool] = []
    monkeypatch.setattr(uploads, "flush_denormals", lambda: asked.append(True) or True)
    monkeypatch.setattr(uploads, "flush_denormal_setting", lambda: bool(asked))  # on once asked for
    cfg = copy.deepcopy(tiny_config)
    cache = tmp_path / "cache"
    plain = Simulator(prepare(validate(cfg)), tmp_path / "a", cache, quiet=True).run()
    assert asked == []
    cfg["simulator"] = {"flush_denormal": True}
    flushed = Simulator(prepare(validate(cfg)), tmp_path / "b", cache, quiet=True).run()
    assert asked == [True]
    assert plain["results"]["fedavg"]["cached_uploads"] == 0 and flushed["results"]["fedavg"]["cached_uploads"] == 0
    infos = [json.loads(p.read_text()) for p in cache.rglob("*.json")]
    assert sorted(i["fingerprint"].get("flush_denormal", False) for i in infos) == [False] * 3 + [True] * 3
    # the process stays flushed: a later run that does not ask is keyed as flushed too
    cfg["simulator"] = {}
    later = Simulator(prepare(validate(cfg)), tmp_path / "l", cache, quiet=True).run()
    assert later["results"]["fedavg"]["cached_uploads"] == 3
    assert later["results"]["fedavg"]["uploads_sha256"] == flushed["results"]["fedavg"]["uploads_sha256"]
    monkeypatch.setattr(uploads, "flush_denormals", lambda: False)  # a CPU that cannot
    cfg["simulator"] = {"flush_denormal": True}
    with pytest.raises(ConfigError, match="cannot flush subnormal"):
        Simulator(prepare(validate(cfg)), tmp_path / "c", cache, quiet=True)
