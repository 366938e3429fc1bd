"""KDIA and FedGKD: triFreqs, the teacher, the generator, resume and Flower (tiny synthetic data)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from hetfl.config import ConfigError
from hetfl.fl.clientbook import ClientBook
from hetfl.fl.payload import Payload
from hetfl.methods.kdia import tri_freqs
from tests.test_rounds import ROUNDS, assert_interrupted_run_resumes, round_config, run, same_weights, started

KDIA = {"rounds": 3, "sample_ratio": 0.67, "gen_epochs": 1, "gen_batches": 4, "gen_batch_size": 16}


def scripted_book() -> ClientBook:
    book = ClientBook(4, 2)
    up = Payload({}, {"num_samples": 1})
    book.update(1, {0: up, 1: up})
    book.update(2, {1: up, 2: up})
    return book


def test_tri_freqs_equal_the_hand_computation():
    sizes = torch.tensor([10.0, 20.0, 30.0, 40.0])
    gm = tri_freqs(scripted_book(), 2, sizes, "gm")
    am = tri_freqs(scripted_book(), 2, sizes, "am")
    assert float(gm.sum()) == pytest.approx(1.0) and float(am.sum()) == pytest.approx(1.0)
    assert gm.tolist() == pytest.approx([0.1913, 0.4237, 0.3850, 0.0], abs=1e-4)
    assert am.tolist() == pytest.approx([0.1657, 0.3665, 0.3165, 0.1514], abs=1e-4)
    book = ClientBook(4, 2)  # C = 1: every client every round -> F proportional to N_k^(1/3)
    for r in (1, 2, 3):
        book.update(r, {k: Payload({}, {"num_samples": 1}) for k in range(4)})
    full = tri_freqs(book, 3, sizes, "gm")
    cube = sizes.double() ** (1 / 3)
    assert full.tolist() == pytest.approx((cube / cube.sum()).tolist(), abs=1e-9)


def test_the_teacher_is_the_tri_freqs_sum_of_the_stored_uploads(tmp_path, tiny_config):
    method, ctx = started(round_config(tiny_config, kdia=dict(KDIA)), "kdia", tmp_path)
    torch.manual_seed(0)
    base = method.global_model.state_dict()
    uploads = {c: Payload({k: v + torch.randn_like(v) for k, v in base.items()},
                          {"num_samples": 10 * (c + 1), "label_counts": [10 * (c + 1), 0, 0, 0]}) for c in (0, 2)}
    method.book.update(1, uploads)
    got = method.teacher_state(1)
    f = tri_freqs(method.book, 1, method.sizes, "gm")
    for key, value in got.items():  # a slow loop over every client
        slow = sum(float(f[k]) * (uploads[k].tensors[key] if k in uploads else method.initial[key]).double()
                   for k in range(3))
        assert torch.allclose(value.double(), slow, atol=1e-6), key
    assert float(f[1]) == 0.0  # never seen: weight 0 under the geometric mean


def test_kdia_runs_reports_student_teacher_and_the_pick_and_counts_generator_bytes(tmp_path, tiny_config):
    cfg = round_config(tiny_config, kdia=dict(KDIA))
    cfg["validation"] = 0.2
    res = run(cfg, tmp_path)["results"]["kdia"]
    assert set(res["models"]) == {"kdia[student]", "kdia[teacher]"}
    assert res["tensor_bytes"]["down"]["generator"] > 0 and "val_selected_accuracy" in res
    rows = [json.loads(r) for r in (tmp_path / "kdia" / "metrics.jsonl").read_text().splitlines()][:-1]
    assert all(set(r["models"]) == {"kdia[student]", "kdia[teacher]"} for r in rows)
    picked = rows[-1]["headline"]
    assert rows[-1]["models_val"][picked] == max(rows[-1]["models_val"].values())


def test_kdia_without_its_terms_is_fedavg_and_sends_only_the_student(tmp_path, tiny_config):
    plain = {k: v for k, v in KDIA.items() if not k.startswith("gen_")}
    cfg = round_config(tiny_config, fedavg=plain, kdia={**KDIA, "lambda_kd": 0.0, "lambda_gen": 0.0,
                                                          "select": "student"})
    res = run(cfg, tmp_path)["results"]
    assert res["kdia"]["accuracy"] == res["fedavg"]["accuracy"]
    sent, plain_sent = res["kdia"]["tensor_bytes"], res["fedavg"]["tensor_bytes"]  # headers carry the terms
    assert sent["down"] == plain_sent["down"] and sent["up"]["model"] == plain_sent["up"]["model"]


@pytest.mark.parametrize(("change", "key"), [
    ({"select": "val"}, "select: val needs a validation split"),
    ({"teacher_weights": "median"}, "methods.kdia.teacher_weights"),
    ({"kd_direction": "sideways"}, "methods.kdia.kd_direction"),
    ({"lambda_kd": -1}, "methods.kdia.lambda_kd"),
    ({"tau": 0}, "methods.kdia.tau"),
])
def test_kdia_bad_settings_fail_before_training(tmp_path, tiny_config, change, key):
    cfg = round_config(tiny_config, kdia={**KDIA, **change})
    with pytest.raises((ConfigError, ValueError), match=key.replace(".", r"\.")):
        run(cfg, tmp_path)


def test_kdia_killed_after_a_round_resumes_to_the_same_bits(tmp_path, tiny_config, monkeypatch):
    from hetfl.methods.kdia import KDIA as Method

    # student and teacher bit for bit: the generator and its Adam state resumed too
    assert_interrupted_run_resumes(round_config(tiny_config, kdia=dict(KDIA)), "kdia", Method, 3, tmp_path,
                                   monkeypatch)


def test_fedgkd_buffer_holds_the_last_global_models_and_its_teacher_is_their_mean(tmp_path, tiny_config):
    method, ctx = started(round_config(tiny_config, fedgkd={"rounds": 9, "buffer_length": 3}), "fedgkd", tmp_path)
    assert method.teacher() is None and method.terms(0, 1, ctx) == {}  # round 1: no term
    base = {k: v.clone() for k, v in method.global_model.state_dict().items()}
    uploads = {0: Payload(base, {"num_samples": 1, "arch": "simplecnn"})}
    for r in range(1, 6):  # scripted rounds: the global model after round r is base + r
        uploads[0].tensors = {k: v + r for k, v in base.items()}
        method.aggregate(r, uploads, ctx)
    assert len(method.buffer) == 3
    teacher = method.teacher()
    for key, value in base.items():  # the mean of rounds 3, 4, 5
        assert torch.allclose(teacher[key], value + 4, atol=1e-5)
    assert method.terms(0, 6, ctx) == {"kd": {"weight": 0.1, "temperature": 2.0}}
    message = method.client_message(0, 6, ctx)
    assert any(k.startswith("teacher/") for k in message.tensors)


def test_fedgkd_runs_and_resumes(tmp_path, tiny_config):
    cfg = round_config(tiny_config, fedgkd=dict(ROUNDS), fedavg=dict(ROUNDS))
    res = run(cfg, tmp_path, keep_checkpoints=True)["results"]
    assert res["fedgkd"]["tensor_bytes"]["down"]["model"] > res["fedavg"]["tensor_bytes"]["down"]["model"]
    saved = Payload.from_bytes((tmp_path / "fedgkd" / "checkpoint.safetensors").read_bytes())
    assert {k.split(".")[2] for k in saved.tensors if k.startswith("method.buffer.")} == {"0", "1", "2"}


# ---- FedGen ----------------------------------------------------------------------------------------
def test_fedgen_trains_its_generator_sends_it_from_round_2_and_resumes(tmp_path, tiny_config, monkeypatch):
    from hetfl.methods.fedgen import FedGen

    params = {"rounds": 3, "sample_ratio": 0.67, "gen_steps": 3}
    cfg = round_config(tiny_config, fedgen=dict(params))
    full = run(copy.deepcopy(cfg), tmp_path / "full")["results"]["fedgen"]
    rows = [json.loads(r) for r in (tmp_path / "full" / "fedgen" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and full["tensor_bytes"]["down"]["generator"] > 0
    method, ctx = started(copy.deepcopy(cfg), "fedgen", tmp_path / "probe")
    assert method.terms(0, 1, ctx) == {} and "tensor_kinds" not in method.client_message(0, 1, ctx).meta
    assert method.terms(0, 3, ctx)["fedgen"]["alpha"] == pytest.approx(10 * 0.98 ** 2)
    assert_interrupted_run_resumes(cfg, "fedgen", FedGen, 3, tmp_path / "resume", monkeypatch)


def test_fedgen_diversity_equals_a_slow_loop():
    from hetfl.methods.fedgen import fedgen_diversity

    torch.manual_seed(1)
    noise, out = torch.randn(5, 3), torch.randn(5, 4)
    total = 0.0
    for i in range(5):
        for j in range(5):
            total += float(((noise[i] - noise[j]) ** 2).mean()) * float((out[i] - out[j]).abs().mean())
    assert float(fedgen_diversity(noise, out)) == pytest.approx(torch.exp(torch.tensor(-total / 25)).item(), rel=1e-5)


# ---- FedCOG ----------------------------------------------------------------------------------------
def test_fedcog_label_proportions_follow_the_complement_of_the_histogram():
    from hetfl.fl.objectives import complement_labels

    counts = torch.tensor([50, 10, 0, 40])  # gaps 0, 40, 50, 10: shares of 100 = 0, .4, .5, .1
    labels = complement_labels(counts, 20)
    assert torch.bincount(labels, minlength=4).tolist() == [0, 8, 10, 2]
    labels = complement_labels(counts, 7)  # 2.8, 3.5, 0.7 -> floors 2, 3, 0 and the 2 largest remainders
    assert torch.bincount(labels, minlength=4).tolist() == [0, 3, 3, 1]
    assert torch.bincount(complement_labels(torch.tensor([5, 5]), 4)).tolist() == [2, 2]  # flat: all alike


def test_fedcog_before_start_round_equals_fedavg_and_then_differs(tmp_path, tiny_config, monkeypatch):
    from hetfl.methods.fedcog import FedCOG

    fast = {"g_steps": 3, "g_size": 16}
    cfg = round_config(tiny_config, fedavg={**ROUNDS, "rounds": 2}, fedcog={**ROUNDS, "start_round": 3, **fast})
    original = FedCOG.aggregate

    def stop_in_round_3(self, round_, uploads, ctx):  # noqa: ANN001, ANN202
        if round_ == 3:  # the first synthesis round trained; its checkpoint holds round 2
            raise KeyboardInterrupt
        return original(self, round_, uploads, ctx)

    monkeypatch.setattr(FedCOG, "aggregate", stop_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path)
    base = load_file(str(tmp_path / "fedavg" / "fedavg.safetensors"))
    saved = Payload.from_bytes((tmp_path / "fedcog" / "checkpoint.safetensors").read_bytes()).tensors
    prefix = "method.fedcog."
    assert same_weights(base, {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)})
    monkeypatch.undo()
    cfg["methods"] = {"fedavg": dict(ROUNDS), "fedcog": {**ROUNDS, "start_round": 2, **fast}}
    run(cfg, tmp_path / "on")
    assert not same_weights(load_file(str(tmp_path / "on" / "fedavg" / "fedavg.safetensors")),
                            load_file(str(tmp_path / "on" / "fedcog" / "fedcog.safetensors")))


def test_fedcog_start_round_past_the_end_fails_before_training(tmp_path, tiny_config):
    cfg = round_config(tiny_config, fedcog={**ROUNDS, "start_round": 5})
    with pytest.raises(ValueError, match="methods.fedcog: start_round 5 is past the last round"):
        run(cfg, tmp_path)


def test_fedcog_killed_after_a_round_resumes_to_the_same_bits(tmp_path, tiny_config, monkeypatch):
    from hetfl.methods.fedcog import FedCOG

    cfg = round_config(tiny_config, fedcog={"rounds": 4, "sample_ratio": 0.67, "start_round": 2, "g_steps": 3,
                                            "g_size": 16})
    assert_interrupted_run_resumes(cfg, "fedcog", FedCOG, 3, tmp_path, monkeypatch)


def test_a_rejected_kdia_upload_changes_no_count_no_stored_model_and_no_weight(tmp_path, tiny_config, monkeypatch):
    from hetfl.fl.method import sample_clients
    from hetfl.fl.payload import PayloadError
    from hetfl.methods.fedavg import FedAvgRounds

    target = sample_clients(3, 0.67, 2, 0)[0]
    validate_upload = FedAvgRounds.validate_upload

    def reject(self, cid, message, upload, ctx):  # noqa: ANN001, ANN202
        if cid == target and message.meta.get("round") == 2:
            raise PayloadError("scripted rejection")
        return validate_upload(self, cid, message, upload, ctx)

    monkeypatch.setattr(FedAvgRounds, "validate_upload", reject)
    cfg = round_config(tiny_config, kdia={**KDIA, "rounds": 2})
    run(cfg, tmp_path, keep_checkpoints=True)
    saved = Payload.from_bytes((tmp_path / "kdia" / "checkpoint.safetensors").read_bytes()).tensors
    sampled = [set(sample_clients(3, 0.67, r, 0)) for r in (1, 2)]
    expected = [sum(c in s and not (c == target and r == 2) for r, s in enumerate(sampled, 1)) for c in range(3)]
    assert saved["method.book.participations"].tolist() == expected
    last = [max([r for r, s in enumerate(sampled, 1) if c in s and not (c == target and r == 2)], default=-1)
            for c in range(3)]
    assert saved["method.book.last_round"].tolist() == last


def test_the_client_book_spills_models_past_its_memory_limit_and_resumes_from_the_files(tmp_path):
    spill = tmp_path / "book"
    book = ClientBook(3, 2, keep_models=True, spill_dir=spill, memory_limit=8)  # one 2-float model fits
    ups = {c: Payload({"w": torch.full((2,), float(c))}, {"num_samples": 1}) for c in range(3)}
    book.update(1, {0: ups[0], 1: ups[1]})
    assert book.memory_bytes() == 8 and book.spilled() == [1]
    assert torch.equal(book.model(1)["w"], torch.ones(2)) and book.model(2) is None
    state = book.state_dict()
    assert "model.1.w" not in state and state["spilled"].tolist() == [-1, 1, -1]
    book.update(2, {1: Payload({"w": torch.full((2,), 5.0)}, {}), 2: ups[2]})
    assert sorted(p.name for p in spill.iterdir()) == [f"client-{c}-round-{r}.safetensors"
                                                       for c, r in ((1, 1), (1, 2), (2, 2))]
    again = ClientBook(3, 2, keep_models=True, spill_dir=spill, memory_limit=8)
    again.load_state_dict(book.state_dict())  # what the round-2 checkpoint holds
    assert again.stored() == [0, 1, 2] and [float(again.model(c)["w"][0]) for c in again.stored()] == [0.0, 5.0, 2.0]
    assert not (spill / "client-1-round-1.safetensors").exists()  # not named by the loaded checkpoint
    book.update(3, {})  # round 2's checkpoint is written: round 1's file of client 1 goes
    (spill / "client-2-round-2.safetensors").unlink()
    with pytest.raises(ValueError, match="client 2's kept model"):
        ClientBook(3, 2, keep_models=True, spill_dir=spill, memory_limit=8).load_state_dict(book.state_dict())


def test_kdia_with_its_client_models_on_disk_equals_kdia_in_memory_and_resumes(tmp_path, tiny_config, monkeypatch):
    from hetfl.methods.kdia import KDIA as Method

    memory = run(round_config(tiny_config, kdia=dict(KDIA)), tmp_path / "memory")["results"]["kdia"]
    disk = assert_interrupted_run_resumes(round_config(tiny_config, kdia={**KDIA, "book_memory_mb": 0}), "kdia",
                                          Method, 3, tmp_path / "disk", monkeypatch)
    assert disk["models"] == memory["models"] and disk["tensor_bytes"] == memory["tensor_bytes"]
    saved = sorted((tmp_path / "memory" / "kdia").glob("*.safetensors"))
    assert saved and all(same_weights(load_file(str(p)), load_file(str(tmp_path / "disk" / "full" / "kdia" / p.name)))
                         for p in saved)
    assert not (tmp_path / "disk" / "full" / "kdia" / "clientbook").exists()  # gone with the checkpoint


def test_fedcog_js_divergence_matches_the_probability_form_and_keeps_finite_gradients():
    from hetfl.fl.objectives import js_divergence

    torch.manual_seed(0)
    a, b = torch.randn(8, 10), torch.randn(8, 10)
    p, q = a.softmax(1).double(), b.softmax(1).double()
    m = (p + q) / 2
    slow = ((p * (p / m).log()).sum(1) + (q * (q / m).log()).sum(1)).mean() / 2
    assert float(js_divergence(a, b)) == pytest.approx(float(slow), rel=1e-5)
    far = torch.tensor([[200.0, 0.0, -50.0]], requires_grad=True)  # probabilities that underflow to 0
    near = torch.tensor([[0.0, 100.0, 0.0]], requires_grad=True)
    js_divergence(far, near).backward()
    assert torch.isfinite(far.grad).all() and torch.isfinite(near.grad).all()
    assert float(js_divergence(far, near).detach()) == pytest.approx(math.log(2), rel=1e-6)  # disjoint: log 2


def test_generated_labels_are_drawn_once_and_reshuffled_each_epoch():
    """Sec. 5.3: one label per real sample, drawn once and reshuffled per epoch; a client below the batch
    size draws N_k E labels and uses N_k other ones in each of its E epochs."""
    from hetfl.fl.objectives import Generated
    from hetfl.models.generator import FeatureGenerator

    generator = FeatureGenerator(8, 4, (16, 5, 5))
    term = Generated(1.0, generator, num_samples=70, batch_size=32, epochs=3, seed=0)
    drawn = term.labels.clone()
    assert len(drawn) == 70
    for _ in range(3):  # an epoch: batches of 32, 32, 6
        epoch = torch.cat([term.next_labels(n) for n in (32, 32, 6)])
        assert sorted(epoch.tolist()) == sorted(drawn.tolist())  # the same labels, reshuffled
    tiny = Generated(1.0, generator, num_samples=5, batch_size=32, epochs=3, seed=0)
    assert len(tiny.labels) == 15
    chunks = [tiny.next_labels(5) for _ in range(3)]  # one step an epoch
    assert torch.equal(torch.cat(chunks), tiny.labels)  # three other chunks of the N_k E drawn


def test_kdia_creates_the_generator_optimiser_anew_every_round(tmp_path, tiny_config, monkeypatch):
    """As the authors' code: Adam's state starts from zero at each round's generator training."""
    from hetfl.methods import kdia

    steps = []
    real = kdia.train_generator

    def spy(generator, opt, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = real(generator, opt, *args, **kw)
        steps.append(max(int(s["step"]) for s in opt.state.values()))
        return out

    monkeypatch.setattr(kdia, "train_generator", spy)
    run(round_config(tiny_config, kdia=KDIA), tmp_path)
    assert steps == [KDIA["gen_epochs"] * KDIA["gen_batches"]] * KDIA["rounds"]
