"""HFLDD: stages as steps, K = 1 equals FedAvg, the ledger follows Eq. 18, resume (tiny synthetic data)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from hetfl.fl.comm import cost_fedavg, cost_hfldd
from hetfl.models import build_model
from tests.test_rounds import assert_interrupted_run_resumes, run, same_weights

FAST = {"rounds": 2, "aux_size": 40, "pretrain_epochs": 1, "distilled_size": 6, "kip_steps": 3, "head_epochs": 1,
        "head_batch_size": 16}


def config(tiny_config: dict, clients: int = 6, **methods: dict) -> dict:
    cfg = copy.deepcopy(tiny_config)
    cfg["clients"] = clients
    cfg["partition"] = {"kind": "classes", "per_client": 1}
    cfg["client"] = {"model": "simplecnn", "epochs": 1, "batch_size": 16, "lr": 0.05}
    cfg["server"] = {"model": "simplecnn"}
    cfg["methods"] = methods
    return cfg


def test_one_cluster_gives_singletons_no_peer_bytes_and_equals_fedavg(tmp_path, tiny_config):
    cfg = config(tiny_config, hfldd={**FAST, "clusters": 1}, fedavg={"rounds": 2, "sample_ratio": 1.0})
    res = run(cfg, tmp_path)["results"]
    assert res["hfldd"]["clusters"]["heterogeneous"] == 6 and res["hfldd"]["bytes_peer"] == 0
    assert same_weights(load_file(str(tmp_path / "fedavg" / "fedavg.safetensors")),
                        load_file(str(tmp_path / "hfldd" / "hfldd.safetensors")))


def test_clusters_take_one_client_per_class_and_the_ledger_follows_eq_18(tmp_path, tiny_config):
    cfg = config(tiny_config, clients=8, hfldd={**FAST, "clusters": 4})
    res = run(cfg, tmp_path)["results"]["hfldd"]
    clusters = res["clusters"]
    assert clusters["homogeneous"] == 4 and sum(clusters["sizes"]) == 8
    heads = clusters["heterogeneous"]
    members = 8 - heads
    w = sum(p.numel() for p in build_model("simplecnn", 1, 16, 4).parameters())
    tb = res["tensor_bytes"]
    expected = cost_hfldd(8, 40, 4, [6] * members, 16 * 16, heads, w, 2)
    got = 8 * (tb["up"]["soft_labels"] + tb["peer"]["distilled_data"] + tb["up"]["model"] + tb["down"]["model"])
    assert got == expected
    assert tb["peer"]["labels"] == members * 6 * 8  # int64 labels, counted apart
    assert res["bytes_peer"] > 0 and cost_fedavg(heads, 2, w) == 8 * (tb["up"]["model"] + tb["down"]["model"])
    rows = [json.loads(r) for r in (tmp_path / "hfldd" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, -1]
    assert (tmp_path / "hfldd" / "clusters.png").is_file()  # Fig. 4: the clusters' class make-up


def test_without_distillation_members_send_raw_data(tmp_path, tiny_config):
    cfg = config(tiny_config, clients=8, hfldd_nodd={**FAST, "clusters": 4})
    res = run(cfg, tmp_path)["results"]["hfldd_nodd"]
    assert res["method"] == "hfldd" and res["tensor_bytes"]["peer"]["raw_data"] > 0


def test_hfldd_killed_after_a_stage_resumes_to_the_same_end(tmp_path, tiny_config, monkeypatch):
    from hetfl.methods.hfldd import HFLDD

    cfg = config(tiny_config, clients=8, hfldd={**FAST, "clusters": 4})
    full = run(copy.deepcopy(cfg), tmp_path / "full")["results"]["hfldd"]
    original = HFLDD.train_round

    def stop(self, step, ctx):  # noqa: ANN001, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(HFLDD, "train_round", stop)
    with pytest.raises(KeyboardInterrupt):
        run(copy.deepcopy(cfg), tmp_path / "cut")  # after the clustering and distillation steps
    monkeypatch.setattr(HFLDD, "train_round", original)
    resumed = run(copy.deepcopy(cfg), tmp_path / "cut")["results"]["hfldd"]
    assert resumed["resumed_from_round"] == 2
    assert resumed["accuracy"] == full["accuracy"] and resumed["tensor_bytes"] == full["tensor_bytes"]
    assert resumed["clusters"] == full["clusters"]  # the record of step 1 is carried over


@pytest.mark.parametrize(("change", "message"), [
    ({"clusters": 0}, "methods.hfldd.clusters"),
    ({"kernel": "poly"}, "methods.hfldd.kernel"),
    ({"kip_lr": 0}, "methods.hfldd.kip_lr"),
    ({"clusters": 9}, "clusters: K = 9 is more than the 8 clients"),
    ({"sample_ratio": 0.5}, "sample_ratio must be 1"),
])
def test_bad_hfldd_settings_fail_before_training(tmp_path, tiny_config, change, message):
    cfg = config(tiny_config, clients=8, hfldd={**FAST, **change})
    with pytest.raises((ValueError,), match=message.replace(".", r"\.")):
        run(cfg, tmp_path)


def test_kip_distilled_sets_are_class_balanced_uint8(tmp_path, tiny_config):
    from hetfl.data.synthetic import load_synthetic
    from hetfl.fl.client import ClientEnv, handle
    from hetfl.fl.payload import Payload

    data = load_synthetic(classes=2, channels=1, size=8, train_per_class=10, test_per_class=2, seed=0).train
    message = Payload({}, {"task": "share_data", "raw": False, "num_classes": 2, "size": 6, "steps": 2, "lr": 0.004,
                           "lambda": 1e-6, "kernel": "ntk", "target_batch": 4, "seed": 3})
    upload = handle(message, ClientEnv(0, data, torch.device("cpu")))
    assert upload.tensors["x"].dtype == torch.uint8 and upload.tensors["x"].shape == (6, 1, 8, 8)
    assert torch.bincount(upload.tensors["y"]).tolist() == [3, 3]


# ---- FedSeq (Chen et al., HFLDD's Eq. 19) ------------------------------------------------------------
def test_fedseq_passes_the_model_around_rings_and_books_eq_19(tmp_path, tiny_config):
    from hetfl.fl.comm import cost_fedseq

    cfg = config(tiny_config, clients=6, fedseq={"rounds": 2, "clusters": 2})
    res = run(cfg, tmp_path)["results"]["fedseq"]
    rings = res["rings"]
    assert sorted(c for r in rings for c in r) == list(range(6)) and all(len(r) == 3 for r in rings)
    w = sum(p.numel() for p in build_model("simplecnn", 1, 16, 4).parameters())
    tb = res["tensor_bytes"]
    moved = tb["up"]["model"] + tb["down"]["model"] + tb["peer"]["model"]
    assert moved * 8 == cost_fedseq(2, 3, w, 2)
    assert 0 < res["accuracy"] <= 100


def test_fedseq_needs_equal_rings(tmp_path, tiny_config):
    cfg = config(tiny_config, clients=6, fedseq={"rounds": 2, "clusters": 4})
    with pytest.raises(ValueError, match="6 clients do not split into 4 rings"):
        run(cfg, tmp_path)


def test_greedy_superclients_cover_the_clients_and_mix_classes():
    from hetfl.fl.clustering import greedy_superclients

    h = torch.zeros(20, 10)
    for i in range(20):
        h[i, i % 10] = 300  # one class each
    groups = greedy_superclients(h, 800, 11, seed=0)
    assert sorted(c for g in groups for c in g) == list(range(20)) and groups == greedy_superclients(h, 800, 11, 0)
    assert all(len({c % 10 for c in g}) == len(g) for g in groups)  # KL picks a class not yet in the group
    assert all(h[g].sum() >= 800 for g in groups[:-1]) and [len(g) for g in groups[:-1]] == [3] * 6
    assert max(len(g) for g in greedy_superclients(h, 10**6, 4, 0)) == 4  # max_clients caps a group


def test_fedseq_superclients_run_and_book_every_client_once_a_round(tmp_path, tiny_config):
    cfg = config(tiny_config, clients=6, fedseq_superclient={"rounds": 2, "min_samples": 25})
    res = run(cfg, tmp_path)["results"]["fedseq_superclient"]
    rings = res["rings"]
    assert sorted(c for r in rings for c in r) == list(range(6)) and res["params"]["grouping"] == "superclient"
    w = sum(p.numel() for p in build_model("simplecnn", 1, 16, 4).parameters()) * 4
    tb = res["tensor_bytes"]
    assert tb["peer"]["model"] == 2 * 6 * w  # each client passes the model on once a round
    assert tb["up"]["model"] == 2 * len(rings) * w and tb["down"]["model"] == len(rings) * w


# ---- DynaFed -----------------------------------------------------------------------------------------
def expert_trajectory(steps: int = 4):  # noqa: ANN201
    """A linear model and its trajectory of ``steps`` SGD steps on real data (4 x 4 images, 3 classes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    x, y = torch.rand(30, 1, 4, 4), torch.randint(0, 3, (30,))
    trajectory = [{k: v.detach().clone() for k, v in model.named_parameters()}]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        trajectory.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return model, trajectory


def test_trajectory_matching_lowers_its_loss():
    from hetfl.methods.dynafed import match_trajectory

    model, trajectory = expert_trajectory()
    images = torch.rand(6, 1, 4, 4).requires_grad_(True)
    labels = torch.zeros(6, 3).requires_grad_(True)  # label_init 0: uniform soft labels
    lr = torch.tensor(1.0).requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    first = match_trajectory(model, trajectory, images, labels, lr, 1, 5, 2, g, dsa=False)
    last = match_trajectory(model, trajectory, images, labels, lr, 60, 5, 2, g, dsa=False)
    assert last < first


def test_dsa_is_differentiable_and_a_seed_fixes_its_transform():
    from hetfl.methods.dynafed import DSA_FAMILIES, augment

    def family(seed: int) -> str:  # the family augment draws first from this seed
        first = torch.randint(0, len(DSA_FAMILIES), (1,), generator=torch.Generator().manual_seed(seed))
        return DSA_FAMILIES[int(first)]

    seeds = {family(s): s for s in range(100)}
    assert set(seeds) == set(DSA_FAMILIES)
    torch.manual_seed(0)
    a, b = torch.rand(6, 2, 8, 8, dtype=torch.float64), torch.rand(6, 2, 8, 8, dtype=torch.float64)
    for name, seed in seeds.items():
        def t(x: torch.Tensor, seed: int = seed) -> torch.Tensor:
            return augment(x, torch.Generator().manual_seed(seed))

        assert torch.equal(t(a), t(a)), name  # one seed, one transform
        assert not torch.equal(t(a), a), name  # per-image draws: not all six images left as they are
        # the same transform on two inputs: it is affine, so T(a + b) - T(b) = T(a) - T(0)
        assert torch.allclose(t(a + b) - t(b), t(a) - t(torch.zeros_like(a)), atol=1e-12), name
        assert torch.autograd.gradcheck(t, (a.clone().requires_grad_(True),)), name
    x = torch.rand(4, 1, 8, 8, requires_grad=True)
    augment(x, torch.Generator().manual_seed(seeds["rotate"])).square().sum().backward()
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)


