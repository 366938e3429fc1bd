import warnings

import pytest
import torch

from hetfl.fl import training
from hetfl.fl.method import derive_seed, sample_clients
from hetfl.fl.training import TrainConfig, accuracy_report, evaluate, local_train, minibatches
from hetfl.models import build_model

CPU = torch.device("cpu")


def train(data, seed=0, epochs=4, **kw):
    torch.manual_seed(1)
    model = build_model("cnn2", 1, 16, data.num_classes)
    local_train(model, data, TrainConfig(epochs=epochs, batch_size=32, lr=0.05, **kw), CPU, seed=seed)
    return model


def test_local_training_on_synthetic_beats_chance_by_a_wide_margin(synthetic_small):
    model = train(synthetic_small.train)
    report = evaluate(model, synthetic_small.test, CPU)
    assert report["accuracy"] > 80.0  # chance is 25 %
    assert len(report["per_class"]) == 4 and all(p is not None for p in report["per_class"])


def test_same_seed_same_weights_different_seed_different(synthetic_small):
    a, b, c = (train(synthetic_small.train, seed=s, epochs=1) for s in (5, 5, 6))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


def test_channels_last_and_fp32_agree(synthetic_small):
    a = train(synthetic_small.train, epochs=1, channels_last=True)
    b = train(synthetic_small.train, epochs=1, channels_last=False)
    x = synthetic_small.test.batch(torch.arange(20))[0]
    with torch.no_grad():
        assert torch.allclose(a.eval()(x), b.eval()(x), atol=1e-3)


def test_accuracy_report_values():
    logits = torch.tensor([[2.0, 0, 0], [0, 2.0, 0], [2.0, 0, 0], [0, 0, 2.0]])
    labels = torch.tensor([0, 1, 1, 2])
    rep = accuracy_report(logits, labels, 4)
    assert rep["accuracy"] == 75.0
    assert rep["per_class"] == [100.0, 50.0, 100.0, None]


def test_minibatches_cover_every_index_once_and_drop_singletons():
    g = torch.Generator().manual_seed(0)
    batches = list(minibatches(65, 32, g))
    assert [len(b) for b in batches] == [32, 32]  # the lone 65th sample is dropped (BatchNorm)
    assert len(torch.cat(batches).unique()) == 64
    assert sum(len(b) for b in minibatches(66, 32, g)) == 66


def test_client_sampling_is_seeded_and_sized():
    a = sample_clients(100, 0.1, round_=3, seed=0)
    assert a == sample_clients(100, 0.1, round_=3, seed=0)
    assert len(a) == 10 and len(set(a)) == 10 and a == sorted(a)
    assert a != sample_clients(100, 0.1, round_=4, seed=0)
    assert sample_clients(5, 0.01, 1, 0).__len__() == 1
    assert derive_seed(0, "x") == derive_seed(0, "x") != derive_seed(1, "x")


def test_bf16_on_a_device_that_emulates_it_warns_once_and_fp32_never(monkeypatch):
    monkeypatch.setattr(training, "bf16_native", lambda device_type: False)
    monkeypatch.setattr(training, "_WARNED_EMULATED", set())
    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with training.autocast(cpu, "fp32"):
            pass
    with pytest.warns(RuntimeWarning, match="without native bf16 kernels.*Use precision fp32"), \
            training.autocast(cpu, "bf16"):
        assert torch.is_autocast_enabled("cpu")
    with warnings.catch_warnings():  # once per process: a training loop does not repeat it per batch
        warnings.simplefilter("error")
        with training.autocast(cpu, "bf16"):
            pass


def test_bf16_where_native_does_not_warn(monkeypatch):
    monkeypatch.setattr(training, "bf16_native", lambda device_type: True)
    monkeypatch.setattr(training, "_WARNED_EMULATED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with training.autocast(torch.device("cpu"), "bf16"):
            pass


def test_bf16_native_is_false_on_a_cpu_without_avx512():
    native = training.bf16_native("cpu")
    assert isinstance(native, bool)
    if not torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX")):
        assert not native  # e.g. an AVX2 CPU: oneDNN has no bf16 kernels for it


def test_predict_logits_with_a_progress_wrapper_sees_every_batch_and_gives_the_same_logits(synthetic_small):
    model = build_model("cnn2", 1, 16, 4)
    seen: list[int] = []

    def wrap(starts):
        for s in starts:
            seen.append(s)
            yield s

    plain = training.predict_logits(model, synthetic_small.test, CPU, batch_size=7)
    wrapped = training.predict_logits(model, synthetic_small.test, CPU, batch_size=7, progress=wrap)
    assert torch.equal(plain, wrapped)
    assert seen == list(range(0, len(synthetic_small.test), 7))
