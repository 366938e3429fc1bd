"""FedHydra and the data-free one-shot family: values against slow references, invariants, runs."""

import json
import signal
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from hetfl.data import make_partition
from hetfl.data.synthetic import load_synthetic
from hetfl.engine.simulator import Simulator, prepare
from hetfl.fl.datafree import BNStatsLoss, kl_div
from hetfl.fl.train_config import TrainConfig
from hetfl.fl.training import local_train, predict_logits
from hetfl.methods.checks import validate
from hetfl.methods.fedhydra import (
    SATURATED_CE,
    guidance,
    normalise_rows_and_columns,
    saturate,
    stratified_aggregation,
    stratify,
    stratify_losses,
    stratify_reference,
)
from hetfl.methods.ot import chain_layers, fuse
from hetfl.models import build_model

CPU = torch.device("cpu")


def test_U_r_rows_and_U_c_columns_sum_to_one():
    torch.manual_seed(0)
    U = torch.rand(10, 5, dtype=torch.float64) * 3
    U[4] = 0  # a class no client guides: uniform row
    U_r, U_c = normalise_rows_and_columns(U)
    assert torch.allclose(U_r.sum(dim=1), torch.ones(10, dtype=torch.float64))
    assert torch.allclose(U_c.sum(dim=0), torch.ones(5, dtype=torch.float64))
    assert torch.allclose(U_r[4], torch.full((5,), 0.2, dtype=torch.float64))
    assert torch.allclose(U_r[0], U[0] / U[0].sum()) and torch.allclose(U_c[:, 1], U[:, 1] / U[:, 1].sum())


def test_guidance_is_eq2():
    losses = torch.tensor([[2.0, 1.0, 0.5], [1.0, 1.0, 1.0]])
    assert torch.allclose(guidance(losses), torch.tensor([3.0, 0.0], dtype=torch.float64))
    assert guidance(torch.tensor([0.0, 0.0])) == 0  # no division by zero, never negative


def test_stratified_aggregation_equals_slow_reference():
    torch.manual_seed(1)
    m, b, c = 4, 33, 7
    logits, y = torch.randn(m, b, c), torch.randint(0, c, (b,))
    U_r, U_c = normalise_rows_and_columns(torch.rand(c, m))
    U_r, U_c = U_r.float(), U_c.float()
    P = stratified_aggregation(logits, y, U_r, U_c)
    ref = torch.zeros(b, c)
    for i in range(b):  # Eq. 8-11 literally
        for k in range(m):
            P_hat_k_i = torch.tensor([logits[k, i, j] * U_c[j, k] for j in range(c)])
            ref[i] += U_r[y[i], k] * P_hat_k_i
    assert torch.allclose(P, ref, atol=1e-5)


def test_bn_loss_is_zero_exactly_when_batch_matches_stored_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3)).eval()
    x = torch.rand(16, 1, 8, 8)
    with torch.no_grad():
        h = model[0](x)
        model[1].running_mean.copy_(h.mean(dim=(0, 2, 3)))
        model[1].running_var.copy_(h.var(dim=(0, 2, 3), unbiased=False))
    bn = BNStatsLoss([model, nn.Linear(2, 2)])  # a model without BN contributes 0
    model(x)
    per_model = bn.per_model()
    assert per_model.shape == (2,) and float(per_model[0].detach()) < 1e-6 and float(per_model[1].detach()) == 0
    bn.clear()
    model(x * 2)
    assert float(bn.per_model()[0].detach()) > 0.1
    bn.clear()
    bn.recording = False  # forwards outside the generator's loss (Co-Boosting's ODS): nothing recorded
    out = model(x * 2)
    assert all(not v for v in bn.values) and float(bn.per_model().abs().sum()) == 0
    bn.remove()
    assert torch.equal(out, model(x * 2))  # the same output with the hooks on, off or gone


@pytest.mark.parametrize("channels_last", [False, True])
def test_channel_mean_var_equals_torch_mean_and_var_values_and_gradients(channels_last):
    """The BN hook's statistics (two plain sums, one-pass backward) against torch.mean / torch.var."""
    from hetfl.fl.datafree import ChannelMeanVar

    torch.manual_seed(0)
    x = torch.randn(5, 3, 6, 7, dtype=torch.float64) * 2 + 1
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_(True)
    mean, var = ChannelMeanVar.apply(x)
    ref_mean, ref_var = x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3), unbiased=False)
    assert mean.dtype == var.dtype == torch.float32  # fp32 statistics whatever the input precision
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(var.double(), ref_var, rtol=1e-6, atol=1e-6)
    g_mean, g_var = torch.randn(3), torch.randn(3)
    (grad,) = torch.autograd.grad((mean * g_mean).sum() + (var * g_var).sum(), x)
    (ref,) = torch.autograd.grad((ref_mean * g_mean.double()).sum() + (ref_var * g_var.double()).sum(), x)
    assert grad.dtype == torch.float64 and grad.shape == x.shape
    torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)
    xb = x.detach().bfloat16().requires_grad_(True)  # bf16 in: fp32 statistics out, bf16 gradient back
    mean_b, var_b = ChannelMeanVar.apply(xb)
    torch.testing.assert_close(mean_b, xb.float().mean(dim=(0, 2, 3)), rtol=1e-5, atol=1e-5)
    (var_b.sum() + mean_b.sum()).backward()
    assert xb.grad.dtype == torch.bfloat16


def test_kl_div_matches_torch():
    torch.manual_seed(0)
    t, s = torch.randn(8, 5), torch.randn(8, 5)
    expected = F.kl_div(F.log_softmax(s / 4, 1), F.softmax(t / 4, 1), reduction="batchmean") * 16
    assert torch.allclose(kl_div(t, s, 4.0), expected, atol=1e-6)
    assert float(kl_div(t, t)) == pytest.approx(0, abs=1e-6)


def _teachers(classes=6, clients=3, epochs=15, partition=None):
    d = load_synthetic(classes=classes, size=16, train_per_class=80, test_per_class=10, noise=0.2, seed=1)
    part = make_partition(d.train.y.numpy(), clients, partition or {"kind": "2c/c"}, 0)
    teachers = []
    for k, idx in enumerate(part.indices):
        torch.manual_seed(0)
        model = build_model("cnn2", 1, 16, classes)
        local_train(model, d.train.subset(torch.from_numpy(idx)), TrainConfig(epochs=epochs, batch_size=32, lr=0.05),
                    CPU, seed=k)
        teachers.append(model.eval())
    return teachers


@pytest.mark.slow
def test_stratification_gives_each_2cc_client_its_owned_classes():
    teachers = _teachers()
    U = stratify(teachers, 6, (1, 16, 16), steps=15, batch=16, lr=1e-3, nz=32, seed=0, device=CPU)
    _, U_c = normalise_rows_and_columns(U)
    for k in range(3):
        top2 = set(U_c[:, k].topk(2).indices.tolist())
        assert top2 == {2 * k, 2 * k + 1}, f"client {k}: {U_c[:, k]}"
        assert float(U_c[2 * k, k] + U_c[2 * k + 1, k]) > 0.9  # paper Fig. 5b: ~0.96 on owned classes


def test_saturate_gives_near_zero_minima_the_largest_u():
    U = torch.tensor([[0.0, 5.0], [2.0, 1.0]], dtype=torch.float64)
    L_min = torch.tensor([[1e-13, 1e-4], [0.3, 1e-3]], dtype=torch.float64)
    assert torch.equal(saturate(U, L_min), torch.tensor([[5.0, 5.0], [2.0, 1.0]], dtype=torch.float64))
    assert torch.equal(saturate(U, torch.full_like(U, 1e-3)), U)  # nothing saturated: Eq. 2 unchanged


