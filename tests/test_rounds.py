"""The multi-round contract and its baselines: FedProx, FedAvgM, MOON, FedDisco (tiny synthetic data)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from hetfl.config import ConfigError
from hetfl.engine.simulator import Simulator, prepare
from hetfl.fl.client import ClientEnv, client_task
from hetfl.fl.method import RoundMethod, ServerContext, register
from hetfl.fl.objectives import PREV_MODEL, build_terms, objective
from hetfl.fl.payload import Payload
from hetfl.methods.checks import validate
from hetfl.methods.feddisco import disco_weights, discrepancy
from hetfl.models import build_model

ROUNDS = {"rounds": 3, "sample_ratio": 0.67}


def round_config(tiny_config: dict, **methods: dict) -> dict:
    cfg = copy.deepcopy(tiny_config)
    cfg["client"] = {"model": "simplecnn", "epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.9}
    cfg["server"] = {"model": "simplecnn"}
    cfg["methods"] = methods
    return cfg


def run(cfg: dict, out: Path, **kw: Any) -> dict:
    return Simulator(prepare(validate(cfg)), out, None, quiet=True, **kw).run()


def weights(folder: Path, label: str) -> dict[str, torch.Tensor]:
    return load_file(str(folder / label / f"{label}.safetensors"))


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("label", "params"), [
    ("fedprox", {"mu": 0.0}),
    ("fedavgm", {"beta": 0.0, "server_lr": 1.0}),
    ("feddisco", {"a": 0.0, "b": 0.0}),
])
def test_a_neutral_setting_equals_fedavg_bit_for_bit(tmp_path, tiny_config, label, params):
    cfg = round_config(tiny_config, fedavg=dict(ROUNDS), **{label: {**ROUNDS, **params}})
    res = run(cfg, tmp_path)["results"]
    assert same_weights(weights(tmp_path, "fedavg"), weights(tmp_path, label))
    assert res[label]["accuracy"] == res["fedavg"]["accuracy"]
    assert res[label]["bytes_up"] == res["fedavg"]["bytes_up"]


def test_the_active_settings_change_the_model(tmp_path, tiny_config):
    cfg = round_config(tiny_config, fedavg=dict(ROUNDS), fedprox={**ROUNDS, "mu": 1.0},
                       fedavgm=dict(ROUNDS), feddisco=dict(ROUNDS), moon=dict(ROUNDS))
    run(cfg, tmp_path)
    base = weights(tmp_path, "fedavg")
    for label in ("fedprox", "fedavgm", "feddisco", "moon"):
        assert not same_weights(base, weights(tmp_path, label)), label


def test_feddisco_weights_equal_a_hand_computation():
    counts = torch.tensor([[8, 0, 0, 0], [2, 2, 2, 2], [5, 3, 0, 0]])
    n_k = [8.0, 8.0, 8.0]
    p = [[1, 0, 0, 0], [0.25] * 4, [5 / 8, 3 / 8, 0, 0]]
    import math
    kl = [sum(q * math.log(q * 4) for q in row if q > 0) for row in p]
    d = [v / sum(kl) for v in kl]
    assert discrepancy(counts).tolist() == pytest.approx(d)
    expected = [max(0.0, n / 24 - 0.5 * dk + 0.1) for n, dk in zip(n_k, d)]
    got = disco_weights(n_k, counts, 0.5, 0.1)
    assert [g / sum(got) for g in got] == pytest.approx([e / sum(expected) for e in expected])
    skewed = torch.tensor([[8, 0, 0, 0], [0, 8, 0, 0]])
    assert disco_weights([8.0, 8.0], skewed, 10.0, 0.0) == [8.0, 8.0]  # every weight 0: back to n_k


def test_fedavgm_buffer_equals_a_hand_computation(tiny_config):
    cfg = validate(round_config(tiny_config, fedavgm={"rounds": 2, "beta": 0.5, "server_lr": 0.8}))
    sim = Simulator(prepare(cfg), Path("/tmp/unused-fedavgm"), None, quiet=True)
    from hetfl.fl.comm import CommLedger
    from hetfl.fl.method import create_method

    method = create_method("fedavgm", cfg["methods"]["fedavgm"])
    ctx = sim._context("fedavgm", CommLedger(), [], make_dir=False)
    method.start(ctx)
    w0 = {k: v.clone() for k, v in method.global_model.state_dict().items()}
    avg1 = {k: v + 1.0 for k, v in w0.items()}
    w1 = method.server_update(avg1, ctx)  # v1 = w0 - avg1 = -1; w1 = w0 - 0.8 v1 = w0 + 0.8
    for k in w0:
        assert torch.allclose(method.velocity[k], torch.full_like(w0[k], -1.0))
        assert torch.allclose(w1[k], w0[k] + 0.8)
    method.global_model.load_state_dict(w1)
    avg2 = {k: v - 2.0 for k, v in w1.items()}
    w2 = method.server_update(avg2, ctx)  # v2 = 0.5 (-1) + 2 = 1.5; w2 = w1 - 0.8 * 1.5
    for k in w0:
        assert torch.allclose(method.velocity[k], torch.full_like(w0[k], 1.5))
        assert torch.allclose(w2[k], w1[k] - 1.2, atol=1e-6)


def test_moon_term_is_zero_at_a_first_participation_then_uses_the_stored_model():
    torch.manual_seed(0)
    start = build_model("simplecnn", 1, 16, 4)
    x, y = torch.randn(6, 1, 16, 16), torch.tensor([0, 1, 2, 3, 0, 1])
    state: dict[str, Any] = {}
    terms = build_terms({"contrastive": {"mu": 5.0, "tau": 0.5}}, start, {}, state)
    model = copy.deepcopy(start)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    z = model.projection(model.extract(x))
    assert float(terms[0](model, x, y, model.head(z), z)) == 0.0
    loss = objective(terms)
    assert torch.equal(loss(model, x, y), torch.nn.functional.cross_entropy(model(x), y))
    terms[0].after(model, state)  # the trained model becomes the client's previous model
    assert sorted(state) == sorted(PREV_MODEL + k for k in model.state_dict())
    terms = build_terms({"contrastive": {"mu": 5.0, "tau": 0.5}}, start, {}, state)
    other = copy.deepcopy(start)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    z = other.projection(other.extract(x))
    cos = torch.nn.functional.cosine_similarity
    with torch.no_grad():
        z_g = start.projection(start.extract(x))
        z_prev = model.projection(model.extract(x))
    sims = torch.stack([cos(z, z_g, dim=-1), cos(z, z_prev, dim=-1)], dim=1) / 0.5
    expected = 5.0 * -torch.log_softmax(sims, dim=1)[:, 0].mean()
    assert float(terms[0](other, x, y, other.head(z), z).detach()) == pytest.approx(float(expected), rel=1e-5)


def test_fedavg_tensor_bytes_follow_the_communication_equation(tmp_path, tiny_config):
    t, cfg = 3, round_config(tiny_config, fedavg={"rounds": 3, "sample_ratio": 0.67})
    res = run(cfg, tmp_path)["results"]["fedavg"]
    model = build_model("simplecnn", 1, 16, 4)
    assert not list(model.buffers())  # buffer-free: the state is the parameters
    w = sum(p.numel() for p in model.parameters())
    sampled = 2  # round(0.67 * 3)
    tensor_bytes = res["tensor_bytes"]
    assert tensor_bytes["up"]["model"] + tensor_bytes["down"]["model"] == sampled * (2 * t - 1) * w * 4
    assert res["bytes_peer"] == 0 and res["bytes_up"] > tensor_bytes["up"]["model"]  # payloads carry headers
    cfg["methods"]["fedavg"]["init"] = "weights"
    res = run(cfg, tmp_path / "weights")["results"]["fedavg"]
    assert res["tensor_bytes"]["down"]["model"] == sampled * t * w * 4


def test_every_model_is_evaluated_and_the_summary_labels_the_selections(tmp_path, tiny_config):
    cfg = round_config(tiny_config, moon=dict(ROUNDS))
    cfg["validation"] = 0.2
    res = run(cfg, tmp_path)["results"]["moon"]
    assert {"accuracy", "test_selected_accuracy", "val_selected_accuracy", "val_accuracy"} <= set(res)
    rows = [json.loads(r) for r in (tmp_path / "moon" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, -1]
    assert all("val_accuracy" in r for r in rows[:-1])


# ---- client state: per method label, never shared -------------------------------------------------
@client_task("probe_state")
def probe_state(message: Payload, env: ClientEnv) -> Payload:
    owner = message.meta["owner"]
    if env.state.get("owner", owner) != owner:
        raise AssertionError(f"{owner} sees the state of {env.state['owner']}")
    env.state["owner"] = owner
    env.state["calls"] = int(env.state.get("calls", 0)) + 1
    env.state["last"] = torch.full((2,), float(env.state["calls"]))
    return Payload({}, {"calls": env.state["calls"], "kind": "state"})


@register("probe_state")
class ProbeState(RoundMethod):
    """Counts each client's calls in its state; uploads the count."""

    name = "probe_state"
    defaults = {"rounds": 3, "sample_ratio": 1.0}

    def setup(self, ctx: ServerContext) -> None:
        self.holder = ctx.build(ctx.server_arch)

    def client_message(self, client_id: int, round_: int, ctx: ServerContext) -> Payload:
        return Payload({}, {"task": "probe_state", "owner": self.name, "kind": "state"})

    def validate_upload(self, client_id, message, upload, ctx):  # noqa: ANN001, ANN201
        return None

    def aggregate(self, round_: int, uploads: dict[int, Payload], ctx: ServerContext) -> None:
        for cid, upload in uploads.items():
            if upload.meta["calls"] != round_:
                raise AssertionError(f"client {cid} counted {upload.meta['calls']} calls in round {round_}")

    def models(self) -> dict[str, torch.nn.Module]:
        return {self.name: self.holder}


