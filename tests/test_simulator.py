"""End-to-end behaviour of the in-process simulator on tiny synthetic data."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hetfl.cli import main
from hetfl.config import ConfigError
from hetfl.engine.simulator import Simulator, prepare
from hetfl.engine.uploads import ClientExchange
from hetfl.fl.cache import UploadCache, uploads_digest
from hetfl.fl.payload import Payload
from hetfl.fl.training import predict_logits
from hetfl.methods.checks import validate
from hetfl.models import build_model


def run(cfg, out, cache=None, **kw):
    cfg = validate(cfg)
    return Simulator(prepare(cfg), out, cache, quiet=True, **kw).run()


def test_summary_and_outputs(tmp_path, tiny_config):
    tiny_config["methods"]["central"] = {"client": {"epochs": 3}}
    summary = run(tiny_config, tmp_path / "run")
    res = summary["results"]
    assert list(res) == ["fedavg", "ensemble", "central"]
    for r in res.values():
        assert set(r) >= {"accuracy", "best_accuracy", "seconds", "bytes_up", "bytes_down"}
        assert 0 <= r["accuracy"] <= r["best_accuracy"] <= 100
    assert res["central"]["accuracy"] > 60  # 4 classes: chance is 25
    part = json.loads((tmp_path / "run" / "partition.json").read_text())
    assert part["num_classes"] == 4 and sum(map(sum, part["counts"])) == 160
    assert (tmp_path / "run" / "fedavg" / "fedavg.safetensors").is_file()
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["config"]["name"] == "tiny" and saved["results"].keys() == res.keys()
    env = saved["environment"]  # what the timings were measured on
    assert env["threads"] >= 1 and env["cpu"]
    assert env["cpu_capability"] in ("DEFAULT", "NO AVX", "AVX2", "AVX512", "ZVECTOR", "SVE256")
    assert isinstance(env["bf16_native"], bool)  # bf16 timings mean little where bf16 is emulated
    assert set(env["cpu_bf16"]) <= {"avx512_bf16", "amx_bf16"}  # AMX: several times faster bf16
    if env["device"].startswith("cuda"):  # which card: "cuda" alone does not date the minutes
        assert env["accelerator"] == torch.cuda.get_device_name(0)
    else:
        assert env["accelerator"] is None


def test_bytes_counted_equal_payload_sizes(tmp_path, tiny_config):
    cache = tmp_path / "cache"
    summary = run(tiny_config, tmp_path / "run", cache)
    blobs = sorted(cache.rglob("*.safetensors"))
    assert len(blobs) == 3  # one upload per client, shared by fedavg and ensemble
    total = sum(len(p.read_bytes()) for p in blobs)
    for name in ("fedavg", "ensemble"):
        assert summary["results"][name]["bytes_up"] == total
        assert summary["results"][name]["bytes_down"] > 0
    comm = json.loads((tmp_path / "run" / "fedavg" / "communication.json").read_text())
    assert sum(c["up"] for c in comm["per_client"].values()) == total


def test_cache_returns_identical_uploads_and_skips_training(tmp_path, tiny_config):
    cache = tmp_path / "cache"
    first = run(tiny_config, tmp_path / "a", cache)
    blobs = {p: p.read_bytes() for p in cache.rglob("*.safetensors")}
    second = run(tiny_config, tmp_path / "b", cache)
    assert {p: p.read_bytes() for p in cache.rglob("*.safetensors")} == blobs
    assert second["results"]["fedavg"]["cached_uploads"] == 3
    assert second["results"]["fedavg"]["accuracy"] == first["results"]["fedavg"]["accuracy"]
    a = load_file(str(tmp_path / "a" / "fedavg" / "fedavg.safetensors"))
    b = load_file(str(tmp_path / "b" / "fedavg" / "fedavg.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the thread count is recorded beside each upload (it changes retrained bits) but not keyed
    infos = [json.loads(p.with_suffix(".json").read_text()) for p in blobs]
    assert {i["torch_threads"] for i in infos} == {torch.get_num_threads()}
    torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)
    try:
        assert run(tiny_config, tmp_path / "t", cache)["results"]["fedavg"]["cached_uploads"] == 3
    finally:
        torch.set_num_threads(infos[0]["torch_threads"])
    # a different local hyperparameter is a different key: retrain
    tiny_config["client"]["lr"] = 0.02
    third = run(tiny_config, tmp_path / "c", cache)
    assert third["results"]["fedavg"]["cached_uploads"] == 0
    assert len(list(cache.rglob("*.safetensors"))) == 6


def test_torn_cache_entry_is_retrained(tmp_path):
    cache = UploadCache(tmp_path)
    cache.put("ab" + "0" * 62, Payload({"w": torch.ones(2)}, {"x": 1}), {})
    assert cache.get("ab" + "0" * 62).meta == {"x": 1}
    path = next(tmp_path.rglob("*.safetensors"))
    path.write_bytes(path.read_bytes()[:10])
    with pytest.warns(UserWarning, match="is damaged .*; removed, that client trains again"):
        assert cache.get("ab" + "0" * 62) is None
    assert not path.exists()


def _flip_bit(path):
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 1  # the low bit of a weight's last byte
    path.write_bytes(bytes(blob))


def _set_nan(path):
    from safetensors.torch import load_file, save_file

    meta = json.loads(path.with_suffix(".json").read_text())["meta"]
    tensors = load_file(path)
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, path, metadata={"hetfl": json.dumps(meta, sort_keys=True)})


def _truncate(path):
    path.write_bytes(path.read_bytes()[:100])


@pytest.mark.parametrize("damage", [_flip_bit, _set_nan, _truncate])
def test_a_damaged_cached_upload_is_removed_and_retrained_to_the_clean_result(tmp_path, tiny_config, damage):
    cache = tmp_path / "cache"
    clean = run(tiny_config, tmp_path / "clean", cache)["results"]["fedavg"]
    path = sorted(cache.rglob("*.safetensors"))[1]
    damage(path)
    with pytest.warns(UserWarning, match="upload cache: .* is damaged"):
        again = run(tiny_config, tmp_path / "again", cache)["results"]["fedavg"]
    assert again["cached_uploads"] == 2  # one client trained again
    assert (again["accuracy"], again["uploads_sha256"]) == (clean["accuracy"], clean["uploads_sha256"])
    third = run(tiny_config, tmp_path / "third", cache)["results"]["fedavg"]  # the retrained entry is sound
    assert third["cached_uploads"] == 3 and third["uploads_sha256"] == clean["uploads_sha256"]


def test_uploads_digest_names_the_bytes_and_the_clients_not_the_order():
    a, b = Payload({"w": torch.ones(2)}, {"n": 1}), Payload({"w": torch.zeros(2)}, {"n": 1})
    digest = uploads_digest({0: a, 1: b})
    assert digest == uploads_digest({1: b, 0: a}) and len(digest) == 64
    assert digest != uploads_digest({0: b, 1: a})  # the same bytes from other clients
    assert digest != uploads_digest({0: a, 1: Payload({"w": torch.zeros(2)}, {"n": 2})})  # metadata counts
    nudged = torch.zeros(2)
    nudged[1] = torch.finfo(torch.float32).tiny  # one bit
    assert digest != uploads_digest({0: a, 1: Payload({"w": nudged}, {"n": 1})})


def test_fedavg_equals_the_weighted_average_of_the_uploads(tmp_path, tiny_config):
    summary = run(tiny_config, tmp_path / "run", tmp_path / "cache")
    uploads = [Payload.from_bytes(p.read_bytes()) for p in (tmp_path / "cache").rglob("*.safetensors")]
    n = torch.tensor([u.meta["num_samples"] for u in uploads], dtype=torch.float64)
    assert n.sum() == sum(summary["clients"]["sizes"])
    got = load_file(str(tmp_path / "run" / "fedavg" / "fedavg.safetensors"))
    for key in ("features.0.weight", "head.weight") if "head.weight" in got else list(got)[:2]:
        expected = sum(w * u.tensors[key].double() for w, u in zip(n / n.sum(), uploads))
        assert torch.allclose(got[key].double(), expected, atol=1e-6)


def test_same_seed_same_results_different_seed_different(tmp_path, tiny_config):
    a = run(tiny_config, tmp_path / "a")["results"]
    b = run(tiny_config, tmp_path / "b")["results"]
    assert a["fedavg"]["accuracy"] == b["fedavg"]["accuracy"]
    assert a["ensemble"]["per_class"] == b["ensemble"]["per_class"]
    tiny_config["seed"] = 1
    c = run(tiny_config, tmp_path / "c")
    assert c["clients"]["sizes"] != run(validate({**tiny_config, "seed": 0}), tmp_path / "d")["clients"]["sizes"]


def test_heterogeneous_clients_average_within_each_architecture(tmp_path, tiny_config):
    tiny_config["client"]["model"] = ["cnn2", "lenet5"]
    tiny_config["server"]["model"] = "lenet5"
    res = run(tiny_config, tmp_path / "run")["results"]
    assert set(res["fedavg"]["models"]) == {"fedavg", "fedavg[cnn2]", "fedavg[vote]"}  # headline = server arch
    assert res["ensemble"]["accuracy"] >= 0
    # the vote (FedMHO's protocol) = the mean of the two group averages' logits, and is not saved
    folder = tmp_path / "run" / "fedavg"
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["fedavg.safetensors", "fedavg_cnn2.safetensors"]
    test = prepare(validate(tiny_config)).splits.test
    logits = []
    for name, arch in (("fedavg", "lenet5"), ("fedavg_cnn2", "cnn2")):
        model = build_model(arch, *test.shape[:2], test.num_classes)
        model.load_state_dict(load_file(str(folder / f"{name}.safetensors")))
        logits.append(predict_logits(model, test, torch.device("cpu")))
    vote = 100.0 * float((torch.stack(logits).mean(0).argmax(1) == test.y).float().mean())
    assert res["fedavg"]["models"]["fedavg[vote]"] == pytest.approx(vote, abs=1e-4)
    tiny_config["methods"] = {"fedavg": {"rounds": 2}}
    with pytest.raises(ValueError, match="every client on the server architecture"):
        run(tiny_config, tmp_path / "rounds")


def test_multi_round_fedavg_learns_samples_clients_and_resumes(tmp_path, tiny_config):
    tiny_config["clients"] = 6
    tiny_config["client"].update(epochs=4, batch_size=8)
    tiny_config["methods"] = {"fedavg": {"rounds": 4, "sample_ratio": 0.5}}
    full = run(tiny_config, tmp_path / "full")["results"]["fedavg"]
    rows = [json.loads(r) for r in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rows if r["step"] >= 0]
    assert [r["step"] for r in rounds] == [1, 2, 3, 4]
    assert all(len(r["clients"]) == 3 for r in rounds)
    assert full["accuracy"] > 45  # chance is 25
    # interrupt after round 2: rewrite the checkpoint as if the run had stopped there
    part = tmp_path / "part"
    tiny_config["methods"]["fedavg"]["rounds"] = 2
    run(tiny_config, part, keep_checkpoints=True)
    info = Payload.read_meta(part / "fedavg" / "checkpoint.safetensors")
    tiny_config["methods"]["fedavg"]["rounds"] = 4
    assert info["round"] == 2 and len(info["history"]) == 2 and info["ledger"]
    # a different config (rounds changed) must not resume: hash differs -> fresh run, same result
    with pytest.warns(UserWarning, match="not resumed .*written for another config.*start over"):
        resumed = run(tiny_config, part)["results"]["fedavg"]
    assert resumed["accuracy"] == full["accuracy"]


def test_resume_continues_from_the_checkpoint(tmp_path, tiny_config, monkeypatch):
    tiny_config["client"]["epochs"] = 1
    tiny_config["methods"] = {"fedavg": {"rounds": 3}}
    full = run(tiny_config, tmp_path / "full")["results"]["fedavg"]

    from hetfl.methods.fedavg import FedAvgRounds

    original = FedAvgRounds.aggregate
    calls = []

    def crash_in_round_3(self, round_, uploads, ctx):
        calls.append(round_)
        if round_ == 3 and len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, round_, uploads, ctx)

    monkeypatch.setattr(FedAvgRounds, "aggregate", crash_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_config, tmp_path / "crash")
    resumed = run(tiny_config, tmp_path / "crash")["results"]["fedavg"]
    assert calls == [1, 2, 3, 3]  # rounds 1-2 were not redone
    assert resumed["resumed_from_round"] == 2
    assert resumed["accuracy"] == full["accuracy"] and resumed["bytes_up"] == full["bytes_up"]
    rows = (tmp_path / "crash" / "fedavg" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3, -1]
    client = [json.loads(r)["client_seconds"] for r in rows[:3]]  # cumulative across the resume
    assert 0 < client[0] <= client[1] <= client[2] == round(resumed["client_seconds"], 3)
    assert resumed["server_seconds"] == max(0.0, resumed["seconds"] - resumed["exchange_seconds"])
    assert resumed["exchange_seconds"] >= resumed["client_seconds"]


def test_cli_run_partition_and_errors(tmp_path, tiny_config, capsys):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config))
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet", "--no-cache",
                 "--set", "client.epochs=1"]) == 0
    out = capsys.readouterr().out
    assert "fedavg" in out and "bytes up" in out
    assert (tmp_path / "out" / "partition.png").is_file() and (tmp_path / "out" / "results.png").is_file()
    assert main(["partition", str(path), "--out", str(tmp_path / "p")]) == 0
    assert "sizes: min" in capsys.readouterr().out
    assert (tmp_path / "p" / "partition.png").is_file()
    assert main(["run", str(path), "--set", "methods.fedsgd={}"]) == 2
    assert "unknown method 'fedsgd'" in capsys.readouterr().err
    assert main(["run", str(path), "--set", "partition.min_size=1000"]) == 2
    assert "min_size=1000 is impossible" in capsys.readouterr().err
    assert main(["run", str(path), "--out", str(tmp_path / "sub"), "--quiet", "--no-cache", "--methods", "ensemble",
                 "--set", "client.epochs=1"]) == 0
    assert list(json.loads((tmp_path / "sub" / "summary.json").read_text())["results"]) == ["ensemble"]
    capsys.readouterr()
    assert main(["run", str(path), "--methods", "dense"]) == 2
    assert "--methods ['dense'] not in the config's methods" in capsys.readouterr().err
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "cnn2" in out and "fedhydra" in out
    assert main(["run", str(path), "--out", str(path)]) == 2  # --out names a file: one line, no traceback
    assert capsys.readouterr().err.strip() == f"hetfl: error: --out {path}: a file of that name exists; give a folder"


def test_results_table_columns_line_up_whatever_the_method_names():
    from hetfl.report import results_table

    row = {"accuracy": 46.37, "best_accuracy": 57.65, "seconds": 39.6, "bytes_up": 590234, "bytes_down": 1843}
    text = results_table({"fedavg": row, "fedhydra_dense_log1p": {**row, "models": {"student": 12.5}}})
    lines = text.splitlines()
    acc_end = lines[0].index("acc %") + len("acc %")  # right-aligned numbers end under their header
    assert [x[:acc_end].rstrip().endswith("46.37") for x in lines[2:4]] == [True, True]
    assert len({len(x) for x in lines[:4]}) == 1  # header, rule and rows of one width
    assert lines[4].startswith("  student") and lines[4][:acc_end].endswith("12.50")
    assert len(lines) == 5  # no note: no method ended at chance


def test_results_table_notes_a_model_that_collapsed_to_chance():
    from hetfl.report import collapse_bounds, collapse_notes, results_table

    assert collapse_bounds(10) == (10.5, 30.0) and collapse_bounds(100) == (1.5, 3.0)

    row = {"seconds": 1.0, "bytes_up": 1, "bytes_down": 1, "per_class": [50.0] * 10}
    results = {"dense": {**row, "accuracy": 10.0, "best_accuracy": 77.08},  # collapsed
               "fedavg": {**row, "accuracy": 10.4, "best_accuracy": 12.0},  # never learned: no note
               "ensemble": {**row, "accuracy": 65.0, "best_accuracy": 65.0},
               "central": {"seconds": 1.0, "bytes_up": 1, "bytes_down": 1, "accuracy": 10.0, "best_accuracy": 90.0}}
    (note,) = collapse_notes(results)  # central: no per-class accuracies, classes unknown
    assert note.startswith("note: dense ended at 10.00 %, chance for 10 classes, after a best of 77.08 %")
    assert results_table(results).splitlines()[-1] == note


def test_imported_uploads_from_another_device_are_used_byte_for_byte(tmp_path, tiny_config):
    from hetfl.fl.cache import _head_key, import_uploads
    from hetfl.fl.payload import PayloadError

    gpu = tmp_path / "gpu"  # a cache as a GPU run leaves it: the same uploads under cuda's keys
    first = run(tiny_config, tmp_path / "a", tmp_path / "cpu")
    for info_path in (tmp_path / "cpu").rglob("*.json"):
        info = json.loads(info_path.read_text())
        assert info["keyed_for"] == {"torch": torch.__version__, "device": "cpu"} and info["request_tensors"] == []
        key = _head_key(info["fingerprint"], info["request"], "2.11.0+cu130", "cuda")
        UploadCache(gpu).put(key, UploadCache(tmp_path / "cpu").get(info_path.stem),
                             {**{k: v for k, v in info.items() if k not in ("key", "meta")},
                              "keyed_for": {"torch": "2.11.0+cu130", "device": "cuda"}})
    names = {folder: {p.name for p in folder.rglob("*.safetensors")} for folder in (gpu, tmp_path / "cpu")}
    assert len(names[gpu]) == 3 and not names[gpu] & names[tmp_path / "cpu"]  # cuda's keys: a CPU run misses them
    pairs = import_uploads(gpu, tmp_path / "here", torch.device("cpu"))
    assert len(pairs) == 3 and all(old != new for old, new in pairs)
    second = run(tiny_config, tmp_path / "b", tmp_path / "here")
    assert second["results"]["fedavg"]["cached_uploads"] == 3
    assert second["results"]["fedavg"]["uploads_sha256"] == first["results"]["fedavg"]["uploads_sha256"]
    assert second["results"]["fedavg"]["accuracy"] == first["results"]["fedavg"]["accuracy"]
    # an entry whose key does not match its fingerprint and request is refused, naming the file
    info_path = next(gpu.rglob("*.json"))
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "fingerprint": {**info["fingerprint"], "seed": 99}}))
    with pytest.raises(PayloadError, match=f"{info_path.name}: the key does not match"):
        import_uploads(gpu, tmp_path / "other", torch.device("cpu"))
    info_path.write_text(json.dumps({**info, "request_tensors": ["w"]}))
    with pytest.raises(PayloadError, match="carried tensors"):
        import_uploads(gpu, tmp_path / "other", torch.device("cpu"))
    with pytest.raises(PayloadError, match="no upload-cache entries"):
        import_uploads(tmp_path / "empty", tmp_path / "other", torch.device("cpu"))


class _Killed(Exception):
    """Stands in for a process killed in the middle of a client's local training."""