def test_a_one_class_teacher_has_a_flat_trajectory_that_saturated_max_repairs():
    """A client that calls every input class 2 with a margin of ~60 gives the generator no gradient:
    its CE on class 2 is flat near 0, Eq. 2 reads u = 0 (the paper's formula as written), and
    ``saturated: max`` makes it the strongest guidance for class 2."""
    torch.manual_seed(0)
    confident, plain = build_model("cnn2", 1, 16, 4).eval(), build_model("cnn2", 1, 16, 4).eval()
    with torch.no_grad():
        confident.fc.bias[2] += 60.0
    L = stratify_losses([confident, plain], 4, (1, 16, 16), steps=5, batch=8, lr=1e-3, nz=16, seed=0, device=CPU)
    assert L.shape == (4, 2, 5)
    U, L_min = guidance(L), L.amin(dim=-1)
    assert float(L_min[2, 0]) < SATURATED_CE < float(L_min[2, 1])
    assert float(U[2, 0]) < 1e-3 < float(U[2, 1])  # Eq. 2: the confident client looks weakest
    U_r, _ = normalise_rows_and_columns(saturate(U, L_min))
    assert int(U_r[2].argmax()) == 0 and float(U[2, 0]) < float(saturate(U, L_min)[2, 0]) == float(U.max())


def test_batched_stratification_equals_the_one_at_a_time_loop():
    teachers = _teachers(classes=4, clients=2, epochs=2)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # exact comparison: no float32 reordering noise
    try:
        teachers = [t.double() for t in teachers]
        kw = dict(num_classes=4, shape=(1, 16, 16), steps=4, batch=6, lr=1e-3, nz=16, seed=3, device=CPU)
        U = stratify(teachers, **kw)
        R = stratify_reference(teachers, **kw)
    finally:
        torch.set_default_dtype(old)
    assert U.shape == (4, 2)
    assert torch.allclose(U, R, rtol=1e-6, atol=1e-9)


def test_ot_fusion_recovers_permuted_neurons():
    torch.manual_seed(0)
    model = build_model("cnn2", 1, 16, 4)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.normal_()
                mod.running_var.uniform_(0.5, 2)
    s = {k: v.clone() for k, v in model.state_dict().items()}
    (n0, _, bn0), (n1, _, bn1), (n2, _, _) = chain_layers(model)
    perm0, perm1 = torch.randperm(s[f"{n0}.weight"].shape[0]), torch.randperm(s[f"{n1}.weight"].shape[0])
    p = dict(s)
    for key in ("weight", "bias"):
        if f"{n0}.{key}" in s:
            p[f"{n0}.{key}"] = s[f"{n0}.{key}"][perm0]
        if f"{n1}.{key}" in s:
            p[f"{n1}.{key}"] = s[f"{n1}.{key}"][perm1]
    p[f"{n1}.weight"] = s[f"{n1}.weight"][perm1][:, perm0]
    for key in ("weight", "bias", "running_mean", "running_var"):
        p[f"{bn0}.{key}"], p[f"{bn1}.{key}"] = s[f"{bn0}.{key}"][perm0], s[f"{bn1}.{key}"][perm1]
    w2 = s[f"{n2}.weight"]
    p[f"{n2}.weight"] = w2.reshape(w2.shape[0], len(perm1), -1)[:, perm1].reshape(w2.shape)
    permuted = build_model("cnn2", 1, 16, 4)
    permuted.load_state_dict(p)
    x = torch.rand(4, 1, 16, 16)
    assert torch.allclose(model.eval()(x), permuted.eval()(x), atol=1e-5)  # same function
    fused = fuse([s, p], chain_layers(model), [1, 1])
    assert all(torch.allclose(fused[k].float(), s[k].float(), atol=1e-5) for k in s)  # aligned back


SMOKE = {
    "name": "oneshot", "seed": 0, "dataset": "synthetic",
    "data": {"train_per_class": 60, "test_per_class": 20, "size": 16, "classes": 4, "noise": 0.2},
    "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}, "clients": 3,
    "client": {"model": "cnn2", "epochs": 6, "batch_size": 32, "lr": 0.1},
    "methods": {
        "fedavg": {}, "ot": {}, "feddf": {"steps": 20, "eval_every": 10, "aux_size": 100},
        "dense": {"epochs": 2, "generator_steps": 2, "batch_size": 16},
        "coboosting": {"epochs": 3, "generator_steps": 2, "batch_size": 16},
        "fedhydra": {"epochs": 2, "generator_steps": 2, "batch_size": 16, "strat_batch_size": 4},
    },
}


def test_all_one_shot_methods_run_on_the_same_uploads(tmp_path):
    summary = Simulator(prepare(validate(SMOKE)), tmp_path, tmp_path / "cache", quiet=True).run()
    res = summary["results"]
    assert list(res) == ["fedavg", "ot", "feddf", "dense", "coboosting", "fedhydra"]
    assert len({r["bytes_up"] for r in res.values()}) == 1  # byte-identical uploads
    assert len({r["uploads_sha256"] for r in res.values()}) == 1 and len(res["ot"]["uploads_sha256"]) == 64
    assert all(r["cached_uploads"] == 3 for name, r in res.items() if name != "fedavg")
    strat = json.loads((tmp_path / "fedhydra" / "stratification.json").read_text())
    assert len(strat["U"]) == 4 and len(strat["U"][0]) == 3
    assert len(strat["L_min"]) == 4 and len(strat["L_min"][0]) == 3  # minima kept for saturated: max
    assert (tmp_path / "fedhydra" / "U_c.png").is_file() and (tmp_path / "fedhydra" / "samples.png").is_file()
    assert set(res["fedhydra"]["timing_seconds"]) == {"generation", "distillation", "evaluation"}
    assert "stratification_seconds" in res["fedhydra"]
    assert res["feddf"]["teacher_seconds"] >= 0 and res["feddf"]["distill_seconds"] >= 0  # the two stages
    w = res["coboosting"]["ensemble_weights"]
    assert len(w) == 3 and all(0 <= v <= 1 for v in w)
    # each result records the settings it ran with, defaults filled in: Co-Boosting clips as its code does
    assert res["coboosting"]["params"]["grad_clip"] == res["coboosting"]["params"]["generator_grad_clip"] == 10
    assert res["coboosting"]["params"]["pool_shuffle"] and res["dense"]["params"]["pool_shuffle"]  # as their code
    assert res["dense"]["params"]["grad_clip"] == res["dense"]["params"]["generator_grad_clip"] == 0
    assert res["dense"]["params"]["epochs"] == 2 and res["fedavg"]["params"] == {"rounds": 1, "sample_ratio": 1.0,
                                                                                  "init": "seed"}


