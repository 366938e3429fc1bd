import signal
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from hetfl.fl import precision, training
from hetfl.fl.checkpoint import TrainCheckpoint, load_momentum, momentum_tensors
from hetfl.fl.method import derive_seed, sample_clients
from hetfl.fl.payload import Payload
from hetfl.fl.train_config import TrainConfig
from hetfl.fl.training import (
    accuracy_report,
    count_sample_passes,
    counting_sample_passes,
    evaluate,
    local_train,
    minibatches,
)
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


def test_a_config_that_names_no_momentum_gets_none():
    """PyTorch's SGD, FL-bench and PFLlib default to 0: momentum is something a config asks for."""
    assert TrainConfig().momentum == 0.0 and TrainConfig.checked({"lr": 0.01}).momentum == 0.0
    assert TrainConfig.checked({"lr": 0.01}).optimiser() == {"lr": 0.01, "momentum": 0.0, "weight_decay": 0.0}


@pytest.mark.parametrize(("n", "steps", "expected_epochs"), [(100, 10, 3), (100, 7, 2), (30, 10, 10), (65, 5, 3)])
def test_steps_take_that_many_minibatch_steps_over_the_epochs_they_need(synthetic_small, n, steps, expected_epochs):
    data = synthetic_small.train.subset(torch.arange(n))
    cfg = TrainConfig(epochs=1, batch_size=32, lr=0.05, steps=steps)
    assert cfg.epochs_needed(n) == expected_epochs  # 65 at 32: two batches an epoch (the lone 65th is dropped)
    model = build_model("cnn2", 1, 16, data.num_classes)
    taken = []
    real_step = torch.optim.SGD.step
    torch.optim.SGD.step = lambda self, *a, **k: (taken.append(1), real_step(self, *a, **k))[1]
    try:
        local_train(model, data, cfg, CPU, seed=0)
    finally:
        torch.optim.SGD.step = real_step
    assert len(taken) == steps


def slow_sample_passes(n: int, batch_size: int, epochs: int, steps: int | None = None) -> int:
    """The samples of every step, step by step: whole batches, a trailing one of fewer than 2 dropped."""
    sizes = [min(batch_size, n - start) for start in range(0, n, batch_size)]
    sizes = [s for s in sizes if s >= min(2, n)]
    taken = [s for _ in range(epochs if steps is None else steps) for s in sizes]  # steps: as many epochs as needed
    return sum(taken[:steps] if steps is not None else taken)


@pytest.mark.parametrize(("n", "epochs", "steps"), [(100, 2, None), (65, 3, None), (100, 1, 7), (30, 1, 10)])
def test_sample_passes_count_the_samples_of_every_step(synthetic_small, n, epochs, steps):
    data = synthetic_small.train.subset(torch.arange(n))
    cfg = TrainConfig(epochs=epochs, batch_size=32, lr=0.05, steps=steps)
    with counting_sample_passes() as outer:
        with counting_sample_passes() as inner:
            local_train(build_model("cnn2", 1, 16, data.num_classes), data, cfg, CPU, seed=0)
        count_sample_passes(5, slot=2)
    assert inner == {0: slow_sample_passes(n, 32, epochs, steps)}
    assert outer == {0: inner[0], 2: 5}  # the inner block's count adds to the outer one
    count_sample_passes(1)  # outside any block: nothing to count into, no error


def test_steps_equal_to_whole_epochs_give_the_epochs_bits(synthetic_small):
    data = synthetic_small.train.subset(torch.arange(64))  # two batches of 32 an epoch
    a, b = (build_model("cnn2", 1, 16, data.num_classes) for _ in range(2))
    b.load_state_dict(a.state_dict())
    local_train(a, data, TrainConfig(epochs=3, batch_size=32, lr=0.05), CPU, seed=4)
    local_train(b, data, TrainConfig(epochs=1, batch_size=32, lr=0.05, steps=6), CPU, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_steps_must_be_positive():
    with pytest.raises(ValueError, match="client.steps"):
        TrainConfig.checked({"steps": 0})


def test_client_sampling_is_seeded_and_sized():
    a = sample_clients(100, 0.1, round_=3, seed=0)
    assert a == sample_clients(100, 0.1, round_=3, seed=0)
    assert len(a) == 10 and len(set(a)) == 10 and a == sorted(a)
    assert a != sample_clients(100, 0.1, round_=4, seed=0)
    assert sample_clients(5, 0.01, 1, 0).__len__() == 1
    assert derive_seed(0, "x") == derive_seed(0, "x") != derive_seed(1, "x")


def test_bf16_on_a_device_that_emulates_it_warns_once_and_fp32_never(monkeypatch):
    monkeypatch.setattr(precision, "bf16_native", lambda device_type: False)
    monkeypatch.setattr(precision, "_WARNED_EMULATED", set())
    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with precision.autocast(cpu, "fp32"):
            pass
    with pytest.warns(RuntimeWarning, match="without native bf16 kernels.*Use precision fp32"), \
            precision.autocast(cpu, "bf16"):
        assert torch.is_autocast_enabled("cpu")
    with warnings.catch_warnings():  # once per process: a training loop does not repeat it per batch
        warnings.simplefilter("error")
        with precision.autocast(cpu, "bf16"):
            pass


def test_bf16_where_native_does_not_warn(monkeypatch):
    monkeypatch.setattr(precision, "bf16_native", lambda device_type: True)
    monkeypatch.setattr(precision, "_WARNED_EMULATED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with precision.autocast(torch.device("cpu"), "bf16"):
            pass


def test_bf16_native_is_false_on_a_cpu_without_avx512():
    native = precision.bf16_native("cpu")
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


class _Stop(Exception):
    """Stands in for a killed process."""


def _dropout_net(num_classes: int = 4) -> torch.nn.Module:
    """A small net with dropout: its training draws from the default random stream, which a resume
    must restore."""
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 32), torch.nn.ReLU(),
                               torch.nn.Dropout(0.5), torch.nn.Linear(32, num_classes))