def _kill_client_1_in_epoch_2(monkeypatch):
    make_env = ClientExchange._env

    def killed_in_epoch_2_of_client_1(self, cid, states, bar=None, label=""):
        env = make_env(self, cid, states, bar, label)
        if cid == 1:
            def progress(epoch, _loss):
                if epoch == 2:
                    raise _Killed
            env.progress = progress
        return env

    monkeypatch.setattr(ClientExchange, "_env", killed_in_epoch_2_of_client_1)
    return make_env


def test_a_client_killed_in_local_training_resumes_from_its_checkpoint(tmp_path, tiny_config, monkeypatch, caplog):
    clean = tmp_path / "clean"
    reference = run(tiny_config, tmp_path / "ref", clean)
    cache = tmp_path / "cache"
    make_env = _kill_client_1_in_epoch_2(monkeypatch)
    with pytest.raises(_Killed):
        run(tiny_config, tmp_path / "a", cache, checkpoint_every_s=0)
    partial = list((cache / "partial").iterdir())
    assert len(partial) == 1 and Payload.from_bytes(partial[0].read_bytes()).meta["epoch"] == 1
    monkeypatch.setattr(ClientExchange, "_env", make_env)
    with caplog.at_level("WARNING", logger="hetfl"):
        resumed = run(tiny_config, tmp_path / "b", cache, checkpoint_every_s=0)
    assert "client 1: local training goes on from its checkpoint" in caplog.text
    assert not list((cache / "partial").iterdir())  # cleared once the upload is stored
    uploads = {p.relative_to(cache): p.read_bytes() for p in cache.glob("??/*.safetensors")}
    assert uploads == {p.relative_to(clean): p.read_bytes() for p in clean.glob("??/*.safetensors")}
    assert resumed["results"]["fedavg"]["accuracy"] == reference["results"]["fedavg"]["accuracy"]
    assert resumed["results"]["fedavg"]["cached_uploads"] == 1  # client 0 finished before the kill
    info = UploadCache(cache).info(partial[0].stem)
    assert info["seconds"] > info["resumed_after_seconds"] > 0