def test_generator_grad_clip_clips_the_generators_weights_every_step_and_not_z(tmp_path, monkeypatch):
    """``generator_grad_clip`` (Co-Boosting's code: 10) clips the norm of the generator's weight
    gradients before each Adam step; z, which Co-Boosting also trains, is left out; off at 0."""
    from hetfl.fl.datafree import DataFreeConfig, DataFreeDistiller

    calls: list[tuple[int, float, bool]] = []
    original = torch.nn.utils.clip_grad_norm_

    def spy(parameters, max_norm, *args, **kwargs):
        params = list(parameters)
        calls.append((len(params), max_norm, any(p.shape == (16, 256) for p in params)))
        return original(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    cfg = json.loads(json.dumps(SMOKE))
    cfg["methods"] = {"coboosting": {"epochs": 2, "generator_steps": 3, "batch_size": 16, "grad_clip": 0}}
    built: list[DataFreeDistiller] = []
    init = DataFreeDistiller.__init__
    monkeypatch.setattr(DataFreeDistiller, "__init__",
                        lambda self, *a, **k: (init(self, *a, **k), built.append(self))[0])
    Simulator(prepare(validate(cfg)), tmp_path / "a", tmp_path / "cache", quiet=True).run()
    n_gen = len(list(built[0].generator.parameters()))
    assert calls == [(n_gen, 10.0, False)] * 6  # 2 epochs x 3 steps, the generator's weights only (z is 16 x 256)
    calls.clear()
    cfg["methods"]["coboosting"]["generator_grad_clip"] = 0
    Simulator(prepare(validate(cfg)), tmp_path / "b", tmp_path / "cache", quiet=True).run()
    assert calls == []
    with pytest.raises(ValueError, match="generator_grad_clip must be >= 0"):
        DataFreeConfig(generator_grad_clip=-1)


def test_data_free_methods_take_heterogeneous_clients_and_ot_refuses_them(tmp_path):
    cfg = json.loads(json.dumps(SMOKE))
    cfg["client"]["model"] = ["cnn2", "lenet5", "resnet18"]
    cfg["client"]["epochs"] = 1
    cfg["server"] = {"model": "resnet18"}
    cfg["methods"] = {"fedhydra": SMOKE["methods"]["fedhydra"], "dense": {"epochs": 1, "generator_steps": 1,
                                                                           "batch_size": 8}}
    res = Simulator(prepare(validate(cfg)), tmp_path, None, quiet=True).run()["results"]
    assert set(res) == {"fedhydra", "dense"}
    cfg["methods"] = {"fedavg": {}, "ot": {}}
    with pytest.raises(ValueError, match="OT fusion aligns neurons of models of one architecture"):
        Simulator(prepare(validate(cfg)), tmp_path / "ot", None, quiet=True).run()
    assert not (tmp_path / "ot" / "fedavg" / "fedavg.safetensors").exists()  # failed before training


def test_feddf_gives_each_client_architecture_a_student_from_its_fedavg_and_votes(tmp_path):
    cfg = json.loads(json.dumps(SMOKE))
    cfg["client"].update(model=["cnn2", "lenet5", "cnn2"], epochs=2)
    # an Adam step of lr 1e-12 leaves each student where it started: its architecture's FedAvg
    feddf = {"steps": 1, "lr": 1e-12, "eval_every": 1, "aux_size": 50, "prototypes": "all"}
    cfg["methods"] = {"fedavg": {}, "feddf": feddf}
    res = Simulator(prepare(validate(cfg)), tmp_path, tmp_path / "cache", quiet=True).run()["results"]
    assert set(res["feddf"]["models"]) == {"feddf", "feddf[lenet5]", "feddf[vote]"}
    assert res["feddf"]["init"] == "fedavg" and res["feddf"]["init[lenet5]"] == "fedavg"
    for student, average in (("feddf", "fedavg"), ("feddf_lenet5", "fedavg_lenet5")):
        got = load_file(str(tmp_path / "feddf" / f"{student}.safetensors"))
        want = load_file(str(tmp_path / "fedavg" / f"{average}.safetensors"))
        weights = [k for k in got if "running" not in k and "num_batches" not in k]  # BN stats see the aux batch
        assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k], atol=1e-6) for k in weights)
    assert not (tmp_path / "feddf" / "feddf_vote.safetensors").exists()  # the vote's members are saved
    test = prepare(validate(cfg)).splits.test
    logits = []
    for name, arch in (("feddf", "cnn2"), ("feddf_lenet5", "lenet5")):
        model = build_model(arch, *test.shape[:2], test.num_classes)
        model.load_state_dict(load_file(str(tmp_path / "feddf" / f"{name}.safetensors")))
        logits.append(predict_logits(model, test, torch.device("cpu")))
    vote = 100.0 * float((torch.stack(logits).mean(0).argmax(1) == test.y).float().mean())
    assert res["feddf"]["models"]["feddf[vote]"] == pytest.approx(vote, abs=1e-4)  # mean of the students' logits
    cfg["methods"] = {"feddf": {**feddf, "prototypes": "server", "init": "random"}}
    one = Simulator(prepare(validate(cfg)), tmp_path / "one", tmp_path / "cache", quiet=True).run()["results"]
    assert "models" not in one["feddf"] and one["feddf"]["init"] == "random"
    for key, bad in (("init", "average"), ("prototypes", "each")):
        cfg["methods"] = {"feddf": {**feddf, key: bad}}
        with pytest.raises(ValueError, match=f"{key} must be"):
            Simulator(prepare(validate(cfg)), tmp_path / key, tmp_path / "cache", quiet=True).run()


def test_feddf_bf16_tracks_fp32_and_hands_back_a_contiguous_student(tmp_path):
    cfg = json.loads(json.dumps(SMOKE))
    feddf = {"steps": 20, "eval_every": 10, "aux_size": 200, "prototypes": "all"}
    cfg["client"].update(model=["cnn2", "lenet5", "cnn2"])
    runs = {}
    for precision in ("fp32", "bf16"):
        cfg["methods"] = {"feddf": {**feddf, "precision": precision}}
        out = tmp_path / precision
        runs[precision] = Simulator(prepare(validate(cfg)), out, tmp_path / "cache", quiet=True).run()["results"]
        saved = load_file(str(out / "feddf" / "feddf.safetensors"))
        assert all(t.is_contiguous() for t in saved.values())  # back from channels_last
    fp32, bf16 = runs["fp32"]["feddf"], runs["bf16"]["feddf"]
    assert abs(fp32["accuracy"] - bf16["accuracy"]) <= 5.0  # same uploads, same batches; bf16 rounding only
    assert set(bf16["models"]) == {"feddf", "feddf[lenet5]", "feddf[vote]"}
    cfg["methods"] = {"feddf": {**feddf, "precision": "fp16"}}
    with pytest.raises(ValueError, match="methods.feddf.precision: 'fp16': must be one of 'fp32' or 'bf16'"):
        Simulator(prepare(validate(cfg)), tmp_path / "bad", tmp_path / "cache", quiet=True).run()


def stop_in_epoch_3(monkeypatch, stop) -> list[int]:
    """Make the data-free loop call ``stop()`` as its first epoch 3 starts; returns the list of the
    epochs synthesised (filled as the runs go)."""
    from hetfl.fl.datafree import DataFreeDistiller

    original = DataFreeDistiller.synthesize
    calls: list[int] = []

    def synthesize(self, epoch):
        calls.append(epoch)
        if epoch == 3 and calls.count(3) == 1:
            stop()
        return original(self, epoch)

    monkeypatch.setattr(DataFreeDistiller, "synthesize", synthesize)
    return calls


def test_data_free_server_stage_resumes_after_interruption(tmp_path, monkeypatch):
    cfg = json.loads(json.dumps(SMOKE))
    cfg["methods"] = {"fedhydra": {"epochs": 4, "generator_steps": 2, "batch_size": 16, "strat_batch_size": 4,
                                   "checkpoint_every": 1, "cosine": True}}
    full = Simulator(prepare(validate(cfg)), tmp_path / "full", tmp_path / "cache", quiet=True,
                  keep_checkpoints=True).run()

    def crash() -> None:
        raise KeyboardInterrupt  # at once: epochs 1-2 are saved, epoch 3 is lost

    calls = stop_in_epoch_3(monkeypatch, crash)
    with pytest.raises(KeyboardInterrupt):
        Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True,
                  keep_checkpoints=True).run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True,
                  keep_checkpoints=True).run()
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]  # the schedule is fast-forwarded quietly
    assert calls == [1, 2, 3, 3, 4]  # epochs 1-2 were not redone
    r, f = resumed["results"]["fedhydra"], full["results"]["fedhydra"]
    assert r["resumed_from_epoch"] == 2
    # the work before the stop counts in the stage's seconds: the reused stratification and epochs 1-2
    strat = json.loads((tmp_path / "run" / "fedhydra" / "stratification.json").read_text())
    assert r["stratification_seconds"] == strat["seconds"] > 0
    assert r["seconds_before_resume"] > r["stratification_seconds"]
    assert r["seconds"] >= r["server_seconds"] > r["seconds_before_resume"]
    assert r["accuracy"] == pytest.approx(f["accuracy"], abs=1e-6)
    assert r["best_accuracy"] == pytest.approx(f["best_accuracy"], abs=1e-6)
    rows = [json.loads(x) for x in (tmp_path / "run" / "fedhydra" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3, 4, -1]  # epochs before the checkpoint kept, none twice
    # Re-running a finished stage resumes at its last epoch: best-over-epochs still covers the epochs
    # before the checkpoint (an early peak, planted in the checkpoint's history, must be reported).
    info_path = tmp_path / "run" / "fedhydra" / "checkpoint.json"
    info = json.loads(info_path.read_text())
    info["history"][0] = 99.0
    info_path.write_text(json.dumps(info))
    again = Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True,
                  keep_checkpoints=True).run()
    assert again["results"]["fedhydra"]["resumed_from_epoch"] == 4
    assert again["results"]["fedhydra"]["best_accuracy"] == 99.0


