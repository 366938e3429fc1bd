"""FedMHO family and FedCVAE: CVAEs, allocation, K-means filter, initialisation, frozen teacher, runs."""

import json
import math
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from hetfl.config import ConfigError
from hetfl.data import make_partition
from hetfl.data.synthetic import load_synthetic
from hetfl.engine.simulator import Simulator, prepare
from hetfl.fl.aggregate import weighted_average
from hetfl.fl.client import ClientEnv, handle
from hetfl.fl.generative import (
    CVAETrain,
    FusionConfig,
    allocate_by_share,
    allocate_per_class,
    generate,
    kd_term,
    keep_count,
    kmeans_filter,
    largest_remainder,
    teacher_stats,
    train_cvae_model,
    train_on_synthetic,
)
from hetfl.fl.method import ServerContext, create_method
from hetfl.fl.payload import Payload
from hetfl.fl.train_config import TrainConfig
from hetfl.fl.training import evaluate
from hetfl.methods.checks import validate
from hetfl.methods.fedmho import generative_clients
from hetfl.models import count_flops
from hetfl.models.cvae import build_cvae, cvae_flops, sample_latent

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one intra-op thread is as fast alone and far faster when other jobs
    share the cores (two spinning threads per process thrash)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- CVAEs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,channels,size", [("cvae_small", 1, 16), ("cvae_small", 3, 16),
                                                ("cvae_large", 1, 16), ("cvae_large", 3, 32)])
def test_cvae_shapes_and_samples_in_unit_range(name, channels, size):
    torch.manual_seed(0)
    model = build_cvae(name, channels, size, 5, latent_dim=7)
    x, y = torch.rand(4, channels, size, size), torch.tensor([0, 1, 2, 4])
    mu, logvar = model.encode(x, y)
    assert mu.shape == logvar.shape == (4, 7)
    out = model.sample(y, generator=torch.Generator().manual_seed(0))
    assert out.shape == (4, channels, size, size) and float(out.min()) >= 0 and float(out.max()) <= 1
    recon, kl = model.loss(x, y)
    assert recon.item() > 0 and kl.item() >= 0
    assert count_flops(model, channels, size) > 0


def test_cvae_small_flops_match_paper_table2_at_latent_2():
    """Table 2's CVAE-small (408.06K) is the MACs of the MNIST CVAE with latent size 2."""
    assert cvae_flops("cvae_small", 1, 28, 10, latent_dim=2)["forward"] == 2 * 408_064
    assert cvae_flops("cvae_small", 1, 28, 10)["forward"] > 2 * 408_064  # latent 20


def test_cvae_rejects_shapes_it_cannot_take():
    with pytest.raises(ValueError, match="divisible by 8"):
        build_cvae("cvae_small", 3, 20, 10)
    with pytest.raises(ValueError, match="unknown cvae"):
        build_cvae("cvae_huge", 1, 28, 10)


def test_truncated_latent_stays_in_range():
    z = sample_latent(2000, 5, torch.Generator().manual_seed(0), z_range=1.0)
    assert float(z.abs().max()) <= 1.0 and 0.2 < float(z.std()) < 0.7


def test_cvae_trained_on_synthetic_reconstructs_better(synthetic_small):
    """Posterior-mean reconstructions get closer to the images: most of the way from the untrained
    error to the class-mean floor (the synthetic images are class prototypes plus pixel noise)."""
    data = synthetic_small.train
    x, y = data.batch(torch.arange(len(data)))
    floor = sum(float(((x[y == c] - x[y == c].mean(dim=0)) ** 2).sum()) for c in range(4)) / x.numel()
    torch.manual_seed(0)
    model = build_cvae("cvae_small", 1, 16, 4)

    def recon_mse() -> float:
        with torch.no_grad():
            return float(((model.eval().decode(model.encode(x, y)[0], y) - x) ** 2).mean())

    before = recon_mse()
    stats = train_cvae_model(model, data, CVAETrain(epochs=8, batch_size=32, lr=2e-2), CPU, seed=0)
    after = recon_mse()
    assert after < before - 0.8 * (before - floor), (before, after, floor)
    assert stats["recon"] > 0 and stats["kl"] >= 0