def test_trajectory_matching_without_dsa_is_the_plain_inner_loop():
    from hetfl.methods.dynafed import match_trajectory

    model, trajectory = expert_trajectory(2)  # M = 2: the only start is theta_0, the target theta_2
    images, labels = torch.rand(6, 1, 4, 4), torch.randn(6, 3)
    params = {k: v.clone().requires_grad_(True) for k, v in trajectory[0].items()}
    for _ in range(3):  # three plain SGD steps at 0.3 on soft-label cross-entropy / C
        out = torch.func.functional_call(model, params, (images,))
        ce = -(torch.softmax(labels, 1) * torch.log_softmax(out, 1)).mean()
        grads = torch.autograd.grad(ce, list(params.values()))
        params = {k: p - 0.3 * gr for (k, p), gr in zip(params.items(), grads)}
    num = float(sum(((params[k].detach() - trajectory[2][k]) ** 2).sum() for k in params))
    den = float(sum(((trajectory[0][k] - trajectory[2][k]) ** 2).sum() for k in params))

    def loss(dsa: bool) -> float:
        lr = torch.tensor(0.3).requires_grad_(True)
        return match_trajectory(model, trajectory, images.clone().requires_grad_(True),
                                labels.clone().requires_grad_(True), lr, 1, 3, 2, torch.Generator().manual_seed(0),
                                dsa=dsa, averaging=None)

    assert loss(False) == pytest.approx(num / den, rel=1e-5)
    assert loss(True) != pytest.approx(num / den, rel=1e-5)