@pytest.mark.parametrize("method", ["dense", "coboosting"])
def test_a_stop_signal_in_mid_epoch_saves_that_epoch_and_the_resume_gives_the_same_model(tmp_path, monkeypatch,
                                                                                         capsys, method):
    """Ctrl-C (or a parallel parent's SIGINT at a deadline) finishes the epoch under way and saves it,
    though no periodic checkpoint is due: nothing done before the stop is redone. Co-Boosting with
    its defaults (clipped, its KD batches reshuffled each epoch, ODS and ensemble weights) too."""
    cfg = json.loads(json.dumps(SMOKE))
    cfg["methods"] = {method: {"epochs": 4, "generator_steps": 2, "batch_size": 16, "checkpoint_every": 10}}
    full = Simulator(prepare(validate(cfg)), tmp_path / "full", tmp_path / "cache", quiet=True).run()
    calls = stop_in_epoch_3(monkeypatch, lambda: signal.raise_signal(signal.SIGINT))  # held back: epoch 3 ends
    with pytest.raises(KeyboardInterrupt):
        Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True).run()
    assert f"{method}: stopping after this epoch, to save a checkpoint (SIGINT)" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / method / "checkpoint.json").read_text())["epoch"] == 3
    resumed = Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True).run()
    assert calls == [1, 2, 3, 4]  # epoch 3 was finished before the stop, and not redone
    r, f = resumed["results"][method], full["results"][method]
    assert r["resumed_from_epoch"] == 3
    assert r["seconds"] > r["seconds_before_resume"] > 0  # epochs 1-3 count in the stage's seconds
    assert "seconds_before_resume" not in f
    assert (r["accuracy"], r["best_accuracy"]) == pytest.approx((f["accuracy"], f["best_accuracy"]), abs=1e-6)
    a = load_file(str(tmp_path / "run" / method / f"{method}.safetensors"))
    b = load_file(str(tmp_path / "full" / method / f"{method}.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in b)

    def steps(run: str) -> list[int]:
        return [json.loads(x)["step"] for x in (tmp_path / run / method / "metrics.jsonl").read_text().splitlines()]

    assert steps("run") == steps("full") and steps("run")[-1] == -1 and max(steps("run")) == 4


def test_status_says_where_a_stopped_run_stands_and_when_it_finished(tmp_path, monkeypatch, capsys):
    """``hetfl status``: a data-free stage stopped in epoch 3 of 4 has logged 3 epochs, holds a
    checkpoint of epoch 3 and is not finished; once resumed it is; a line cut short by a kill is
    skipped; a folder that is not a run's is an error that names it."""
    from hetfl.cli import main
    from hetfl.status import run_status

    cfg = json.loads(json.dumps(SMOKE))
    cfg["methods"] = {"dense": {"epochs": 4, "generator_steps": 2, "batch_size": 16, "checkpoint_every": 10}}
    stop_in_epoch_3(monkeypatch, lambda: signal.raise_signal(signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True).run()
    with open(tmp_path / "run" / "dense" / "metrics.jsonl", "a") as f:
        f.write('{"method": "dense", "step": 4, "accur')  # killed while writing
    (row,) = run_status(tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "dense" / "metrics.jsonl").read_text().splitlines()[:-1]]
    assert all(isinstance(r["logged_at"], float) for r in rows)
    accs = [(r["step"], r["accuracy"]) for r in rows]
    assert (row["method"], row["finished"], row["logged"], row["total"], row["checkpoint"]) == ("dense", False, 3, 4, 3)
    assert (row["last"], row["best"]) == (accs[-1][1], max(a for _, a in accs)) and row["seconds_per_step"] > 0
    assert row["seconds_left"] == pytest.approx(row["seconds_per_step"])  # no line yet: mean pace x 1 step
    assert main(["status", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "dense" in out and "running" in out and "3/4" in out and " min" in out
    summary = Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True).run()
    (row,) = run_status(tmp_path / "run")
    assert (row["state"], row["logged"], row["checkpoint"], row["seconds_left"]) == ("done", 4, None, None)
    assert (row["last"], row["best"]) == (summary["results"]["dense"]["accuracy"],
                                          summary["results"]["dense"]["best_accuracy"])  # the final numbers
    assert main(["status", str(tmp_path)]) == 0  # a folder of runs: each run under its name
    assert f"{tmp_path / 'run'}:" not in capsys.readouterr().out  # one run: no heading
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "config.json").write_text((tmp_path / "run" / "config.json").read_text())
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'run'}:" in out and f"{tmp_path / 'run2'}:" in out and "pending" in out
    (tmp_path / "run2" / "dense").mkdir()  # its clients training: 2 of 3 done
    (tmp_path / "run2" / "dense" / "clients.json").write_text('{"round": 0, "done": 2, "total": 3}')
    assert [r["state"] for r in run_status(tmp_path / "run2")] == ["clients 2/3"]
    assert main(["status", str(tmp_path / "cache")]) == 2
    assert "not a run folder (no config.json) and no run folder in it" in capsys.readouterr().err


def test_status_prices_the_rest_at_the_recent_pace_and_its_growth(tmp_path):
    """Steps that grow slower (DENSE's pool) are priced by the recent pace and its growth, not by the
    mean pace so far; the gap of a resume and a paused step do not move it; a sum step by step of the
    same line gives the same seconds left; rows stamped ``logged_at`` come from the simulator."""
    from hetfl.status import recent_pace, seconds_left, status_table, step_seconds

    def cost(s: int) -> float:
        return 10.0 + 0.5 * s  # seconds of step s

    t, rows = 1000.0, []
    for s in range(1, 61):
        t += cost(s) + (5000.0 if s == 41 else 0.0) + (900.0 if s == 50 else 0.0)  # a resume gap, a pause
        rows += [{"step": s, "kd_loss": 1.0, "logged_at": t - 1.0}, {"step": s, "accuracy": 9.0, "logged_at": t}]
    pairs = step_seconds(rows)
    assert [s for s, _ in pairs] == list(range(2, 61)) and pairs[0][1] == pytest.approx(cost(2))
    now, growth = recent_pace(pairs)
    assert (now, growth) == pytest.approx((cost(60), 0.5))
    assert seconds_left((cost(50), 0.5), 50, 200) == pytest.approx(sum(cost(s) for s in range(51, 201)))
    assert seconds_left((cost(50), 0.5), 200, 200) == 0
    assert recent_pace(pairs[:3]) is None  # too few steps to say
    assert recent_pace([(s, 20.0 - 0.1 * s) for s in range(1, 30)])[1] == 0  # never sloping down
    assert step_seconds([{"step": 1, "logged_at": 5.0}, {"step": 3, "logged_at": 9.0}]) == []  # not consecutive
    left = sum(cost(s) for s in range(51, 201))  # from a checkpoint at step 50, the pace there
    assert seconds_left((now - growth * 10, growth), 50, 200) == pytest.approx(left)
    mean_only = (10.0 + 0.5 * 25.5)  # the mean pace to epoch 50 would promise this much less
    assert mean_only * 150 < left - 1800
    table = status_table([{"method": "dense", "state": "running", "finished": False,
                           "logged": 60, "total": 200, "last": 9.0,
                           "best": 9.0, "best_step": 1, "checkpoint": 50, "seconds_per_step": now,
                           "seconds_left": left}])
    assert f"{left / 60:.0f} min" in table and f"{now:.1f}" in table


def test_checkpoints_come_every_checkpoint_every_epochs_or_seconds_and_the_seconds_stay_out_of_the_key(
        tmp_path, monkeypatch):
    """A stage killed without a signal loses at most ``checkpoint_every_s`` of work; changing that
    setting does not change the trained model, so it does not stop a checkpoint from resuming."""
    from hetfl.fl.datafree import DataFreeConfig, DataFreeDistiller, config_key

    saved: list[int] = []
    real = DataFreeDistiller.save_checkpoint
    monkeypatch.setattr(DataFreeDistiller, "save_checkpoint",
                        lambda self, epoch, key: (saved.append(epoch), real(self, epoch, key)))
    cfg = json.loads(json.dumps(SMOKE))
    for every_s, expected in [(600.0, [2, 4, 5]), (0.0, [1, 2, 3, 4, 5])]:
        saved.clear()
        cfg["methods"] = {"dense": {"epochs": 5, "generator_steps": 1, "batch_size": 8, "checkpoint_every": 2,
                                    "checkpoint_every_s": every_s}}
        Simulator(prepare(validate(cfg)), tmp_path / str(every_s), tmp_path / "cache", quiet=True).run()
        assert saved == expected
    a, b = DataFreeConfig(), DataFreeConfig(checkpoint_every_s=5.0)
    assert config_key(a, params={"checkpoint_every_s": 600.0}) == config_key(b, params={"checkpoint_every_s": 5.0})
    assert config_key(a) != config_key(DataFreeConfig(checkpoint_every=5))  # the epochs' setting stays in
    for bad in [{"checkpoint_every_s": -1.0}, {"checkpoint_every_s": float("nan")}, {"checkpoint_every": 0}]:
        with pytest.raises(ValueError, match="checkpoint_every must be >= 1 and checkpoint_every_s >= 0"):
            DataFreeConfig(**bad)


def test_a_checkpoint_pair_that_disagrees_is_rejected_not_half_restored(tmp_path):
    """A stop between the blob's and the info file's writes must not restore epoch-4 weights as epoch 2."""
    cfg = json.loads(json.dumps(SMOKE))
    cfg["methods"] = {"fedhydra": {"epochs": 4, "generator_steps": 2, "batch_size": 16, "strat_batch_size": 4,
                                   "checkpoint_every": 2}}
    first = Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True,
                  keep_checkpoints=True).run()
    folder = tmp_path / "run" / "fedhydra"
    assert not list(folder.glob("*.tmp"))  # written beside the target and renamed over it
    info = json.loads((folder / "checkpoint.json").read_text())
    assert info["epoch"] == 4
    info["epoch"] = 2  # as if the blob of epoch 4 had landed and the info file had not
    (folder / "checkpoint.json").write_text(json.dumps(info))
    with pytest.warns(UserWarning, match="checkpoint files disagree"):
        again = Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True,
                  keep_checkpoints=True).run()
    assert "resumed_from_epoch" not in again["results"]["fedhydra"]  # started afresh
    assert again["results"]["fedhydra"]["accuracy"] == pytest.approx(first["results"]["fedhydra"]["accuracy"])