def test_cvae_client_uploads_decoder_only(synthetic_small):
    method = create_method("fedmho", {"cvae_epochs": 1, "cvae_lr": 1e-3})
    ctx = make_ctx(synthetic_small, num_clients=2)
    upload = handle(method.client_message(1, ctx), ClientEnv(1, synthetic_small.train, CPU))
    model = build_cvae("cvae_small", 1, 16, 4)
    assert set(upload.tensors) == set(model.decoder.state_dict())
    assert upload.meta["cvae"] == "cvae_small" and upload.meta["latent_dim"] == 20
    assert upload.meta["label_counts"] == synthetic_small.train.label_counts().tolist()
    assert method.client_message(0, ctx).meta["task"] == "train_classifier"


# ---- allocation and sampling ------------------------------------------------------------------------
def test_largest_remainder_is_exact_and_proportional():
    parts = largest_remainder(10, [1, 1, 1])
    assert parts.tolist() == [4, 3, 3]
    w = torch.tensor([5.0, 0.0, 2.0, 3.0])
    parts = largest_remainder(997, w)
    assert int(parts.sum()) == 997 and ((parts - 997 * w / w.sum()).abs() < 1).all() and parts[1] == 0
    assert largest_remainder(5, [0, 0]).tolist() == [3, 2]