def test_weight_averaging_targets_a_mean_of_the_next_m_checkpoints():
    from fractions import Fraction

    from hetfl.methods.dynafed import matching_target

    trajectory = [{"w": torch.tensor([float(i)], dtype=torch.float64)} for i in range(8)]

    def target(averaging: tuple[int, int] | None, m: int, seed: int) -> Fraction:
        got = matching_target(trajectory, 2, m, averaging, torch.Generator().manual_seed(seed))["w"]
        return Fraction(float(got)).limit_denominator(12)

    assert all(target(None, 3, s) == 5 for s in range(5))  # off: theta_{t + M}
    assert all(target((2, 10), 1, s) == 3 for s in range(20))  # M = 1: k clamped to 1, theta_{t + 1}
    seen = {target((2, 10), 3, s) for s in range(300)}  # k in {2, 3} draws from theta_3..theta_5
    assert all(3 <= v <= 5 for v in seen)
    assert {v.denominator for v in seen} == {1, 2, 3}  # means of two (halves) and of three (thirds)
    possible = {Fraction(a + b, 2) for a in (3, 4, 5) for b in (3, 4, 5)} | {
        Fraction(a + b + c, 3) for a in (3, 4, 5) for b in (3, 4, 5) for c in (3, 4, 5)}
    assert seen == possible
    assert all(target((3, 3), 3, s).denominator in (1, 3) for s in range(50))  # k = 3 only


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_dynafed_uniform_aggregation_is_the_plain_mean(tmp_path, tiny_config, weighting):
    from hetfl.fl.payload import Payload
    from tests.test_rounds import started

    cfg = config(tiny_config, dynafed={"rounds": 4, "weighting": weighting})
    method, ctx = started(cfg, "dynafed", tmp_path)
    torch.manual_seed(1)
    shapes = {k: v.shape for k, v in method.global_model.state_dict().items()}
    counts = {0: 5, 3: 40, 4: 15}
    uploads = {c: Payload({k: torch.randn(s) for k, s in shapes.items()},
                          {"arch": ctx.client_archs[c], "num_samples": n}) for c, n in counts.items()}
    method.aggregate(1, uploads, ctx)
    w = torch.tensor([1.0, 1.0, 1.0] if weighting == "uniform" else [float(n) for n in counts.values()])
    for k, v in method.global_model.state_dict().items():
        expected = sum(wi * uploads[c].tensors[k] for wi, c in zip(w / w.sum(), counts))
        assert torch.allclose(v, expected, atol=1e-6), k
    if weighting == "uniform":
        k = next(iter(shapes))
        assert torch.allclose(method.global_model.state_dict()[k],
                              torch.stack([u.tensors[k] for u in uploads.values()]).mean(0), atol=1e-6)