def test_fedhydra_dense_runs_fedhydra_in_denses_loop(tmp_path):
    """The authors'-code variant: G and z reset every epoch, one (best) batch kept per epoch, the
    whole pool distilled every epoch, the adversarial KL masked to disagreement."""
    from hetfl.fl.method import create_method
    from hetfl.methods.fedhydra import FedHydra

    p = create_method("fedhydra_dense", {}).params
    assert (p["reset_generator"], p["optimize_z"], p["adv_mask"], p["keep"], p["pool_size"], p["replay"]) == (
        True, True, "disagree", "best", -1, -1)
    for key, bad, message in [("keep", "last", "keep must be 'all' or 'best'"),
                              ("optimize_z", 1, "optimize_z: 1: input should be a valid boolean")]:
        with pytest.raises(ValueError, match=message):
            FedHydra({key: bad}).check(None)
    with pytest.raises(ValueError, match="optimize_z needs reset_generator"):
        FedHydra({"optimize_z": True}).check(None)
    cfg = json.loads(json.dumps(SMOKE))
    cfg["methods"] = {"fedhydra_dense": {"epochs": 3, "generator_steps": 3, "batch_size": 16, "strat_batch_size": 4,
                                         "checkpoint_every": 1}}
    out = Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True,
                  keep_checkpoints=True).run()
    r = out["results"]["fedhydra_dense"]
    assert 0.0 <= r["accuracy"] <= 100.0 and np.isfinite(r["best_accuracy"])
    info = json.loads((tmp_path / "run" / "fedhydra_dense" / "checkpoint.json").read_text())
    assert info["pool"] == 3  # one kept batch per epoch (keep: best), never dropped
    rows = [json.loads(x) for x in (tmp_path / "run" / "fedhydra_dense" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if x["step"] > 0] == [1, 2, 3]
    assert (tmp_path / "run" / "fedhydra_dense" / "stratification.json").is_file()


def test_channels_last_changes_the_layout_not_the_result(tmp_path, monkeypatch):
    """NHWC is a memory layout: the same loop (generator reset every epoch) gives the same model up to
    float summation order. On a GPU the two layouts run different cuDNN kernels and the difference
    grows over the training steps: with cuDNN's default TF32 convolutions the models differed by
    ~1e-3 on an H100, in full fp32 (as here) by ~1e-4 on an H200, above the CPU's 1e-4 tolerance."""
    from safetensors.torch import load_file

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32 matmuls either
    atol = 1e-3 if torch.cuda.is_available() else 1e-4  # SMOKE's device is auto: the GPU where there is one
    cfg = json.loads(json.dumps(SMOKE))
    models = {}
    try:
        for flag in (False, True):
            cfg["methods"] = {"dense": {**SMOKE["methods"]["dense"], "channels_last": flag}}
            Simulator(prepare(validate(cfg)), tmp_path / str(flag), tmp_path / "cache", quiet=True).run()
            models[flag] = load_file(str(tmp_path / str(flag) / "dense" / "dense.safetensors"))
    finally:
        torch.set_float32_matmul_precision(precision)
    assert models[False].keys() == models[True].keys()
    for name, value in models[False].items():
        assert torch.allclose(value.float(), models[True][name].float(), atol=atol), name


def test_u_transform_is_validated_and_log1p_keeps_the_ordering():
    from hetfl.fl.method import create_method
    from hetfl.methods.fedhydra import U_TRANSFORMS, FedHydra

    with pytest.raises(ValueError, match="u_transform must be one of"):
        FedHydra({"u_transform": "sqrt"}).check(None)
    log1p = create_method("fedhydra_log1p", {})
    assert log1p.params["u_transform"] == "log1p" and FedHydra({}).params["u_transform"] == "none"
    assert (log1p.name, log1p.method) == ("fedhydra_log1p", "fedhydra")  # a preset: a label of fedhydra
    dense_log1p = create_method("fedhydra_dense_log1p", {}).params  # DENSE's loop, only U's transform differs
    assert dense_log1p == {**create_method("fedhydra_dense", {}).params, "u_transform": "log1p"}
    U = torch.tensor([[1.0, 1e5, 3.0], [2e3, 0.5, 10.0]], dtype=torch.float64)
    _, plain = normalise_rows_and_columns(U_TRANSFORMS["none"](U))
    _, compressed = normalise_rows_and_columns(U_TRANSFORMS["log1p"](U))
    assert torch.equal(plain.argsort(dim=0), compressed.argsort(dim=0))  # same ranking per client
    assert float(compressed.min()) > float(plain.min())  # range compressed: no near-zero weights
    with pytest.raises(ValueError, match="u_transform_on must be"):
        FedHydra({"u_transform_on": "cells"}).check(None)


def test_u_transform_on_feeds_the_transform_to_one_normalisation_only(tmp_path):
    from hetfl.methods.fedhydra import normalise_rows_and_columns

    cfg = json.loads(json.dumps(SMOKE))
    cfg["methods"] = {"fedhydra": {"epochs": 1, "generator_steps": 2, "batch_size": 8, "strat_batch_size": 4,
                                   "u_transform": "log1p", "u_transform_on": "columns"}}
    Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True).run()
    saved = json.loads((tmp_path / "run" / "fedhydra" / "stratification.json").read_text())
    U = torch.tensor(saved["U"], dtype=torch.float64)
    plain_r, _ = normalise_rows_and_columns(U)
    _, log_c = normalise_rows_and_columns(torch.log1p(U))
    assert torch.allclose(torch.tensor(saved["U_r"], dtype=torch.float64), plain_r)  # Eq. 5 as written
    assert torch.allclose(torch.tensor(saved["U_c"], dtype=torch.float64), log_c)  # Eq. 7 on log(1 + U)


def test_bad_generator_settings_fail_before_any_training(tmp_path):
    cfg = json.loads(json.dumps(SMOKE))
    cfg["methods"] = {"fedavg": {}, "dense": {"epochs": 0}}
    with pytest.raises(ValueError, match="methods.dense.epochs: 0: must be >= 1"):
        Simulator(prepare(validate(cfg)), tmp_path, None, quiet=True).run()
    assert not (tmp_path / "fedavg" / "fedavg.safetensors").exists()


