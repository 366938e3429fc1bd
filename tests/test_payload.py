import pytest
import torch

from hetfl.fl.aggregate import Ensemble, weighted_average
from hetfl.fl.comm import CommLedger
from hetfl.fl.payload import Payload, PayloadError, state_payload
from hetfl.models import build_model


def make_payload() -> Payload:
    torch.manual_seed(0)
    return Payload({"w": torch.randn(3, 4), "n": torch.arange(5)},
                   {"client_id": 2, "num_samples": 17, "label_counts": [1, 16], "arch": "cnn2"})


def test_roundtrip_is_exact_and_bytes_are_the_wire_size():
    p = make_payload()
    blob = p.to_bytes()
    q = Payload.from_bytes(blob)
    assert q.meta == p.meta
    assert set(q.tensors) == {"w", "n"}
    assert torch.equal(q.tensors["w"], p.tensors["w"]) and torch.equal(q.tensors["n"], p.tensors["n"])
    assert p.nbytes == len(blob)
    # data bytes are all there: 12 float32 + 5 int64, plus a header
    assert p.nbytes >= 12 * 4 + 5 * 8


def test_from_bytes_rejects_garbage_without_unpickling():
    import pickle

    with pytest.raises(PayloadError, match="not a hetfl payload"):
        Payload.from_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(PayloadError):
        Payload.from_bytes(b"\x00" * 3)


def test_validate_names_shapes_and_finite_values():
    p = make_payload()
    p.validate({"w": (3, 4), "n": (5,)}, required_meta=("num_samples",))
    with pytest.raises(PayloadError, match="missing"):
        p.validate({"w": (3, 4), "n": (5,), "b": (1,)})
    with pytest.raises(PayloadError, match="shape"):
        p.validate({"w": (4, 3), "n": (5,)})
    with pytest.raises(PayloadError, match="lacks"):
        p.validate(required_meta=("arch", "seconds"))
    p.tensors["w"][0, 0] = float("nan")
    with pytest.raises(PayloadError, match="NaN or inf"):
        p.validate()
    p.tensors["w"][0, 0] = float("inf")
    with pytest.raises(PayloadError, match="NaN or inf"):
        p.validate()


def test_state_payload_carries_every_parameter_and_buffer():
    model = build_model("cnn2", 1, 28, 10)
    p = state_payload(model, arch="cnn2")
    assert set(p.tensors) == set(model.state_dict())
    assert any("running_mean" in k for k in p.tensors)


def test_weighted_average_matches_hand_computation_and_weights_sum_to_one():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(10)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(20)}
    avg = weighted_average([a, b], [1, 3])  # weights 0.25 / 0.75
    assert torch.allclose(avg["w"], torch.tensor([2.5, 5.0]))
    assert avg["n"].dtype == torch.int64 and int(avg["n"]) == 18  # 17.5 rounds to even
    same = weighted_average([a, b], [100, 300])
    assert torch.equal(same["w"], avg["w"])
    with pytest.raises(ValueError, match="non-negative"):
        weighted_average([a, b], [1, -1])
    with pytest.raises(ValueError, match="different parameter names"):
        weighted_average([a, {"v": torch.zeros(2), "n": torch.tensor(1)}], [1, 1])


def test_ensemble_is_the_weighted_mean_of_member_logits():
    torch.manual_seed(0)
    members = [build_model("cnn2", 1, 16, 4).eval(), build_model("lenet5", 1, 16, 4).eval()]
    x = torch.rand(5, 1, 16, 16)
    with torch.no_grad():
        expected = (members[0](x) + members[1](x)) / 2
        assert torch.allclose(Ensemble(members)(x), expected, atol=1e-6)
        weighted = Ensemble(members, [1, 3])(x)
        assert torch.allclose(weighted, 0.25 * members[0](x) + 0.75 * members[1](x), atol=1e-6)