def test_dynafed_equals_fedavg_until_its_synthesis_then_fine_tunes_and_resumes(tmp_path, tiny_config, monkeypatch):
    fast = {"rounds": 4, "sample_ratio": 1.0, "trajectory_rounds": 2, "expert_epochs": 1, "ipc": 2,
            "syn_iterations": 3, "syn_steps": 2, "distill_iter": 2}
    cfg = config(tiny_config, dynafed=fast, fedavg={"rounds": 4, "sample_ratio": 1.0})
    res = run(copy.deepcopy(cfg), tmp_path / "full")["results"]
    rows = {m: [json.loads(r)["accuracy"] for r in (tmp_path / "full" / m / "metrics.jsonl").read_text().splitlines()]
            for m in ("fedavg", "dynafed")}
    assert rows["dynafed"][:1] == rows["fedavg"][:1]  # round 1: plain FedAvg
    assert "matching_loss" in res["dynafed"] and res["dynafed"]["bytes_up"] == res["fedavg"]["bytes_up"]
    from hetfl.methods.dynafed import DynaFed

    assert_interrupted_run_resumes(cfg, "dynafed", DynaFed, 4, tmp_path / "resume", monkeypatch)


def test_on_a_one_class_partition_soft_labels_cluster_clients_by_class(tmp_path, tiny_config):
    from sklearn.metrics import adjusted_rand_score

    cfg = config(tiny_config, clients=8, hfldd={**FAST, "clusters": 4, "pretrain_epochs": 3, "rounds": 1})
    res = run(cfg, tmp_path)["results"]["hfldd"]
    labels = res["clusters"]["homogeneous_labels"]
    part = json.loads((tmp_path / "partition.json").read_text())
    classes = [max(range(4), key=lambda c: row[c]) for row in part["counts"]]
    assert adjusted_rand_score(classes, [labels[str(c)] for c in range(8)]) == 1.0


