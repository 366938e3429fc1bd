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
from hetfl.fl.objectives import PREV_MODEL, build_terms, objective
from hetfl.fl.payload import Payload
from hetfl.methods.checks import validate
from hetfl.methods.feddisco import disco_weights, discrepancy
from hetfl.models import build_model
from tests.probes import ProbeState  # noqa: F401  (registers the probe_state method)

ROUNDS = {"rounds": 3, "sample_ratio": 0.67}


def round_config(tiny_config: dict, **methods: dict) -> dict:
    cfg = copy.deepcopy(tiny_config)
    cfg["client"] = {"model": "simplecnn", "epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.9}
    cfg["server"] = {"model": "simplecnn"}
    cfg["methods"] = methods
    return cfg


def run(cfg: dict, out: Path, **kw: Any) -> dict:
    return Simulator(prepare(validate(cfg)), out, None, quiet=True, **kw).run()


def started(cfg: dict, label: str, folder: Path):  # noqa: ANN201
    """The method ``label`` of ``cfg``, started on a simulator-bound server context: (method, ctx)."""
    from hetfl.fl.comm import CommLedger
    from hetfl.fl.method import create_method

    cfg = validate(cfg)
    sim = Simulator(prepare(cfg), folder, None, quiet=True)
    method = create_method(label, cfg["methods"][label])
    ledger = CommLedger()
    ctx = sim._context(label, ledger, [], make_dir=False)
    sim._bind(label, method, ctx, ledger, [], {})
    method.start(ctx)
    return method, ctx


def assert_interrupted_run_resumes(cfg: dict, label: str, cls: type, at: int, folder: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> dict:
    """Run method ``label`` of ``cfg`` uninterrupted, then again interrupted in round ``at`` (its
    ``cls.aggregate`` raises) and resumed: the resumed run restarts after round ``at - 1`` and ends with the
    same saved models bit for bit, metric rows, accuracy and tensor bytes. Returns the uninterrupted result."""
    only = {**cfg, "methods": {label: cfg["methods"][label]}}
    full = run(copy.deepcopy(only), folder / "full")["results"][label]
    original = cls.aggregate

    def crash(self, round_, uploads, ctx):  # noqa: ANN001, ANN202
        if round_ == at:
            raise KeyboardInterrupt
        return original(self, round_, uploads, ctx)

    with monkeypatch.context() as patch:
        patch.setattr(cls, "aggregate", crash)
        with pytest.raises(KeyboardInterrupt):
            run(copy.deepcopy(only), folder / "cut")
    resumed = run(copy.deepcopy(only), folder / "cut")["results"][label]
    assert resumed["resumed_from_round"] == at - 1
    models = sorted((folder / "full" / label).glob("*.safetensors"))
    assert models
    for path in models:
        assert same_weights(load_file(str(path)), load_file(str(folder / "cut" / label / path.name))), path.name
    rows = [[{k: v for k, v in json.loads(r).items() if k not in ("logged_at", "client_seconds", "server_seconds")}
             for r in (folder / d / label / "metrics.jsonl").read_text().splitlines()] for d in ("full", "cut")]
    assert rows[0] == rows[1]
    assert resumed["accuracy"] == full["accuracy"] and resumed["tensor_bytes"] == full["tensor_bytes"]
    return full


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
    method, ctx = started(round_config(tiny_config, fedavgm={"rounds": 2, "beta": 0.5, "server_lr": 0.8}), "fedavgm",
                          Path("/tmp/unused-fedavgm"))
    w0 = {k: v.clone() for k, v in method.global_model.state_dict().items()}
    params = set(method.velocity)
    assert params == {k for k, _ in method.global_model.named_parameters()}
    avg1 = {k: v + 1.0 for k, v in w0.items()}
    w1 = method.server_update(avg1, ctx)  # v1 = w0 - avg1 = -1; w1 = w0 - 0.8 v1 = w0 + 0.8
    for k in w0:
        if k in params:
            assert torch.allclose(method.velocity[k], torch.full_like(w0[k], -1.0))
            assert torch.allclose(w1[k], w0[k] + 0.8)
        else:  # BatchNorm's statistics and step count take the average
            assert torch.equal(w1[k], avg1[k])
    method.global_model.load_state_dict(w1)
    avg2 = {k: v - 2.0 for k, v in w1.items()}
    w2 = method.server_update(avg2, ctx)  # v2 = 0.5 (-1) + 2 = 1.5; w2 = w1 - 0.8 * 1.5
    for k in params:
        assert torch.allclose(method.velocity[k], torch.full_like(w0[k], 1.5))
        assert torch.allclose(w2[k], w1[k] - 1.2, atol=1e-6)


def test_fedavgm_at_server_lr_one_minus_beta_is_the_kdia_authors_damped_form(tiny_config):
    """KDIA's code: v <- beta v + (1 - beta) Delta, w <- w - v, Delta = w - avg; two rounds by hand."""
    beta = 0.9
    method, ctx = started(round_config(tiny_config, fedavgm={"rounds": 2, "beta": beta, "server_lr": 1 - beta}),
                          "fedavgm", Path("/tmp/unused-fedavgm"))
    names = [k for k, _ in method.global_model.named_parameters()]
    w = {k: v.clone().double() for k, v in method.global_model.state_dict().items()}
    v = {k: torch.zeros_like(w[k]) for k in names}
    torch.manual_seed(1)
    for _ in range(2):
        avg = {k: (x + torch.randn_like(x)).float() for k, x in w.items()}
        got = method.server_update(avg, ctx)
        for k in names:
            v[k] = beta * v[k] + (1 - beta) * (w[k] - avg[k].double())
            w[k] = w[k] - v[k]
            assert torch.allclose(got[k].double(), w[k], atol=1e-5), k
        method.global_model.load_state_dict(got)
        w = {k: x.clone().double() for k, x in got.items()}


def perturbed(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise of std ``scale`` added to every parameter."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn_like(p))
    return out


def test_moon_term_is_zero_at_a_first_participation_then_uses_the_stored_model():
    torch.manual_seed(0)
    start = build_model("simplecnn", 1, 16, 4)
    x, y = torch.randn(6, 1, 16, 16), torch.tensor([0, 1, 2, 3, 0, 1])
    state: dict[str, Any] = {}
    terms = build_terms({"contrastive": {"mu": 5.0, "tau": 0.5}}, start, {}, state)
    model = perturbed(start, 0.1)
    z = model.projection(model.extract(x))
    assert float(terms[0](model, x, y, model.head(z), z)) == 0.0
    loss = objective(terms)
    assert torch.equal(loss(model, x, y), torch.nn.functional.cross_entropy(model(x), y))
    terms[0].after(model, state)  # the trained model becomes the client's previous model
    assert sorted(state) == sorted(PREV_MODEL + k for k in model.state_dict())
    terms = build_terms({"contrastive": {"mu": 5.0, "tau": 0.5}}, start, {}, state)
    other = perturbed(start, 0.05)
    z = other.projection(other.extract(x))
    cos = torch.nn.functional.cosine_similarity
    with torch.no_grad():
        z_g = start.projection(start.extract(x))
        z_prev = model.projection(model.extract(x))
    sims = torch.stack([cos(z, z_g, dim=-1), cos(z, z_prev, dim=-1)], dim=1) / 0.5
    expected = 5.0 * -torch.log_softmax(sims, dim=1)[:, 0].mean()
    assert float(terms[0](other, x, y, other.head(z), z).detach()) == pytest.approx(float(expected.detach()), rel=1e-5)


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


# ---- resume after SIGKILL ----------------------------------------------------------------------------
KILLER = r'''
import os, signal, sys
from pathlib import Path
from hetfl.engine import simulator
from hetfl.fl.payload import Payload
from hetfl.methods.fedavg import FedAvgRounds
mode, at = sys.argv[1], int(sys.argv[2])
import torch
torch.set_num_threads(int(sys.argv[6]))  # the test process's arithmetic: its thread count and subnormals
if sys.argv[5] == "1":
    from hetfl.host import flush_denormals
    flush_denormals()
validate = FedAvgRounds.validate_upload
REJECT = int(os.environ["HETFL_TEST_REJECT"])
def reject(self, cid, message, upload, ctx):  # one client is rejected in round 2: failures to carry over
    if cid == REJECT and message.meta.get("round") == 2:
        from hetfl.fl.payload import PayloadError
        raise PayloadError("scripted rejection")
    return validate(self, cid, message, upload, ctx)
FedAvgRounds.validate_upload = reject
if mode == "after":  # killed once round `at` is checkpointed
    save = simulator.Simulator._save_rounds
    def save_then_die(self, path, name, round_, *args):
        save(self, path, name, round_, *args)
        if round_ == at:
            os.kill(os.getpid(), signal.SIGKILL)
    simulator.Simulator._save_rounds = save_then_die
else:  # killed halfway through writing round `at`'s checkpoint
    write = Payload.write
    def die_while_writing(self, path):
        path = Path(path)
        if path.name == "checkpoint.safetensors" and self.meta.get("round") == at:
            blob = self.to_bytes()
            path.with_name(f"{path.name}.tmp{os.getpid()}").write_bytes(blob[: len(blob) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        write(self, path)
    Payload.write = die_while_writing
from hetfl.cli import main
sys.exit(main(["run", sys.argv[3], "--out", sys.argv[4], "--no-cache", "--quiet"]))
'''


def _scripted_rejection(monkeypatch: pytest.MonkeyPatch) -> int:
    from hetfl.fl.method import sample_clients
    from hetfl.fl.payload import PayloadError
    from hetfl.methods.fedavg import FedAvgRounds

    validate_upload = FedAvgRounds.validate_upload
    target = sample_clients(3, 0.67, 2, 0)[0]
    monkeypatch.setenv("HETFL_TEST_REJECT", str(target))

    def reject(self, cid, message, upload, ctx):  # noqa: ANN001, ANN202
        if cid == target and message.meta.get("round") == 2:
            raise PayloadError("scripted rejection")
        return validate_upload(self, cid, message, upload, ctx)

    monkeypatch.setattr(FedAvgRounds, "validate_upload", reject)
    return target


def _outcome(folder: Path, label: str) -> tuple:
    summary = json.loads((folder / "summary.json").read_text())["results"][label]
    rows = [{k: v for k, v in json.loads(r).items() if k not in ("logged_at", "client_seconds", "server_seconds")}
            for r in (folder / label / "metrics.jsonl").read_text().splitlines()]
    comm = json.loads((folder / label / "communication.json").read_text())
    return (weights(folder, label), rows, comm, summary.get("client_failures"), summary["accuracy"],
            summary["bytes_up"], summary["tensor_bytes"])


@pytest.mark.parametrize("label", ["moon", "fedavgm"])
@pytest.mark.parametrize("mode", ["after", "during"])
def test_a_killed_run_resumes_to_the_uninterrupted_end(tmp_path, tiny_config, monkeypatch, label, mode):
    import subprocess
    import sys

    import yaml

    cfg = round_config(tiny_config, **{label: {"rounds": 4, "sample_ratio": 0.67}})
    cfg["client"]["epochs"] = 2
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    target = _scripted_rejection(monkeypatch)
    full = tmp_path / "full"
    run(cfg, full)
    from hetfl.host import flush_denormal_setting

    same_arithmetic = [str(int(flush_denormal_setting())), str(torch.get_num_threads())]
    killed = subprocess.run([sys.executable, "-c", KILLER, mode, "2", str(path), str(tmp_path / "cut"),
                             *same_arithmetic],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    if mode == "during":  # half a file under a temporary name; round 1's checkpoint is intact
        assert list((tmp_path / "cut" / label).glob("checkpoint.safetensors.tmp*"))
    resumed = run(cfg, tmp_path / "cut")["results"][label]
    assert resumed["resumed_from_round"] == (2 if mode == "after" else 1)
    got, want = _outcome(tmp_path / "cut", label), _outcome(full, label)
    assert same_weights(got[0], want[0])
    assert got[1:] == want[1:]
    assert want[3] == [{"round": 2, "client": target, "reason": "upload rejected: scripted rejection"}]


def test_the_client_book_counts_accepted_uploads_only_and_round_trips():
    from hetfl.fl.clientbook import ClientBook

    book = ClientBook(4, 3, keep_models=True)
    up = Payload({"w": torch.ones(2)}, {"num_samples": 5, "label_counts": [2, 3, 0]})
    book.update(1, {0: up, 2: up})
    book.update(3, {2: up})
    assert book.last_round.tolist() == [1, -1, 3, -1] and book.participations.tolist() == [1, 0, 2, 0]
    assert book.samples.tolist() == [5, 0, 5, 0] and book.histograms[2].tolist() == [2, 3, 0]
    assert book.seen() == [0, 2] and torch.equal(book.model(2)["w"], torch.ones(2))
    again = ClientBook(4, 3, keep_models=True)
    again.load_state_dict(book.state_dict())
    assert torch.equal(again.participations, book.participations) and again.stored() == [0, 2]


def test_a_rejected_upload_is_no_participation_and_an_empty_round_keeps_the_model(tmp_path, tiny_config,
                                                                                   monkeypatch):
    from hetfl.fl.payload import PayloadError
    from hetfl.methods.fedavg import FedAvgRounds

    def reject_round_2(self, cid, message, upload, ctx):  # noqa: ANN001, ANN202
        if message.meta.get("round") == 2:
            raise PayloadError("scripted rejection")

    monkeypatch.setattr(FedAvgRounds, "validate_upload", reject_round_2)
    cfg = round_config(tiny_config, fedavg={"rounds": 3, "sample_ratio": 1.0})
    res = run(cfg, tmp_path, keep_checkpoints=True)["results"]["fedavg"]
    assert res["empty_rounds"] == [2] and len(res["client_failures"]) == 3
    rows = [json.loads(r) for r in (tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["accuracy"] == rows[1]["accuracy"]  # round 2 changed nothing
    saved = Payload.from_bytes((tmp_path / "fedavg" / "checkpoint.safetensors").read_bytes())
    assert saved.tensors["method.book.participations"].tolist() == [2, 2, 2]  # rounds 1 and 3 only


def test_every_model_is_logged_and_the_headline_is_reported(tmp_path, tiny_config):
    cfg = copy.deepcopy(tiny_config)
    cfg["validation"] = 0.2
    cfg["methods"] = {"two": {"method": "probe_two_models", "rounds": 2}}
    res = run(cfg, tmp_path)["results"]["two"]
    rows = [json.loads(r) for r in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()][:-1]
    assert all(set(r["models"]) == {"first", "second"} and r["headline"] == "second" for r in rows)
    assert all(set(r["models_val"]) == {"first", "second"} for r in rows)
    assert res["accuracy"] == rows[-1]["models"]["second"] == res["models"]["second"]
    assert set(res["models_best"]) == {"first", "second"}


def test_moon_with_its_client_states_on_disk_equals_moon_in_memory_and_resumes(tmp_path, tiny_config, monkeypatch):
    """state_memory_mb 0: every client's previous model waits on disk between its rounds; the run, and a run
    stopped in round 3 and resumed, end bit for bit where the in-memory run ends."""
    from hetfl.methods.moon import Moon

    cfg = round_config(tiny_config, moon={**ROUNDS, "rounds": 4})
    memory = run(copy.deepcopy(cfg), tmp_path / "memory")["results"]["moon"]
    disk = assert_interrupted_run_resumes({**cfg, "simulator": {"state_memory_mb": 0}}, "moon", Moon, 3,
                                          tmp_path / "disk", monkeypatch)
    assert disk["accuracy"] == memory["accuracy"] and disk["tensor_bytes"] == memory["tensor_bytes"]
    assert same_weights(weights(tmp_path / "memory", "moon"), weights(tmp_path / "disk" / "full", "moon"))
    assert not (tmp_path / "disk" / "full" / "moon" / "client_state").exists()  # gone with the checkpoint


def test_client_states_spill_the_least_recently_used_and_read_them_back(tmp_path):
    from hetfl.fl.clientstate import ClientStates

    states = ClientStates(tmp_path, memory_limit=2 * 400)  # room for two states of 100 float32
    for cid in range(4):
        states[cid] = {"prev": torch.full((100,), float(cid)), "seen": cid}
    states[0]["seen"] = 10  # client 0 used again: clients 1 and 2 are the oldest
    assert states.spill(round_=5) == [1, 2] and set(states.in_memory()) == {3, 0}
    assert states.files() == {"1": "state-1-r5.safetensors", "2": "state-2-r5.safetensors"}
    assert states[1]["seen"] == 1 and torch.equal(states[1]["prev"], torch.full((100,), 1.0))
    assert list(states) == [0, 1, 2, 3] and len(states) == 4
    states.committed()  # a checkpoint no longer names client 1's file
    assert not (tmp_path / "state-1-r5.safetensors").exists() and (tmp_path / "state-2-r5.safetensors").exists()