def test_decoders_sample_the_requested_labels_in_the_requested_proportions():
    counts = torch.tensor([[30, 0, 10, 0], [10, 20, 0, 0], [0, 5, 5, 40]])
    # FedMHO (official code): N/C per class, split by squared counts
    alloc = allocate_per_class(counts, 1000)
    assert alloc.sum().item() == 1000 and alloc.sum(dim=0).tolist() == [250, 250, 250, 250]
    sq = counts.double() ** 2
    for c in range(3):
        assert ((alloc[:, c] - 250 * sq[:, c] / sq[:, c].sum()).abs() < 1).all()
    assert alloc[:, 3].tolist() == [0, 0, 250]
    # FedCVAE: by data share, then by each client's label distribution
    share = allocate_by_share(counts, 999)
    sizes = counts.sum(dim=1).double()
    assert share.sum().item() == 999 and ((share.sum(dim=1) - 999 * sizes / sizes.sum()).abs() < 1).all()
    for k in range(3):
        n_k = share[k].sum()
        assert ((share[k] - n_k * counts[k] / counts[k].sum()).abs() < 1).all()
    # each decoder decodes exactly its row, labels as requested
    torch.manual_seed(0)
    decs = [build_cvae("cvae_small", 1, 8, 4, latent_dim=3) for _ in range(3)]
    x, y = generate(decs, alloc, seed=0)
    assert x.shape == (1000, 1, 8, 8)
    offset = 0
    for k in range(3):
        n = int(alloc[k].sum())
        assert torch.bincount(y[offset : offset + n], minlength=4).tolist() == alloc[k].tolist()
        offset += n
    x2, y2 = generate(decs, alloc, seed=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # seeded


# ---- unsupervised data optimisation -----------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.8, 0.5, 0.4, 1.0])
def test_kmeans_filter_keeps_round_ratio_per_class_and_drops_the_farthest(ratio):
    g = torch.Generator().manual_seed(0)
    sizes = [10, 7, 25, 1]
    y = torch.cat([torch.full((n,), c) for c, n in enumerate(sizes)])
    x = torch.rand(len(y), 1, 4, 4, generator=g)
    x[torch.nonzero(y == 2).squeeze(1)[:3]] += 5  # outliers
    keep = kmeans_filter(x, y, ratio)
    kept = torch.zeros(len(y), dtype=torch.bool)
    kept[keep] = True
    for c, n in enumerate(sizes):
        assert int(kept[y == c].sum()) == keep_count(n, ratio) == int(torch.floor(torch.tensor(ratio * n) + 0.5))
        pts = x[y == c].flatten(1)
        dist = (pts - pts.mean(dim=0)).norm(dim=1)
        k_mask = kept[y == c]
        if k_mask.any() and (~k_mask).any():
            assert float(dist[~k_mask].min()) >= float(dist[k_mask].max())
    with pytest.raises(ValueError, match="R_th"):
        kmeans_filter(x, y, 0.0)


def test_kmeans_filter_drops_planted_outliers():
    y = torch.zeros(10, dtype=torch.long)
    x = torch.zeros(10, 1, 2, 2)
    x[3] += 10
    x[7] -= 10
    keep = kmeans_filter(x, y, 0.8)
    assert keep.tolist() == [0, 1, 2, 4, 5, 6, 8, 9]


# ---- server: initialisation and frozen teacher ---------------------------------------------------
def make_ctx(splits, num_clients: int, archs: list[str] | None = None, server_arch: str = "cnn2") -> ServerContext:
    return ServerContext(
        seed=0, num_classes=splits.num_classes, shape=splits.shape, num_clients=num_clients,
        client_archs=archs or ["cnn2"] * num_clients, server_arch=server_arch,
        train_cfg=TrainConfig(epochs=2, batch_size=32, lr=0.05), device=CPU,
        out_dir=Path(tempfile.mkdtemp(prefix="hetfl-fedmho-")),  # a stage's checkpoint goes there
        evaluate=lambda m: evaluate(m, splits.test, CPU), log=lambda step, **kw: None,
        progress=lambda it, **kw: it, pooled_train_data=lambda: splits.train, dataset="synthetic",
    )


FAST = {"cvae_epochs": 2, "cvae_lr": 1e-3, "num_samples": 200, "epochs": 2, "lr": 1e-3}


@pytest.fixture(scope="module")
def four_clients():
    """Uploads of 4 clients (0, 1 classifiers; 2, 3 CVAEs), shared by the server tests: every
    FedMHO variant sends the same requests."""
    splits = load_synthetic(classes=4, channels=1, size=16, train_per_class=60, test_per_class=30, seed=3)
    part = make_partition(splits.train.y.numpy(), 4, {"kind": "dirichlet", "alpha": 1.0, "min_size": 10}, 0,
                          num_classes=splits.num_classes)
    ctx = make_ctx(splits, 4)
    method = create_method("fedmho", FAST)
    uploads = {cid: handle(method.client_message(cid, ctx),
                           ClientEnv(cid, splits.train.subset(torch.from_numpy(idx)), CPU))
               for cid, idx in enumerate(part.indices)}
    return splits, uploads


def run_server(name: str, four_clients, params: dict, archs: list[str] | None = None):
    splits, uploads = four_clients
    ctx = make_ctx(splits, 4, archs)
    method = create_method(name, {**FAST, **params})
    method.check(ctx)
    if archs:  # other classifier architectures: those clients retrain
        uploads = dict(uploads)
        part = make_partition(splits.train.y.numpy(), 4, {"kind": "dirichlet", "alpha": 1.0, "min_size": 10}, 0,
                              num_classes=splits.num_classes)
        for cid in method.classification_ids(ctx):
            if archs[cid] != "cnn2":
                data = splits.train.subset(torch.from_numpy(part.indices[cid]))
                uploads[cid] = handle(method.client_message(cid, ctx), ClientEnv(cid, data, CPU))
    return method, uploads, method.server(uploads, ctx), ctx


def test_initial_model_is_the_parameter_average_of_classification_clients(four_clients):
    method, uploads, models, ctx = run_server("fedmho", four_clients, {})
    assert method.classification_ids(ctx) == [0, 1] and method.generative_ids(ctx) == [2, 3]
    expected = weighted_average([uploads[c].tensors for c in (0, 1)], [1.0, 1.0])  # Eq. 4: plain mean
    init = models["fedmho[init]"].state_dict()
    for key, value in expected.items():
        assert torch.allclose(init[key], value), key
    assert ctx.record["init"] == "average" and ctx.record["synthetic_used"] == 4 * round(0.8 * 50)
    assert len(ctx.record["curve"]) == 3  # epoch 0 (w_0) and two epochs
    assert "teacher" not in ctx.record  # plain FedMHO has no KD term, so no teacher


def test_sd_teacher_stays_frozen_while_the_global_model_moves(four_clients):
    method, uploads, models, _ = run_server("fedmho_sd", four_clients, {})
    expected = weighted_average([uploads[c].tensors for c in (0, 1)], [1.0, 1.0])
    teacher = method.teacher.state_dict()
    assert all(torch.allclose(teacher[k], v) for k, v in expected.items())
    assert not any(p.requires_grad for p in method.teacher.parameters())
    final = models["fedmho_sd"].state_dict()
    assert any(not torch.allclose(final[k], teacher[k]) for k in teacher if final[k].is_floating_point())


def test_random_init_keeps_the_fresh_server_model_and_sd_distils_from_it(four_clients):
    method, uploads, models, ctx = run_server("fedmho_sd", four_clients, {"init": "random"})
    fresh = ctx.build(ctx.server_arch, purpose="fedmho_sd-global").state_dict()  # same seed, same model
    init = models["fedmho_sd[init]"].state_dict()
    assert ctx.record["init"] == "random"
    assert all(torch.equal(init[k], v) for k, v in fresh.items())
    average = weighted_average([uploads[c].tensors for c in (0, 1)], [1.0, 1.0])
    assert any(not torch.allclose(init[k], v) for k, v in average.items() if v.is_floating_point())
    assert all(torch.equal(method.teacher.state_dict()[k], v) for k, v in fresh.items())


def test_teacher_stats_entropy_and_per_class_agreement():
    uniform = teacher_stats(torch.zeros(6, 3), torch.tensor([0, 0, 1, 1, 1, 2]), 3)
    assert uniform["entropy"] == pytest.approx(math.log(3), abs=1e-4) == uniform["max_entropy"]
    # a confident teacher that predicts class 0 for everything but the last class-1 sample
    logits = torch.full((6, 4), -20.0)
    logits[:, 0] = 20.0
    logits[4] = torch.tensor([-20.0, 20.0, -20.0, -20.0])
    stats = teacher_stats(logits, torch.tensor([0, 0, 1, 1, 1, 2]), 4)
    assert stats["entropy"] == pytest.approx(0.0, abs=1e-4)
    assert stats["agreement"] == pytest.approx(50.0, abs=1e-3)  # in %, as every accuracy
    assert stats["agreement_per_class"] == [100.0, pytest.approx(100 / 3, abs=1e-3), 0.0, None]  # no class-3 sample
    empty = teacher_stats(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), 2)
    assert empty == {"entropy": None, "max_entropy": pytest.approx(math.log(2), abs=1e-4), "agreement": None,
                     "agreement_per_class": [None, None]}
    with pytest.raises(ValueError, match="do not match 5 labels over 4 classes"):
        teacher_stats(logits, torch.zeros(5, dtype=torch.long), 4)