def _stop_after(epoch_to_stop: int, seen: list[int]):
    def progress(epoch: int, _loss: float) -> None:
        seen.append(epoch)
        if epoch == epoch_to_stop:
            raise _Stop

    return progress


def _resume_and_compare(checkpoint, data, cfg, reference, ref_stats, seen):
    torch.manual_seed(99)  # as in a new process: another default stream and another initialisation
    resumed = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 32), torch.nn.ReLU(),
                                  torch.nn.Dropout(0.5), torch.nn.Linear(32, 4))
    seen.clear()
    stats = local_train(resumed, data, cfg, CPU, seed=3, progress=_stop_after(-1, seen), checkpoint=checkpoint)
    assert stats == ref_stats
    ref_state, state = reference.state_dict(), resumed.state_dict()
    assert all(torch.equal(ref_state[k], state[k]) for k in ref_state)


def test_interrupted_local_training_resumes_to_the_same_bits(tmp_path, synthetic_small):
    data, cfg = synthetic_small.train, TrainConfig(epochs=5, batch_size=32, lr=0.05, momentum=0.9)  # buffers to save
    reference = _dropout_net()
    ref_stats = local_train(reference, data, cfg, CPU, seed=3)
    checkpoint = TrainCheckpoint(tmp_path / "partial" / "c.safetensors", every_s=0)  # after every step
    seen: list[int] = []
    with pytest.raises(_Stop):
        local_train(_dropout_net(), data, cfg, CPU, seed=3, progress=_stop_after(3, seen), checkpoint=checkpoint)
    saved = Payload.from_bytes(checkpoint.path.read_bytes())
    assert (saved.meta["epoch"], saved.meta["step"], saved.meta["count"]) == (2, 8, 240)  # 240 images, 8 batches
    assert {"momentum.0", "rng.batches", "rng.cpu", "epoch_loss"} <= set(saved.tensors)
    assert "rng.cuda" not in saved.tensors and checkpoint.saved_seconds() > 0
    with counting_sample_passes() as meter:  # the steps before the stop count too
        _resume_and_compare(checkpoint, data, cfg, reference, ref_stats, seen)
    assert seen == [3, 4, 5] and meter[0] == slow_sample_passes(len(data), 32, 5)
    checkpoint.clear()
    assert not checkpoint.path.exists()


def test_a_stop_signal_in_mid_epoch_saves_that_step_and_the_resume_gives_the_same_bits(tmp_path, synthetic_small):
    data, cfg = synthetic_small.train, TrainConfig(epochs=3, batch_size=32, lr=0.05)
    reference = _dropout_net()
    ref_stats = local_train(reference, data, cfg, CPU, seed=3)
    calls = []

    def ctrl_c_in_step_11(model, x, y):  # epoch 2, its third batch
        calls.append(1)
        if len(calls) == 11:
            signal.raise_signal(signal.SIGINT)  # held back until the step is done
        return F.cross_entropy(model(x), y)

    checkpoint = TrainCheckpoint(tmp_path / "c.safetensors", every_s=1e9)  # no timed save
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        local_train(_dropout_net(), data, cfg, CPU, seed=3, loss_fn=ctrl_c_in_step_11, checkpoint=checkpoint)
    assert len(calls) == 11 and signal.getsignal(signal.SIGINT) is handler
    saved = Payload.from_bytes(checkpoint.path.read_bytes()).meta
    assert (saved["epoch"], saved["step"], saved["count"]) == (1, 3, 96)
    seen: list[int] = []
    with counting_sample_passes() as meter:
        _resume_and_compare(checkpoint, data, cfg, reference, ref_stats, seen)
    assert seen == [2, 3] and meter[0] == slow_sample_passes(len(data), 32, 3)