def test_with_checkpoints_off_a_killed_client_leaves_nothing(tmp_path, tiny_config, monkeypatch):
    _kill_client_1_in_epoch_2(monkeypatch)
    with pytest.raises(_Killed):
        run(tiny_config, tmp_path / "a", tmp_path / "cache", checkpoint_every_s=None)
    assert not (tmp_path / "cache" / "partial").exists()


def test_central_training_stopped_by_ctrl_c_resumes_to_the_same_model(tmp_path, tiny_config, monkeypatch):
    """Centralised training (a long server stage at the paper's budgets) saves its step on Ctrl-C and
    the same run again goes on from there: the uninterrupted run's model, one loss row per epoch, its
    earlier seconds counted, no checkpoint left; a dataset's digest names its bytes."""
    import signal

    from hetfl.data.base import ImageDataset

    tiny_config["methods"] = {"central": {"client": {"epochs": 3}}}
    full = run(tiny_config, tmp_path / "full")["results"]["central"]
    calls = []
    original = ImageDataset.batch

    def batch(self, index, device="cpu"):
        calls.append(1)
        if len(calls) == 7:  # epoch 2, step 2 of 5: held back until the step is done and saved
            signal.raise_signal(signal.SIGINT)
        return original(self, index, device)

    monkeypatch.setattr(ImageDataset, "batch", batch)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_config, tmp_path / "run")
    (saved,) = (tmp_path / "run" / "central").glob("checkpoint-central-*.safetensors")
    assert (Payload.read_meta(saved)["epoch"], Payload.read_meta(saved)["step"]) == (1, 2)
    monkeypatch.setattr(ImageDataset, "batch", original)
    resumed = run(tiny_config, tmp_path / "run")["results"]["central"]
    assert resumed["resumed_from_epoch"] == 1 and resumed["seconds"] > resumed["seconds_before_resume"] > 0
    assert resumed["accuracy"] == full["accuracy"]
    a = load_file(str(tmp_path / "run" / "central" / "central.safetensors"))
    b = load_file(str(tmp_path / "full" / "central" / "central.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in b)
    rows = [json.loads(x) for x in (tmp_path / "run" / "central" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if "train_loss" in x] == [1, 2, 3]
    assert not list((tmp_path / "run" / "central").glob("checkpoint-*"))
    data = ImageDataset(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 1]), 2, "d")
    other = ImageDataset(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([1, 0]), 2, "d")
    assert data.digest() == data.subset([0, 1]).digest() != other.digest()


def test_cpu_bf16_units_read_the_flags_line():
    """The bf16 units come from /proc/cpuinfo's flags, in the order weakest first; none without the line."""
    from hetfl.engine.environment import cpu_bf16_units

    amx = "processor\t: 0\nflags\t\t: fpu avx512f amx_tile amx_bf16 avx512_bf16 amx_int8\n"
    assert cpu_bf16_units(amx) == ["avx512_bf16", "amx_bf16"]
    assert cpu_bf16_units("flags\t: fpu avx2 avx512f\n") == []
    assert cpu_bf16_units("processor\t: 0\n") == []
    assert cpu_bf16_units("vmx flags\t: amx_bf16\nflags\t: fpu\n") == []  # the key must match whole
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # this machine's own flags, read the same way
        assert cpu_bf16_units() == cpu_bf16_units(cpuinfo.read_text())


def test_code_revision_names_the_commit_and_a_dirty_tree(tmp_path):
    """A result names the git commit of the code that ran it, +dirty with changed tracked files; None
    outside a checkout."""
    import subprocess

    from hetfl.engine.environment import code_revision

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    assert code_revision.__wrapped__(str(pkg)) is None
    git("init", "-q")
    (pkg / "m.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = git("rev-parse", "--short=12", "HEAD")
    assert code_revision.__wrapped__(str(pkg)) == head
    (tmp_path / "outside.txt").write_text("not tracked, not the package\n")
    assert code_revision.__wrapped__(str(pkg)) == head
    (pkg / "m.py").write_text("x = 2\n")
    assert code_revision.__wrapped__(str(pkg)) == head + "+dirty"


def test_a_finished_stage_leaves_no_checkpoint_unless_asked(tmp_path, tiny_config):
    from hetfl.engine.environment import code_revision

    tiny_config["methods"] = {"fedavg": {"rounds": 2}}
    summary = run(tiny_config, tmp_path / "run")
    assert summary["results"]["fedavg"]["code"] == summary["environment"]["code"] == code_revision()
    assert not list((tmp_path / "run" / "fedavg").glob("checkpoint*"))
    run(tiny_config, tmp_path / "kept", keep_checkpoints=True)
    assert (tmp_path / "kept" / "fedavg" / "checkpoint.safetensors").is_file()


def test_two_labels_of_one_method_run_and_report_apart(tmp_path, tiny_config):
    """``methods:`` maps a label to a method and its parameters; the summary is keyed by label."""
    tiny_config["methods"] = {"a": {"method": "fedavg", "rounds": 1}, "b": {"method": "fedavg", "rounds": 2},
                              "ensemble": {}}
    res = run(tiny_config, tmp_path / "run", tmp_path / "cache")["results"]
    assert list(res) == ["a", "b", "ensemble"]
    assert [res[k]["method"] for k in res] == ["fedavg", "fedavg", "ensemble"]
    assert (res["a"]["params"]["rounds"], res["b"]["params"]["rounds"]) == (1, 2)
    assert (tmp_path / "run" / "a" / "a.safetensors").is_file() and (tmp_path / "run" / "b").is_dir()


def test_a_preset_is_a_label_of_its_method_with_overrides_on_top():
    from hetfl.fl.method import PRESETS, create_method

    assert {"fedhydra_dense_log1p", "fedmho_md_klmean"} <= set(PRESETS)
    ours = create_method("ours", {"method": "fedhydra_dense_log1p", "epochs": 3})
    assert (ours.name, ours.method) == ("ours", "fedhydra")
    assert ours.params["u_transform"] == "log1p" and ours.params["epochs"] == 3
    assert create_method("fedhydra_dense_log1p", {}).params == {**ours.params, "epochs": ours.defaults["epochs"]}


def test_each_stage_announces_its_place_and_the_time_left(tmp_path, tiny_config, capsys):
    validated = validate(tiny_config)
    Simulator(prepare(validated), tmp_path / "run", None, quiet=False).run()
    err = capsys.readouterr()
    shown = err.out + err.err
    assert "hetfl: stage 1 of 2: fedavg (0.0 min so far)" in shown
    assert "hetfl: stage 2 of 2: ensemble (" in shown and "min left)" in shown


def test_validation_share_is_stratified_seeded_and_disjoint_from_every_client(tiny_config):
    from hetfl.data import hold_out, load_dataset

    tiny_config["validation"] = 0.25
    exp = prepare(validate(tiny_config))
    full = load_dataset("synthetic", "data", tiny_config["data"])
    again = hold_out(full, 0.25, tiny_config["seed"])
    assert torch.equal(exp.splits.val.x, again.val.x)  # same seed, same share
    assert len(exp.splits.val) + len(exp.splits.train) == len(full.train)
    assert torch.bincount(exp.splits.val.y).tolist() == [10, 10, 10, 10]  # 25 % of 40 per class
    train_rows = {tuple(r.flatten().tolist()) for r in exp.splits.train.x}
    assert not any(tuple(r.flatten().tolist()) in train_rows for r in exp.splits.val.x)
    assert sum(len(d) for d in exp.client_data) == len(exp.splits.train)  # the clients share the rest
    assert hold_out(full, 0.25, 1).val.digest() != exp.splits.val.digest()
    with pytest.raises(ValueError, match="leaves class 0"):
        hold_out(full, 0.99, 0)
    for bad in (0.5, -0.1):
        with pytest.raises(ConfigError, match=f"validation: {bad}: must be"):
            validate({**tiny_config, "validation": bad})


def test_a_validation_split_adds_the_validation_selected_accuracy_beside_the_test_selected(tmp_path, tiny_config):
    tiny_config["validation"] = 0.25
    tiny_config["methods"] = {"fedavg": {"rounds": 3}, "ensemble": {}}
    res = run(tiny_config, tmp_path / "run")["results"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    tests = [r["accuracy"] for r in rows if r["step"] >= 1]
    fedavg = res["fedavg"]
    assert fedavg["test_selected_accuracy"] == fedavg["best_accuracy"] == max([*tests, fedavg["accuracy"]])
    assert fedavg["val_selected_accuracy"] in [*tests, fedavg["accuracy"]]
    assert 0 <= fedavg["best_val_accuracy"] <= 100 and "val_accuracy" in res["ensemble"]
    plain = run({**tiny_config, "validation": 0.0}, tmp_path / "plain")["results"]["fedavg"]
    assert "val_selected_accuracy" not in plain and plain["test_selected_accuracy"] == plain["best_accuracy"]


def test_a_truncated_round_checkpoint_warns_and_the_rounds_start_over_to_the_same_end(tmp_path, tiny_config):
    tiny_config["client"]["epochs"] = 1
    tiny_config["methods"] = {"fedavg": {"rounds": 2}}
    full = run(tiny_config, tmp_path / "full")["results"]["fedavg"]
    run(tiny_config, tmp_path / "cut", keep_checkpoints=True)
    path = tmp_path / "cut" / "fedavg" / "checkpoint.safetensors"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.warns(UserWarning, match="not resumed"):
        again = run(tiny_config, tmp_path / "cut")["results"]["fedavg"]
    assert "resumed_from_round" not in again and again["accuracy"] == full["accuracy"]


def test_client_states_travel_with_the_round_checkpoint(tmp_path, tiny_config):
    tiny_config["methods"] = {"fedavg": {"rounds": 2}}
    sim = Simulator(prepare(validate(tiny_config)), tmp_path, None, quiet=True)
    from hetfl.fl.comm import CommLedger
    from hetfl.fl.method import create_method

    method = create_method("fedavg", {"rounds": 2})
    ledger = CommLedger()
    ctx = sim._context("fedavg", ledger, [])
    method.start(ctx)
    states = {0: {"prev": torch.arange(4.0), "seen": 3}, 2: {"note": "x"}}
    path = tmp_path / "ck.safetensors"
    sim._models_history["fedavg"] = {}
    sim._save_rounds(path, "fedavg", 1, method, ctx, ledger, [12.5], states, 4.0)
    restored: dict = {}
    assert sim._resume_rounds(path, "fedavg", method, ctx, ledger, restored) == 1
    assert torch.equal(restored[0]["prev"], torch.arange(4.0)) and restored[0]["seen"] == 3
    assert restored[2] == {"note": "x"} and ctx.record["seconds_before_resume"] == 4.0


SCALE = """
import json, sys, time
import torch
from hetfl.host import peak_gib
torch.set_num_threads(1)
from hetfl.data import load_dataset
from hetfl.engine.simulator import Simulator, prepare
from hetfl.methods.checks import validate
from hetfl.report import write_plots
data = {"classes": 10, "channels": 1, "size": 16, "train_per_class": 6000, "test_per_class": 20}
cfg = validate({"name": "n10k", "dataset": "synthetic", "data": data, "partition": {"kind": "iid"}, "clients": 10000,
                "client": {"model": "cnn2", "epochs": 1, "batch_size": 8, "lr": 0.05},
                "methods": {"fedavg": {"rounds": 2, "sample_ratio": 0.001}}})
splits = load_dataset("synthetic", options=data)
start = time.perf_counter()
sim = Simulator(prepare(cfg, splits=splits), sys.argv[1], None, quiet=True, resume=False)
setup = time.perf_counter() - start
summary = sim.run()
write_plots(sim.out_dir, summary)
print(json.dumps({"setup": setup, "total": time.perf_counter() - start,
                  "peak_gib": peak_gib()}))
"""


def test_ten_thousand_clients_set_up_in_seconds_and_fit_in_a_gigabyte(tmp_path):
    """Bounds are generous (a loaded 2-core machine); docs/BENCHMARKS.md has the measured figures."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SCALE, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["setup"] < 5 and got["peak_gib"] < 1.0 and got["total"] < 60, got
    assert (tmp_path / "partition.png").is_file()  # histograms, not 10,000 columns of bubbles