@pytest.mark.parametrize("name", ["fedmho_md", "fedmho_sd"])
def test_md_and_sd_record_what_their_teacher_says_on_the_synthetic_set(four_clients, name):
    _, _, _, ctx = run_server(name, four_clients, {})
    stats = ctx.record["teacher"]
    assert 0.0 <= stats["entropy"] <= stats["max_entropy"] == pytest.approx(math.log(4), abs=1e-4)
    assert len(stats["agreement_per_class"]) == 4 and all(0.0 <= a <= 100.0 for a in stats["agreement_per_class"])
    assert stats["agreement"] == pytest.approx(sum(stats["agreement_per_class"]) / 4, abs=1e-2)  # 40 per class


def test_heterogeneous_classifiers_initialise_by_ensemble_distillation(four_clients):
    _, _, models, ctx = run_server("fedmho_md", four_clients, {"init_epochs": 1},
                                   archs=["cnn2", "lenet5", "cnn2", "cnn2"])
    assert ctx.record["init"] == "distill" and "fedmho_md" in models


def test_kd_term_mean_is_torch_kldivloss_default():
    torch.manual_seed(0)
    teacher, student = torch.randn(8, 10), torch.randn(8, 10)
    p, log_p, log_q = torch.softmax(teacher, 1), torch.log_softmax(teacher, 1), torch.log_softmax(student, 1)
    expected = (p * (log_p - log_q)).mean()  # KLDivLoss() default: / (batch x classes)
    assert torch.allclose(kd_term(teacher, student, "mean"), expected, atol=1e-6)
    assert torch.allclose(kd_term(teacher, student, "batchmean"), expected * 10, atol=1e-5)