def test_sigterm_saves_the_step_before_the_process_ends(tmp_path, synthetic_small):
    script = f"""
import os, signal, torch, torch.nn.functional as F
from pathlib import Path
from hetfl.data.synthetic import load_synthetic
from hetfl.fl.checkpoint import TrainCheckpoint
from hetfl.fl.train_config import TrainConfig
from hetfl.fl.training import local_train
torch.set_num_threads({torch.get_num_threads()})
data = load_synthetic(classes=4, channels=1, size=16, train_per_class=60, test_per_class=30, seed=3).train
calls = []
def loss_fn(model, x, y):
    calls.append(1)
    if len(calls) == 5:
        os.kill(os.getpid(), signal.SIGTERM)
    return F.cross_entropy(model(x), y)
torch.manual_seed(1)
net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                          torch.nn.Linear(32, 4))
local_train(net, data, TrainConfig(epochs=3, batch_size=32, lr=0.05), torch.device("cpu"), seed=3, loss_fn=loss_fn,
            checkpoint=TrainCheckpoint(Path({str(tmp_path / "c.safetensors")!r}), every_s=1e9))
print("not stopped")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert "not stopped" not in done.stdout
    checkpoint = TrainCheckpoint(tmp_path / "c.safetensors")
    assert Payload.from_bytes(checkpoint.path.read_bytes()).meta["step"] == 5
    cfg = TrainConfig(epochs=3, batch_size=32, lr=0.05)
    reference = _dropout_net()
    ref_stats = local_train(reference, synthetic_small.train, cfg, CPU, seed=3)
    seen: list[int] = []
    _resume_and_compare(checkpoint, synthetic_small.train, cfg, reference, ref_stats, seen)
    assert seen == [1, 2, 3]


def test_a_checkpoint_of_another_training_or_a_torn_one_is_ignored(tmp_path, synthetic_small):
    data, cfg = synthetic_small.train, TrainConfig(epochs=2, batch_size=32, lr=0.05)
    checkpoint = TrainCheckpoint(tmp_path / "c.safetensors", every_s=0)
    with pytest.raises(_Stop):
        local_train(_dropout_net(), data, cfg, CPU, seed=3, progress=_stop_after(2, []), checkpoint=checkpoint)
    assert checkpoint.path.is_file()
    blob = checkpoint.path.read_bytes()
    fresh = _dropout_net()
    local_train(fresh, data, cfg, CPU, seed=3)
    for other, why in ((dict(cfg=TrainConfig(epochs=2, batch_size=32, lr=0.1)), "another training configuration"),
                       (dict(seed=4), "another training configuration or seed"),
                       (dict(model=_dropout_net(num_classes=5)), "other names or shapes")):
        seen: list[int] = []
        args = {"model": _dropout_net(), "cfg": cfg, "seed": 3, **other}
        with pytest.warns(UserWarning, match=why):
            local_train(args["model"], data, args["cfg"], CPU, seed=args["seed"], progress=_stop_after(-1, seen),
                        checkpoint=TrainCheckpoint(checkpoint.path, every_s=1e9))
        assert seen == [1, 2]  # started over
        checkpoint.path.write_bytes(blob)
    checkpoint.path.write_bytes(blob[:100])  # a file cut short
    assert checkpoint.saved_seconds() == 0.0
    model = _dropout_net()
    with pytest.warns(UserWarning, match="not used .*training starts over"):
        local_train(model, data, cfg, CPU, seed=3, checkpoint=checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_momentum_buffers_round_trip_by_parameter_index_and_a_misfit_changes_nothing():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    assert momentum_tensors(opt, "m.") == {}  # no step yet: no buffers
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    saved = momentum_tensors(opt, "m.")
    assert set(saved) == {"m.0", "m.1"} and saved["m.0"].shape == (2, 3)
    fresh = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    load_momentum(fresh, {**saved, "other.0": torch.zeros(1), "m.x": torch.zeros(1)}, "m.")
    assert all(torch.equal(fresh.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])
               for p in net.parameters())
    empty = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"momentum buffers \[1\] do not fit"):
        load_momentum(empty, {"m.0": saved["m.0"], "m.1": torch.zeros(5)}, "m.")
    assert not empty.state  # checked before anything was set


def test_nhwc_evaluation_matches_nchw_and_leaves_the_model_in_its_layout():
    from hetfl.data.base import ImageDataset

    torch.manual_seed(0)
    data = ImageDataset(torch.randint(0, 256, (300, 3, 16, 16), dtype=torch.uint8), torch.randint(0, 10, (300,)), 10)
    model = build_model("cnn2", 3, 16, 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    nhwc = training.predict_logits(model, data, torch.device("cpu"), batch_size=128)
    nchw = training.predict_logits(model, data, torch.device("cpu"), batch_size=128, channels_last=False)
    assert torch.allclose(nhwc, nchw, atol=1e-5)
    for k, v in model.state_dict().items():  # the caller's model: same values, still NCHW-contiguous
        assert torch.equal(v, before[k]) and v.is_contiguous()