def test_fedhydra_ablation_keys_are_validated_and_adv_mask_selects_samples():
    from hetfl.fl.datafree import DataFreeConfig
    from hetfl.methods.fedhydra import FedHydra, FedHydraRecipe

    for key, bad, message in [("aggregation", "median", "aggregation must be one of"),
                              ("column_scale", "max", "column_scale must be"),
                              ("adv_mask", "both", "adv_mask must be one of"),
                              ("saturated", "min", "saturated must be 'eq2'"),
                              ("reset_generator", "yes", "reset_generator: 'yes': input should be a valid boolean")]:
        with pytest.raises(ValueError, match=message):
            FedHydra({key: bad}).check(None)
    m, c = 2, 3
    U_r, U_c = torch.full((c, m), 1 / m), torch.full((c, m), 1 / c)
    P = torch.tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    s = torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.0, 3.0]])  # sample 0 agrees with P, sample 1 does not
    y, bn, cfg = torch.tensor([0, 1]), torch.zeros(m), DataFreeConfig(lambda_bn=0.0, lambda_adv=1.0)
    ce = F.cross_entropy(P, y)
    kl = kl_div(P, s, 1.0, reduction="none")
    plain = FedHydraRecipe(U_r, U_c, 1.0).generator_loss(P, s, y, bn, cfg)
    masked = FedHydraRecipe(U_r, U_c, 1.0, adv_mask="disagree").generator_loss(P, s, y, bn, cfg)
    assert float(plain) == pytest.approx(float(ce - kl.mean()))  # Eq. 15-16: every sample
    assert float(masked) == pytest.approx(float(ce - kl[1] / 2))  # only the disagreeing sample, batch mean
    agree = FedHydraRecipe(U_r, U_c, 1.0, adv_mask="agree").generator_loss(P, s, y, bn, cfg)
    assert float(agree) == pytest.approx(float(ce - kl[0] / 2))  # only the agreeing sample


def test_fedhydra_with_a_replay_pool_checkpoints_and_resumes(tmp_path):
    cfg = json.loads(json.dumps(SMOKE))
    cfg["methods"] = {"fedhydra": {"epochs": 3, "generator_steps": 2, "batch_size": 16, "strat_batch_size": 4,
                                   "checkpoint_every": 1, "pool_size": -1, "replay": 2}}
    first = Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True,
                  keep_checkpoints=True).run()
    info = json.loads((tmp_path / "run" / "fedhydra" / "checkpoint.json").read_text())
    assert info["epoch"] == 3 and info["pool"] == 3 * 2  # every intermediate batch of every epoch kept
    again = Simulator(prepare(validate(cfg)), tmp_path / "run", tmp_path / "cache", quiet=True,
                  keep_checkpoints=True).run()
    assert again["results"]["fedhydra"]["resumed_from_epoch"] == 3
    assert again["results"]["fedhydra"]["accuracy"] == pytest.approx(first["results"]["fedhydra"]["accuracy"])


def _distiller(tmp_path, **cfg):
    from hetfl.fl.datafree import DataFreeConfig, DataFreeDistiller
    from hetfl.fl.method import ServerContext
    from hetfl.methods.dense import DenseRecipe

    torch.manual_seed(0)
    teachers = [build_model("cnn2", 1, 28, 10) for _ in range(2)]
    ctx = ServerContext(seed=0, num_classes=10, shape=(1, 28, 28), num_clients=2, client_archs=["cnn2"] * 2,
                        server_arch="cnn2", train_cfg=TrainConfig(), device=CPU, out_dir=tmp_path,
                        evaluate=lambda model: {"accuracy": 0.0}, log=lambda *a, **k: None,
                        progress=lambda it, **k: it, pooled_train_data=lambda: None)
    config = DataFreeConfig(**{"epochs": 1, "generator_steps": 1, "batch_size": 8, "lr": 0.5, "momentum": 0.0,
                               **cfg})
    return DataFreeDistiller(teachers, build_model("cnn2", 1, 28, 10), DenseRecipe(), config, ctx, "dense")


def test_teacher_logits_record_bn_statistics_only_for_the_generator_step(tmp_path):
    """The generator's step asks for the teachers' BN statistics (its L_BN); other forwards (Co-Boosting's
    ODS) get the same logits without them."""
    engine = _distiller(tmp_path)
    x = torch.rand(8, 1, 28, 28)
    plain = engine.teacher_logits(x)
    assert float(engine.bn.per_model().abs().sum()) == 0
    recorded = engine.teacher_logits(x, record_stats=True)
    assert torch.equal(plain, recorded) and bool((engine.bn.per_model() > 0).all())
    recorded_in_step: list[float] = []
    original = engine.recipe.generator_loss

    def spy(P, s, y, bn, cfg):
        recorded_in_step.append(float(bn.detach().sum()))
        return original(P, s, y, bn, cfg)

    engine.recipe.generator_loss = spy
    engine.synthesize(1)
    assert recorded_in_step and all(v > 0 for v in recorded_in_step)  # L_BN reached the generator's loss


def test_pool_shuffle_redraws_the_kd_batches_from_every_sample_each_epoch(tmp_path):
    """``pool_shuffle`` (DENSE's and Co-Boosting's shuffled DataLoader over the pool): the same
    samples with their labels and client logits, in another seeded order each epoch, cut into
    ``batch_size`` batches; the same seed gives the same batches; an epoch then distils
    ceil(samples / batch_size) batches and logs no ``kd_loss_new`` (fresh samples are mixed in)."""
    engine = _distiller(tmp_path / "a", pool_shuffle=True, pool_size=-1, replay=-1)
    batches = [engine.synthesize(e)[0] for e in (1, 2, 3)]
    x3, y3, logits3 = batches[2]
    batches[2] = (x3[:5], y3[:5], logits3[:, :5])  # a short batch: 8 + 8 + 5 = 21 samples

    def key(x: torch.Tensor, y: torch.Tensor, lg: torch.Tensor) -> list[tuple]:
        return [(bytes(x[i].flatten().tolist()), int(y[i]), tuple(lg[:, i].flatten().tolist())) for i in range(len(y))]

    one, two = engine.shuffled(batches, 1), engine.shuffled(batches, 2)
    assert [len(b[1]) for b in one] == [8, 8, 5]
    assert sorted(sum((key(*b) for b in one), [])) == sorted(sum((key(*b) for b in batches), []))
    assert not torch.equal(torch.cat([b[1] for b in one]), torch.cat([b[1] for b in two])) or \
        not torch.equal(torch.cat([b[0] for b in one]), torch.cat([b[0] for b in two]))  # another order
    again = _distiller(tmp_path / "b", pool_shuffle=True).shuffled(batches, 1)
    assert all(torch.equal(a, b) for x, y in zip(one, again) for a, b in zip(x, y))
    engine.pool.extend(batches[:2])
    row = engine.epoch(2)
    assert "kd_loss_new" not in row and row["kd_loss"] > 0
    plain = _distiller(tmp_path / "c", pool_size=-1, replay=-1)
    plain.pool.extend(batches[:2])
    assert "kd_loss_new" in plain.epoch(2)


def test_kd_step_reports_its_peak_gradient_norm_and_grad_clip_bounds_the_step(tmp_path):
    from hetfl.fl.datafree import DataFreeConfig

    with pytest.raises(ValueError, match="grad_clip must be >= 0"):
        DataFreeConfig(grad_clip=-1.0)
    steps = {}
    for clip in (0.0, 1e-3):
        engine = _distiller(tmp_path / str(clip), grad_clip=clip)
        batch = engine.synthesize(1)
        before = torch.cat([p.detach().flatten().clone() for p in engine.student.parameters()])
        stats = engine.distill(batch, new=1)
        loss, peak, dead = stats["kd_loss"], stats["kd_grad_max"], stats["dead_units"]
        assert 0.0 <= dead < 1.0 and stats["kd_loss_new"] == loss  # a fresh student passes signal; one new batch
        after = torch.cat([p.detach().flatten() for p in engine.student.parameters()])
        assert np.isfinite(loss) and peak > 1e-3  # the norm before clipping, in both runs
        steps[clip] = (float((after - before).norm()), peak)
    assert steps[0.0][1] == pytest.approx(steps[1e-3][1], rel=1e-5)  # same start, same batch, same norm
    assert steps[0.0][0] == pytest.approx(0.5 * steps[0.0][1], rel=1e-4)  # plain SGD: lr x |g|
    assert steps[1e-3][0] == pytest.approx(0.5 * 1e-3, rel=1e-3)  # clipped to lr x grad_clip