@pytest.mark.parametrize("freeze_bn", [False, True])
def test_freeze_bn_keeps_running_statistics_and_still_trains(freeze_bn):
    from hetfl.models import build_model

    torch.manual_seed(0)
    model = build_model("cnn2", 1, 16, 4)
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert bns  # cnn2 has BatchNorm: the test is about those layers
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.rand(96, 1, 16, 16) * 3 + 1, torch.randint(0, 4, (96,))  # statistics far from N(0, 1)
    cfg = FusionConfig(epochs=2, batch_size=32, lr=1e-2, freeze_bn=freeze_bn)
    train_on_synthetic(model, x, y, cfg, seed=0)
    after = model.state_dict()
    stats = [k for k in after if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    weights = [k for k in after if k not in stats]
    assert stats and all(torch.equal(before[k], after[k]) for k in stats) == freeze_bn
    assert any(not torch.equal(before[k], after[k]) for k in weights)  # the weights move either way
    assert all(m.training != freeze_bn for m in bns)


def test_freeze_bn_must_be_a_bool():
    with pytest.raises(ValueError, match="freeze_bn must be true or false"):
        FusionConfig(freeze_bn="yes")


@pytest.mark.parametrize("bad, match", [({"precision": "fp16"}, "precision must be fp32 or bf16"),
                                        ({"channels_last": 1}, "channels_last must be true or false")])
def test_fusion_precision_and_layout_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        FusionConfig(**bad)


def _fusion_run(precision: str, channels_last: bool):
    """A cnn2 server stage on a fixed synthetic set; returns (model, curve, and per evaluation whether
    autocast was on and the dtype of the model's output there)."""
    from hetfl.models import build_model

    torch.manual_seed(0)
    model = build_model("cnn2", 1, 16, 4)
    x, y = torch.rand(96, 1, 16, 16), torch.randint(0, 4, (96,))
    seen = []

    def evaluate(m):
        with torch.no_grad():
            out = m.eval()(x)
        seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
        return {"accuracy": float((out.float().argmax(1) == y).float().mean() * 100)}

    cfg = FusionConfig(epochs=2, batch_size=32, lr=1e-2, precision=precision, channels_last=channels_last)
    curve = train_on_synthetic(model, x, y, cfg, seed=0, evaluate=evaluate)
    return model, curve, seen


def test_bf16_fusion_autocasts_training_and_curve_evaluations_and_keeps_fp32_weights():
    model, curve, seen = _fusion_run("bf16", channels_last=True)
    assert len(curve) == 3 and all(enabled for enabled, _ in seen)
    assert {dtype for _, dtype in seen} == {torch.bfloat16}  # the curve's forwards ran in bf16
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
    assert all(p.is_contiguous() for p in model.parameters())  # handed back in the default layout
    _, _, seen32 = _fusion_run("fp32", channels_last=False)
    assert seen32 == [(False, torch.float32)] * 3  # the default: fp32, no autocast


def test_channels_last_fusion_matches_the_default_layout():
    nchw, curve, _ = _fusion_run("fp32", channels_last=False)
    nhwc, curve_nhwc, _ = _fusion_run("fp32", channels_last=True)
    assert curve == curve_nhwc
    # the same steps, summed in another order; compared as functions in train mode, where BatchNorm
    # cancels the conv biases (their gradient is zero up to rounding, which Adam magnifies to ~lr)
    x = torch.rand(16, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(nchw.train()(x), nhwc.train()(x), atol=1e-3)


def test_md_runs_its_server_stage_in_bf16(four_clients):
    _, _, models, ctx = run_server("fedmho_md", four_clients, {"precision": "bf16", "channels_last": True})
    assert len(ctx.record["curve"]) == 3 and ctx.record["teacher"]["agreement"] is not None
    assert all(p.dtype == torch.float32 and p.is_contiguous() for p in models["fedmho_md"].parameters())


def test_klmean_variants_differ_from_md_sd_only_in_the_kd_reduction(four_clients):
    for base in ("fedmho_md", "fedmho_sd"):
        plain, _, _, _ = run_server(base, four_clients, {})
        variant, _, models, _ = run_server(f"{base}_klmean", four_clients, {})
        assert variant.kd == plain.kd and variant.params["kl_reduction"] == "mean"
        assert plain.params["kl_reduction"] == "batchmean"
        assert {k: v for k, v in variant.params.items() if k != "kl_reduction"} == \
            {k: v for k, v in plain.params.items() if k != "kl_reduction"}
        assert f"{base}_klmean" in models


# ---- configuration ----------------------------------------------------------------------------------
def test_generative_clients_half_and_explicit():
    assert generative_clients("half", 10) == [5, 6, 7, 8, 9]
    assert generative_clients("half", 3) == [2]
    assert generative_clients([4, 1], 5) == [1, 4]
    with pytest.raises(ValueError, match="distinct and in"):
        generative_clients([1, 7], 5)


def test_unknown_method_key_fails_in_config(tiny_config):
    tiny_config["methods"] = {"fedmho": {"rth": 0.8}}
    with pytest.raises(ConfigError, match="fedmho.*rth"):
        validate(tiny_config)


@pytest.mark.parametrize("method,params,message", [
    ("fedmho", {"r_th": 1.5}, "r_th"),
    ("fedmho", {"generative_clients": [0, 1, 2]}, "needs at least one classification client"),
    ("fedmho_sd", {"cvae": "cvae_huge"}, "unknown cvae"),
    ("fedmho_md", {"lam": 2.0}, "lambda"),
    ("fedmho_sd", {"freeze_bn": "yes"}, "methods.fedmho_sd.freeze_bn: 'yes': input should be a valid boolean"),
    ("fedmho", {"init": "average"}, "init: average needs"),
    ("fedmho", {"init": "scratch"}, "init must be auto, average, distill or random"),
    ("fedcvae_kd", {"z_range": -1}, "z_range"),
    ("fedcvae_ens", {"cvae_lr": 0}, "methods.fedcvae_ens.cvae_lr: 0: must be > 0"),
    ("fedcvae_ens", {"precision": "fp16"}, "methods.fedcvae_ens.precision: 'fp16': must be one of 'fp32' or 'bf16'"),
    ("fedmho_md", {"channels_last": "yes"}, "methods.fedmho_md.channels_last: 'yes': input should be a valid boolean"),
])
def test_bad_settings_fail_before_any_training(tiny_config, tmp_path, method, params, message):
    tiny_config["client"]["model"] = ["cnn2", "lenet5"] if params.get("init") == "average" else "cnn2"
    tiny_config["methods"] = {"fedavg": {}, method: params}
    with pytest.raises(ValueError, match=message):  # a declared key's type or range: already at validate
        Simulator(prepare(validate(tiny_config)), tmp_path, cache_dir=None, quiet=True).run()
    assert not (tmp_path / "fedavg" / "metrics.jsonl").exists()  # nothing trained


# ---- end to end through the simulator ------------------------------------------------------------------
def test_every_method_runs_from_a_config_and_writes_summary(tiny_config, tmp_path):
    fast = {"cvae_epochs": 2, "cvae_lr": 1e-3, "num_samples": 120, "epochs": 2}
    tiny_config["clients"] = 4
    tiny_config["client"]["epochs"] = 2
    tiny_config["methods"] = {"fedmho": {**fast, "lr": 1e-3}, "fedmho_md": {**fast, "lr": 1e-3},
                              "fedmho_sd": {**fast, "lr": 1e-3}, "fedcvae_ens": fast,
                              "fedcvae_kd": {**fast, "decoder_samples": 100, "decoder_epochs": 1}}
    cfg = validate(tiny_config)
    summary = Simulator(prepare(cfg), tmp_path, cache_dir=tmp_path / "cache", quiet=True).run()
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for name in cfg["methods"]:
        result = on_disk["results"][name]
        assert 0 <= result["accuracy"] <= 100 and result["bytes_up"] > 0
        rows = [json.loads(r) for r in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r["step"] >= 0] == [0, 1, 2]  # accuracy per epoch (Fig. 6)
    results = summary["results"]
    assert results["fedmho_md"]["cached_uploads"] == 4  # same requests as fedmho: all from the cache
    assert results["fedcvae_ens"]["cached_uploads"] == 2  # FedMHO's generative clients 2, 3
    assert results["fedmho"]["synthetic_used"] == sum(keep_count(30, 0.8) for _ in range(4))


@pytest.mark.parametrize("channels_last", [False, True])
def test_an_interrupted_server_stage_resumes_to_the_same_model(tiny_config, tmp_path, monkeypatch, capsys,
                                                               channels_last):
    """FedMHO's and FedCVAE's training on the synthetic set save their state: a run stopped by Ctrl-C in
    epoch 3 (held back until that epoch is done and saved) or by an error in epoch 3 (saved after every
    epoch) goes on from there and ends with the uninterrupted run's model, accuracy, best accuracy and
    one metrics row per epoch; its earlier seconds count; the files go at the end."""
    from hetfl.fl import generative
    from hetfl.methods.fedmho import GenerativeMethod

    tiny_config.update(clients=4)
    tiny_config["client"]["epochs"] = 2
    fast = {"cvae_epochs": 2, "cvae_lr": 1e-3, "num_samples": 120, "epochs": 4, "lr": 1e-3,
            "channels_last": channels_last}  # NHWC weights and Adam moments saved and restored too
    tiny_config["methods"] = {"fedmho_md": fast}
    full = Simulator(prepare(validate(tiny_config)), tmp_path / "full", tmp_path / "cache", quiet=True).run()
    original = generative.train_mode

    for name, how, every_s, saved in (("ctrl-c", "signal", 1e9, 3), ("error", "raise", 0.0, 2)):
        calls: list[int] = []

        def train_mode(model, freeze_bn, how=how, calls=calls):
            calls.append(1)
            if len(calls) == 3 and how == "raise":
                raise KeyboardInterrupt
            if len(calls) == 3:
                signal.raise_signal(signal.SIGINT)  # held back until epoch 3 is done and saved
            original(model, freeze_bn)

        monkeypatch.setattr(generative, "train_mode", train_mode)
        monkeypatch.setattr(GenerativeMethod, "CHECKPOINT_EVERY_S", every_s)
        with pytest.raises(KeyboardInterrupt):
            Simulator(prepare(validate(tiny_config)), tmp_path / name, tmp_path / "cache", quiet=True).run()
        folder = tmp_path / name / "fedmho_md"
        assert Payload.read_meta(folder / "checkpoint-fuse.safetensors")["done"] == saved
        calls.clear()
        resumed = Simulator(prepare(validate(tiny_config)), tmp_path / name, tmp_path / "cache", quiet=True).run()
        assert len(calls) == 4 - saved  # the saved epochs are not run again
        r, f = resumed["results"]["fedmho_md"], full["results"]["fedmho_md"]
        assert r["resumed_from_epoch"] == {"fuse": saved}
        assert (r["accuracy"], r["best_accuracy"], r["curve"]) == (f["accuracy"], f["best_accuracy"], f["curve"])
        assert r["seconds"] > r["seconds_before_resume"] > 0 and "seconds_before_resume" not in f
        assert r["models"] == f["models"]
        rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows if x["step"] >= 0] == [0, 1, 2, 3, 4]
        assert not list(folder.glob("checkpoint-*"))
    assert "knowledge fusion: stopping after this epoch, to save a checkpoint (SIGINT)" in capsys.readouterr().err


def test_a_stage_checkpoint_of_another_run_or_model_is_ignored_with_a_warning(tmp_path):
    """A checkpoint is used only for its own key and a model of the same state names and shapes;
    otherwise the loop starts over (and says so) instead of restoring half a state."""
    from hetfl.fl.checkpoint import Resumed, StageCheckpoint
    from hetfl.models import build_model

    torch.manual_seed(0)
    model = build_model("cnn2", 1, 16, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.rand(2, 1, 16, 16)).sum().backward()
    opt.step()
    g = torch.Generator().manual_seed(1)
    StageCheckpoint(tmp_path / "c.safetensors", "run A").save(model, opt, g, 3, [10.0, 20.0], 5.0)
    fresh = build_model("cnn2", 1, 16, 4)
    state = StageCheckpoint(tmp_path / "c.safetensors", "run A").load(fresh, torch.optim.Adam(fresh.parameters()),
                                                                       torch.Generator())
    assert state == Resumed(3, [10.0, 20.0], 5.0)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    with pytest.warns(UserWarning, match="written for another configuration"):
        assert StageCheckpoint(tmp_path / "c.safetensors", "run B").load(
            fresh, torch.optim.Adam(fresh.parameters()), torch.Generator()) == Resumed()
    other = build_model("cnn2", 1, 16, 5)  # another class count: other head shapes
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.warns(UserWarning, match="other names or shapes"):
        assert StageCheckpoint(tmp_path / "c.safetensors", "run A").load(
            other, torch.optim.Adam(other.parameters()), torch.Generator()) == Resumed()
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())  # nothing restored
    Payload({"student.w": torch.zeros(1)}, {"key": "run A", "step": 3}).write(tmp_path / "c.safetensors")
    with pytest.warns(UserWarning, match="an older format"):  # FedDF's files before this class
        assert StageCheckpoint(tmp_path / "c.safetensors", "run A").load(
            fresh, torch.optim.Adam(fresh.parameters()), torch.Generator()) == Resumed()
    (tmp_path / "c.safetensors").write_bytes(b"not a payload")
    with pytest.warns(UserWarning, match="not used"):
        assert StageCheckpoint(tmp_path / "c.safetensors", "run A").load(
            fresh, torch.optim.Adam(fresh.parameters()), torch.Generator()) == Resumed()


def test_fedmho_md_on_synthetic_data_beats_chance(four_clients):
    _, _, _, ctx = run_server("fedmho_md", four_clients, {"epochs": 3})
    assert ctx.record["curve"][-1] > 40.0  # 4 classes: chance is 25 %


def test_decoder_upload_with_foreign_tensors_is_rejected(synthetic_small):
    from hetfl.fl.payload import PayloadError

    method = create_method("fedmho", {"cvae_epochs": 1, "cvae_lr": 1e-3})
    ctx = make_ctx(synthetic_small, num_clients=2)
    message = method.client_message(1, ctx)
    upload = handle(message, ClientEnv(1, synthetic_small.train, CPU))
    method.validate_upload(1, message, upload, ctx)  # the honest upload passes
    upload.tensors["encoder.net.0.weight"] = torch.zeros(3, 3)  # a client that leaks its encoder
    with pytest.raises(PayloadError, match="unexpected"):
        method.validate_upload(1, message, upload, ctx)


# ---- reproduction grid -----------------------------------------------------------------------------------