def test_ensemble_averages_bf16_member_logits_in_fp32():
    torch.manual_seed(0)
    members = [build_model("cnn2", 1, 16, 4).eval(), build_model("lenet5", 1, 16, 4).eval()]
    x = torch.rand(5, 1, 16, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        each = [m(x) for m in members]  # the members' own bf16 logits
        got = Ensemble(members, [1, 3])(x)
    assert each[0].dtype == torch.bfloat16 and got.dtype == torch.float32
    expected = 0.25 * each[0].float() + 0.75 * each[1].float()  # no rounding of the average to bf16
    assert torch.allclose(got, expected, atol=1e-6)


def test_ledger_totals_per_client_and_round():
    ledger = CommLedger()
    ledger.add(1, 0, "down", 10, "model", 4)
    ledger.add(1, 0, "up", 7, "logits", 3)
    ledger.add(2, 1, "up", 5)
    ledger.add(2, 1, "peer", 6, "distilled_data", 2)
    assert ledger.total("up") == 12 and ledger.total("down") == 10 and ledger.total("peer") == 6
    assert ledger.per_client() == {0: {"up": 7, "down": 10, "peer": 0}, 1: {"up": 5, "down": 0, "peer": 6}}
    assert ledger.per_round() == [{"round": 1, "up": 7, "down": 10, "peer": 0, "tensor_bytes": 7},
                                  {"round": 2, "up": 5, "down": 0, "peer": 6, "tensor_bytes": 2}]
    assert ledger.summary()["tensor_bytes"] == {"down": {"model": 4}, "up": {"logits": 3, "model": 0},
                                                "peer": {"distilled_data": 2}}
    with pytest.raises(ValueError):
        ledger.add(1, 0, "sideways", 1)
    with pytest.raises(ValueError):
        ledger.add(1, 0, "up", 1, "secrets")


def test_read_meta_reads_the_header_alone_and_rejects_other_files(tmp_path):
    path = tmp_path / "p.safetensors"
    path.write_bytes(Payload({"w": torch.ones(3)}, {"epoch": 2, "name": "x"}).to_bytes())
    assert Payload.read_meta(path) == {"epoch": 2, "name": "x"}
    path.write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00nope")
    with pytest.raises(PayloadError, match="not a hetfl payload"):
        Payload.read_meta(path)


def test_write_replaces_the_file_whole_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "p.safetensors"
    Payload({"w": torch.ones(3)}, {"step": 1}).write(path)
    Payload({"w": torch.zeros(2)}, {"step": 2}).write(path)
    back = Payload.from_bytes(path.read_bytes())
    assert back.meta == {"step": 2} and torch.equal(back.tensors["w"], torch.zeros(2))
    assert [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]


def test_the_communication_equations_reproduce_hfldds_table_ii():
    from hetfl.fl.comm import cost_fedavg, cost_fedseq, cost_hfldd, mebibytes

    w = 44_426  # the unpadded LeNet-5 at 1 x 28 x 28; a reported round r means T = r + 1
    assert round(mebibytes(cost_hfldd(100, 1000, 10, [400] * 84, 784, 16, w, 6)), 1) == 58.8
    assert round(mebibytes(cost_fedavg(100, 18, w)), 2) == 593.15
    assert round(mebibytes(cost_fedavg(100, 21, w)), 1) == 694.8
    assert round(mebibytes(cost_fedseq(10, 10, w, 2)), 1) == 39.0
    assert round(mebibytes(cost_fedavg(100, 3, w)), 1) == 84.7  # DynaFed


def test_the_ledger_equals_eq_3_for_fedavg_with_a_seeded_start(tmp_path, tiny_config):
    from hetfl.engine.simulator import Simulator, prepare
    from hetfl.fl.comm import cost_fedavg
    from hetfl.methods.checks import validate
    from hetfl.models import build_model

    tiny_config["client"] = {"model": "simplecnn", "epochs": 1, "batch_size": 32, "lr": 0.05}
    tiny_config["server"] = {"model": "simplecnn"}
    tiny_config["methods"] = {"fedavg": {"rounds": 4, "sample_ratio": 1.0}}
    res = Simulator(prepare(validate(tiny_config)), tmp_path, None, quiet=True).run()["results"]["fedavg"]
    w = sum(p.numel() for p in build_model("simplecnn", 1, 16, 4).parameters())
    moved = res["tensor_bytes"]["up"]["model"] + res["tensor_bytes"]["down"]["model"]
    assert moved * 8 == cost_fedavg(3, 4, w)