def test_synthesis_skips_the_students_weight_gradients_and_gives_the_same_batches(tmp_path, monkeypatch):
    """The generator's steps backpropagate through the student (adversarial term) for the gradient
    of x only: the student gets no weight gradient there, stays trainable afterwards, and the kept
    batches equal those of a loop that computed the weight gradients too, to the bit."""
    import contextlib

    from hetfl.fl import datafree

    runs = {}
    for how in ("frozen", "unfrozen"):
        if how == "unfrozen":
            monkeypatch.setattr(datafree, "weights_frozen", lambda model: contextlib.nullcontext())
        engine = _distiller(tmp_path / how, generator_steps=3, lambda_adv=1.0)
        batches = engine.synthesize(1)
        grads = [p.grad for p in engine.student.parameters()]
        assert all(p.requires_grad for p in engine.student.parameters())
        runs[how] = (batches, grads)
    assert all(g is None for g in runs["frozen"][1])
    assert any(g is not None for g in runs["unfrozen"][1])  # the old loop did compute them
    for (x1, y1, l1), (x2, y2, l2) in zip(runs["frozen"][0], runs["unfrozen"][0], strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2) and torch.equal(l1, l2)


def test_kd_loss_new_is_the_loss_of_the_fresh_batches_before_their_step(tmp_path):
    import copy

    engine = _distiller(tmp_path)
    batch = engine.synthesize(1)
    x, P = engine.recipe.kd_batch(engine, batch[0])
    before = copy.deepcopy(engine.student).train()
    with torch.no_grad():
        first = float(engine.recipe.student_loss(P, before(x), engine.cfg))
    stats = engine.distill(batch + batch, new=1)  # the fresh batch, then the same batch replayed
    assert stats["kd_loss_new"] == pytest.approx(first, rel=1e-5)
    second = 2 * stats["kd_loss"] - first  # the same batch after one SGD step (lr 0.5: overshoots)
    assert abs(second - first) > 1e-3
    assert "kd_loss_new" not in engine.distill(batch)  # nothing new: not logged


def test_dead_units_counts_relu_channels_that_are_never_positive():
    from hetfl.fl.datafree import DeadUnits

    torch.manual_seed(0)
    model = build_model("cnn2", 1, 28, 10).train()
    x = torch.rand(16, 1, 28, 28)
    probe = DeadUnits(model)
    model(x)
    probe.remove()
    assert probe.fraction() is not None and float(probe.fraction()) == 0.0  # BN in train mode: both signs
    bn = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    with torch.no_grad():
        bn[1].bias.fill_(-100.0)  # the second block's ReLU sees only negatives: its 32 channels are dead
        bn[0].bias[:4] = -100.0  # and 4 of the first block's 16
    probe = DeadUnits(model)
    model(x)
    probe.remove()
    assert float(probe.fraction()) == pytest.approx((32 + 4) / (16 + 32))
    model(x)  # removed hooks record nothing more
    assert len(probe.alive) == 2
    assert DeadUnits(torch.nn.Linear(3, 2)).fraction() is None  # no ReLU modules: nothing to report


def test_config_key_holds_every_setting_that_changes_the_model_and_not_the_checkpoint_cadence():
    from hetfl.fl.datafree import DataFreeConfig, config_key

    base = json.loads(config_key(DataFreeConfig()))
    assert base["grad_clip"] == 0.0 and base["pool_shuffle"] is False and "checkpoint_every_s" not in base
    for key, value in (("grad_clip", 5.0), ("distill_precision", "bf16"), ("compile", True), ("pool_shuffle", True)):
        assert json.loads(config_key(DataFreeConfig(**{key: value})))[key] == value
    assert config_key(DataFreeConfig(), method="dense") != config_key(DataFreeConfig(grad_clip=1.0), method="dense")
    assert config_key(DataFreeConfig(checkpoint_every_s=5.0)) == config_key(DataFreeConfig())


@pytest.mark.parametrize("bad, match", [({"distill_precision": "fp16"}, "distill_precision must be fp32 or bf16"),
                                        ({"compile": "yes"}, "compile must be true or false")])
def test_distill_precision_and_compile_are_checked(bad, match):
    from hetfl.fl.datafree import DataFreeConfig

    with pytest.raises(ValueError, match=match):
        DataFreeConfig(**bad)


def test_compile_without_a_cpp_compiler_fails_before_training(monkeypatch):
    import hetfl.methods  # noqa: F401
    from hetfl.fl import precision
    from hetfl.fl.method import create_method

    monkeypatch.setattr(precision.shutil, "which", lambda name: None)
    ctx = type("Ctx", (), {"device": CPU})()
    with pytest.raises(ValueError, match="compile: true needs a C\\+\\+ compiler"):
        create_method("fedhydra", {"compile": True}).check(ctx)
    create_method("fedhydra", {}).check(ctx)  # the eager default needs none


def test_bf16_distillation_steps_the_student_close_to_fp32(tmp_path):
    """``distill_precision: bf16`` autocasts the student's forward in the KD steps: from the same
    weights on the same batches the losses agree to bf16's precision, and the weights stay fp32."""
    kd = {}
    for precision in ("fp32", "bf16"):
        engine = _distiller(tmp_path / precision, distill_precision=precision, batch_size=32, lr=0.05)
        batches = engine.synthesize(1)
        kd[precision] = (engine.distill(batches * 3)["kd_loss"],
                         torch.cat([p.detach().flatten() for p in engine.student.parameters()]))
    assert kd["bf16"][1].dtype == torch.float32
    assert kd["bf16"][0] == pytest.approx(kd["fp32"][0], rel=0.05)
    assert not torch.equal(kd["bf16"][1], kd["fp32"][1])  # another arithmetic, so other weights
    assert torch.allclose(kd["bf16"][1], kd["fp32"][1], atol=0.05)