def test_two_stateful_methods_never_see_each_others_client_state(tmp_path, tiny_config):
    cfg = copy.deepcopy(tiny_config)
    cfg["methods"] = {"a": {"method": "probe_state"}, "b": {"method": "probe_state"}}
    run(cfg, tmp_path)  # the probe raises if a client saw another method's state or lost a call


# ---- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("change", "message"), [
    ({"methods": {"fedprox": {"mu": -1}}}, "methods.fedprox.mu"),
    ({"methods": {"fedavgm": {"beta": 1.0}}}, "methods.fedavgm.beta"),
    ({"methods": {"moon": {"tau": 0}}}, "methods.moon.tau"),
    ({"methods": {"moon": {"sample_ratio": 0}}}, "methods.moon.sample_ratio"),
    ({"methods": {"feddisco": {"a": -0.5}}}, "methods.feddisco.a"),
    ({"validation": 0.5}, "validation"),
])
def test_bad_round_settings_fail_before_training_naming_the_key(tiny_config, change, message):
    cfg = round_config(tiny_config, fedavg=dict(ROUNDS))
    cfg.update(change)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate(cfg)


def test_moon_without_a_projection_head_and_mixed_architectures_fail_before_training(tmp_path, tiny_config):
    cfg = round_config(tiny_config, moon=dict(ROUNDS))
    cfg["client"]["model"] = cfg["server"]["model"] = "cnn2"
    with pytest.raises(ValueError, match="methods.moon: moon needs a client model with a projection head"):
        run(cfg, tmp_path / "a")
    cfg = round_config(tiny_config, fedprox=dict(ROUNDS))
    cfg["client"]["model"] = ["simplecnn", "cnn2"]
    with pytest.raises(ValueError, match="methods.fedprox: multi-round fedprox averages parameters"):
        run(cfg, tmp_path / "b")