@pytest.mark.parametrize("passes", [0, 2])
def test_dynafed_bn_passes_refresh_batchnorm_statistics_only(tmp_path, tiny_config, passes):
    from tests.test_rounds import started

    cfg = config(tiny_config, dynafed={"rounds": 4, "trajectory_rounds": 2, "expert_epochs": 1, "ipc": 2,
                                       "distill_iter": 0, "bn_passes": passes})
    cfg["client"]["model"] = cfg["server"]["model"] = "cnn2"  # has BatchNorm
    method, ctx = started(cfg, "dynafed", tmp_path)
    before = {k: v.clone() for k, v in method.global_model.state_dict().items()}
    method._fine_tune(3, ctx)
    after = method.global_model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert all("running" in k or "num_batches" in k for k in changed)  # no weight moves without Adam passes
    assert bool(changed) == (passes > 0)


def test_pretraining_is_e1_steps_at_batch_64_unless_epochs_are_asked_for(tiny_config, monkeypatch):
    """Table I and Sec. V-C: E1 = 10 mini-batch steps at b1 = 64; ``pretrain_epochs`` trains whole epochs."""
    from pathlib import Path

    from hetfl.fl.train_config import TrainConfig
    from tests.test_rounds import started

    class Sent(Exception):
        pass

    for params, steps, epochs in (({}, 10, 1), ({"pretrain_steps": 3}, 3, 1), ({"pretrain_epochs": 4}, None, 4)):
        cfg = config(tiny_config, hfldd={**FAST, "clusters": 2, "pretrain_epochs": None, **params})
        method, ctx = started(cfg, "hfldd", Path("/tmp/unused-hfldd"))
        sent = {}

        def exchange(step, messages, sent=sent, **kw):  # noqa: ANN001, ANN003, ANN202
            sent.update(messages)
            raise Sent

        monkeypatch.setattr(ctx, "exchange", exchange)
        with pytest.raises(Sent):
            method.cluster(ctx)
        trains = {json.dumps(m.meta["train"], sort_keys=True) for m in sent.values()}
        assert len(sent) == 6 and len(trains) == 1
        train = TrainConfig(**json.loads(trains.pop()))
        assert (train.steps, train.epochs, train.batch_size) == (steps, epochs, 64)
        assert train.momentum == 0.0  # the clients' SGD: no momentum unless the config names it


def test_hfldd_at_another_k_reuses_the_cached_stages_bit_for_bit(tmp_path, tiny_config):
    """Pre-training soft labels and distilled sets depend on the request and the client's data alone:
    a second K reads the members it shares from the upload cache and ends where an uncached run ends."""
    from hetfl.engine.simulator import Simulator, prepare
    from hetfl.methods.checks import validate

    k2 = {**FAST, "method": "hfldd", "clusters": 2}
    cached = config(tiny_config, clients=8, hfldd={**FAST, "clusters": 4}, hfldd_k2=k2)
    sim = Simulator(prepare(validate(cached)), tmp_path / "cached", tmp_path / "cache", quiet=True)
    res = sim.run()["results"]
    first = res["hfldd"]["clusters"]
    members_first = 8 - first["heterogeneous"]
    # every client pre-trains once and every member of the first K distils once, never again
    new_members = set(first["heads"]) - set(res["hfldd_k2"]["clusters"]["heads"])
    assert sim.trained_uploads == 8 + members_first + len(new_members)
    alone = run(config(tiny_config, clients=8, hfldd_k2=k2), tmp_path / "alone")["results"]["hfldd_k2"]
    assert alone["accuracy"] == res["hfldd_k2"]["accuracy"]
    assert alone["tensor_bytes"] == res["hfldd_k2"]["tensor_bytes"]
    assert same_weights(load_file(str(tmp_path / "alone" / "hfldd_k2" / "hfldd_k2.safetensors")),
                        load_file(str(tmp_path / "cached" / "hfldd_k2" / "hfldd_k2.safetensors")))