def test_bf16_distillation_also_runs_coboostings_ods_teachers_in_bf16(tmp_path):
    """With ``distill_precision: bf16`` Co-Boosting's ODS passes through the teachers run in bf16
    (their convolutions' outputs are bf16), and give fp32 logits and images close to fp32's: each
    pixel moves by at most eta, and the teachers' logits on the perturbed images agree to bf16's
    precision; with fp32 they stay fp32."""
    from hetfl.methods.coboosting import CoBoosting, CoBoostingRecipe

    x8 = torch.randint(0, 256, (32, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    y = torch.arange(32) % 10
    params = CoBoosting.method_defaults
    out = {}
    for precision in ("fp32", "bf16"):
        engine = _distiller(tmp_path / precision, distill_precision=precision)
        engine.recipe = CoBoostingRecipe(2, CPU, params, seed=0)
        dtypes: list[torch.dtype] = []
        hook = engine.teachers[0].features[0].register_forward_hook(
            lambda m, i, o, seen=dtypes: seen.append(o.dtype))
        x_ods, P = engine.recipe.kd_batch(engine, (x8, y, torch.zeros(2, 32, 10)))
        hook.remove()
        assert dtypes == [torch.bfloat16 if precision == "bf16" else torch.float32] * 2
        assert x_ods.dtype == P.dtype == torch.float32 and P.shape == (32, 10)
        assert float((x_ods - x8.float() / 255).abs().max()) <= params["ods_eta"] + 1e-6
        out[precision] = (x_ods, P)
    assert float((out["bf16"][0] == out["fp32"][0]).float().mean()) > 0.8  # the same ODS step for most pixels
    assert torch.allclose(out["bf16"][1], out["fp32"][1], rtol=0.05, atol=0.05)


def test_compiled_generator_step_keeps_the_eager_batches(tmp_path):
    """``compile`` runs the teachers', student's and BN hooks' part of each generator step through
    torch.compile: the same synthetic batches and client logits as eager mode, up to float
    summation order, and the BN hooks still feed L_BN (one graph for every step)."""
    out, guided = {}, {}
    x = torch.rand(16, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    y = torch.arange(16) % 10
    for flag in (False, True):
        engine = _distiller(tmp_path / str(flag), compile=flag, generator_steps=3, batch_size=16)
        out[flag] = engine.synthesize(1)
        assert not any(engine.bn.values)  # the hooks' lists are emptied after each step
        guided[flag] = engine._guide(x.contiguous(memory_format=torch.channels_last), y)
    for (x0, y0, l0), (x1, y1, l1) in zip(out[False], out[True], strict=True):
        assert torch.equal(y0, y1)
        assert (x0.int() - x1.int()).abs().max() <= 1  # uint8 images: at most one level apart
        assert torch.allclose(l0, l1, atol=1e-3)
    bn_eager, bn_compiled = guided[False][3], guided[True][3]
    assert bn_eager.shape == (2,) and float(bn_eager.min()) > 0  # one L_BN per teacher, from the hooks
    assert torch.allclose(bn_compiled, bn_eager, rtol=1e-4)
    for eager, compiled in zip(guided[False][:3], guided[True][:3], strict=True):  # logits, P, student
        assert torch.allclose(compiled, eager, atol=1e-4)


def test_feddf_resumes_an_interrupted_distillation_to_the_same_students(tmp_path, monkeypatch):
    """FedDF saves each student's distillation (and the teachers' logits): a run stopped in its second
    student's distillation, by an exception after periodic saves or by Ctrl-C (saved after the step
    under way), goes on from there and ends with the uninterrupted run's students, accuracy and best
    accuracy; the teachers' pass is not repeated, no evaluation is logged twice, the files go at the end."""

    from hetfl.methods import feddf as feddf_module

    cfg = json.loads(json.dumps(SMOKE))
    cfg["client"].update(model=["cnn2", "lenet5", "cnn2"], epochs=2)
    cfg["methods"] = {"feddf": {"steps": 20, "eval_every": 5, "aux_size": 100, "prototypes": "all"}}
    full = Simulator(prepare(validate(cfg)), tmp_path / "full", tmp_path / "cache", quiet=True).run()["results"]
    original_kl, original_predict = feddf_module.kl_div, feddf_module.predict_logits

    def run_stopped(name: str, stop_at: int, how: str, every_s: float) -> dict:
        calls, passes = [], []

        def kl(*args, **kw):
            calls.append(1)
            if len(calls) == stop_at and how == "raise":
                raise KeyboardInterrupt
            if len(calls) == stop_at:
                signal.raise_signal(signal.SIGINT)  # held back until the step is done and saved
            return original_kl(*args, **kw)

        def predict(*args, **kw):
            passes.append(1)
            return original_predict(*args, **kw)

        monkeypatch.setattr(feddf_module, "CHECKPOINT_EVERY_S", every_s)
        monkeypatch.setattr(feddf_module, "kl_div", kl)
        monkeypatch.setattr(feddf_module, "predict_logits", predict)
        with pytest.raises(KeyboardInterrupt):
            Simulator(prepare(validate(cfg)), tmp_path / name, tmp_path / "cache", quiet=True).run()
        assert passes == [1] and (tmp_path / name / "feddf" / "teacher-logits.safetensors").is_file()
        calls.clear()
        passes.clear()
        resumed = Simulator(prepare(validate(cfg)), tmp_path / name, tmp_path / "cache", quiet=True).run()["results"]
        assert passes == []  # the teachers' logits came from the interrupted run
        return {"resumed": resumed, "steps_after": len(calls)}

    for name, stop_at, how, every_s in (("raised", 31, "raise", 0.0), ("ctrl-c", 27, "signal", 1e9)):
        got = run_stopped(name, stop_at, how, every_s)
        r, f = got["resumed"]["feddf"], full["feddf"]
        # the second student (lenet5) had done 10 steps (exception: saved after every step) or 7 (Ctrl-C
        # during step 7: saved once that step was done); the headline's 20 steps were saved at its end
        assert got["steps_after"] == (10 if how == "raise" else 13)
        assert r["resumed_from_step"] == {"cnn2": 20, "lenet5": 10 if how == "raise" else 7}
        assert r["accuracy"] == f["accuracy"] and r["best_accuracy"] == f["best_accuracy"]
        assert r["models"] == f["models"]
        # the stopped run's teacher pass and steps count in the stage's seconds
        assert r["seconds"] >= r["server_seconds"] > r["seconds_before_resume"] > 0
        assert r["distill_seconds"] + r["teacher_seconds"] >= r["seconds_before_resume"] - 0.2  # rounding
        assert "seconds_before_resume" not in f
        for student in ("feddf", "feddf_lenet5"):
            a = load_file(str(tmp_path / name / "feddf" / f"{student}.safetensors"))
            b = load_file(str(tmp_path / "full" / "feddf" / f"{student}.safetensors"))
            assert all(torch.equal(a[k], b[k]) for k in b), student
        rows = [json.loads(x) for x in (tmp_path / name / "feddf" / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows if "accuracy" in x and x["step"] > 0] == [5, 10, 15, 20]
        assert not list((tmp_path / name / "feddf").glob("*checkpoint*")) and not list(
            (tmp_path / name / "feddf").glob("teacher-logits*"))


def test_strat_precision_bf16_puts_only_the_generators_in_bf16_and_keeps_u_close():
    """``strat_precision: bf16``: the teacher sees fp32 images and the CE stays float64, so the loss
    trajectories stay close to fp32's (a bias would shift them all one way); fp32 is the default."""
    from hetfl.methods import fedhydra as fh

    teachers = _teachers(classes=4, clients=2, epochs=2)
    seen: list[torch.dtype] = []
    hook = teachers[0].features[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    kw = dict(num_classes=4, shape=(1, 16, 16), steps=6, batch=8, lr=1e-3, nz=16, seed=3, device=CPU)
    L32 = fh.stratify_losses(teachers, **kw)
    L16 = fh.stratify_losses(teachers, **kw, precision="bf16")
    hook.remove()
    assert L32.dtype == L16.dtype == torch.float64 and L16.shape == L32.shape == (4, 2, 6)
    assert seen and set(seen) == {torch.float32}  # the teacher's input is fp32 in both
    assert not torch.equal(L16, L32)  # the generators did run in bf16
    assert torch.allclose(L16[..., 0], L32[..., 0], rtol=0.05)  # the same untrained generators: rounding only
    log_ratio = torch.log(L16 / L32)  # later steps drift apart (losses span 1e-6..1e2 here), but not one way
    assert float(log_ratio.abs().median()) < 0.2 and abs(float(log_ratio.mean())) < 0.2
    assert torch.equal(fh.stratify_losses(teachers, **kw, precision="fp32"), L32)  # fp32: as before


def test_strat_precision_is_checked_and_is_part_of_the_checkpoint_key(tmp_path):
    import hetfl.methods  # noqa: F401
    from hetfl.fl.datafree import config_key
    from hetfl.fl.method import create_method
    from hetfl.fl.payload import Payload

    ctx = type("Ctx", (), {"device": CPU})()
    with pytest.raises(ValueError, match="strat_precision: 'fp16': must be one of 'fp32' or 'bf16'"):
        create_method("fedhydra", {"strat_precision": "fp16"}).check(ctx)
    uploads = {0: Payload(meta={"client_id": 0}, tensors={})}
    method = create_method("fedhydra", {"epochs": 3})
    assert method.params["strat_precision"] == "fp32"
    assert method.checkpoint_key(uploads) == config_key(method.config, method="fedhydra", params=method.params,
                                                        uploads=[0])
    assert json.loads(method.checkpoint_key(uploads))["params"]["strat_precision"] == "fp32"
    bf16 = create_method("fedhydra", {"epochs": 3, "strat_precision": "bf16"})
    assert json.loads(bf16.checkpoint_key(uploads))["params"]["strat_precision"] == "bf16"


def test_compile_evaluates_the_student_through_torch_compile_with_the_eager_logits(tmp_path):
    """With ``compile`` the per-epoch test pass goes through a compiled view of the student (the same
    parameters, eval mode): its logits equal eager ones up to float summation order, and the student
    trains on between evaluations without recompiling into another model."""
    engine = _distiller(tmp_path, compile=True, generator_steps=2, batch_size=16, epochs=2)
    x = torch.rand(32, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    seen = []

    def evaluate(model):
        model.eval()
        with torch.no_grad():
            seen.append((model, model(x), engine.student(x)))
        return {"accuracy": 0.0}

    engine.ctx.evaluate = evaluate
    engine.epoch(1)
    engine.epoch(2)
    assert len(seen) == 2
    assert all(model is not engine.student and model._orig_mod is engine.student for model, _, _ in seen)
    for _, compiled, eager in seen:
        assert torch.allclose(compiled, eager, atol=1e-5)
    assert not torch.allclose(seen[0][2], seen[1][2])  # the student learnt between the two passes
