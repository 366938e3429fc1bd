"""The Flower adapter: wire format, a fake Grid (no processes), and real SuperLink/SuperNodes on
127.0.0.1 (insecure, TLS, node authentication, a SuperNode killed mid-run)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
import yaml
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from hetfl.cli import main
from hetfl.engine import flower_app as fa
from hetfl.engine.flower_local import LocalFederation, live_processes_with_home, run_local
from hetfl.engine.simulator import Simulator, prepare
from hetfl.fl.payload import Payload, PayloadError
from hetfl.methods.checks import validate

BASE = {
    "name": "flower-test", "seed": 0, "dataset": "synthetic",
    "data": {"classes": 4, "channels": 1, "size": 28, "train_per_class": 24, "test_per_class": 20},
    "partition": {"kind": "iid"}, "clients": 3,
    "client": {"model": "cnn2", "epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
    "methods": {"fedavg": {}}, "flower": {"timeout": 60, "node_wait": 60},
}


def config(**changes: object) -> dict:
    cfg = copy.deepcopy(BASE)
    cfg.update(changes)
    return validate(cfg)


def simulate(cfg: dict, out: Path) -> dict:
    return Simulator(prepare(cfg), out, cache_dir=None, quiet=True, resume=False).run()


def assert_same_results(flower: dict, sim: dict) -> None:
    assert set(flower["results"]) == set(sim["results"])
    for name, ours in flower["results"].items():
        ref = sim["results"][name]
        assert ours["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-6), name
        assert ours["bytes_up"] == ref["bytes_up"] and ours["bytes_down"] == ref["bytes_down"], name
        # the nodes report their cost beside the upload: the same sample-passes, seconds of their own
        assert ours.get("client_sample_passes") == ref.get("client_sample_passes"), name
        assert ("client_seconds" in ours) == ("client_seconds" in ref), name


# ---- wire format --------------------------------------------------------------------------------
def test_payload_record_roundtrip_keeps_names_dtypes_and_meta() -> None:
    p = Payload({"w": torch.randn(3, 4), "n": torch.arange(5), "x8": torch.randint(0, 255, (2, 2), dtype=torch.uint8)},
                {"task": "train_classifier", "list": [1, 2], "nested": {"a": 0.5}})
    q = fa.from_record(fa.to_record(p))
    assert q.meta == p.meta
    kinds = {k: (v.dtype, v.shape) for k, v in p.tensors.items()}
    assert {k: (v.dtype, v.shape) for k, v in q.tensors.items()} == kinds
    assert all(torch.equal(p.tensors[k], q.tensors[k]) for k in p.tensors)
    assert fa.from_record(fa.to_record(Payload({}, {"z": 1}))).meta == {"z": 1}


def test_garbage_record_is_a_payload_error() -> None:
    with pytest.raises(PayloadError, match="not a hetfl record"):
        fa.from_record(RecordDict())


# ---- a fake Grid: the real ClientApp and ServerApp functions, no processes --------------------
class FakeGrid(Grid):
    """Delivers each message by calling the ClientApp in-process; ``tamper(node, message, reply)``
    may rewrite or drop (return None) a training reply."""

    def __init__(self, cfg: dict, tamper: Callable[[int, Message], Message | None] | None = None) -> None:
        self.run_config = {"hetfl-config": json.dumps(cfg)}
        self.contexts = {100 + i: Context(run_id=1, node_id=100 + i, state=RecordDict(), run_config=self.run_config,
                                          node_config={"partition-id": i, "num-partitions": cfg["clients"]})
                         for i in range(cfg["clients"])}
        self.tamper = tamper
        self.replies: dict[str, Message] = {}
        self.pulls = 0

    def set_run(self, run_id: int) -> None: ...

    @property
    def run(self):  # noqa: ANN201
        return None

    def create_message(self, *args, **kw):  # noqa: ANN002, ANN003, ANN201
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def get_nodes(self):  # noqa: ANN201
        return []

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Runs each ClientApp at once; its reply waits for ``pull_messages``. Message ids are
        assigned as the SuperLink does (the message's object id)."""
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id
            ids.append(msg.metadata.message_id)
            for reply in self.send_and_receive([msg]):
                self.replies[msg.metadata.message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self.pulls += 1
        return [self.replies.pop(i) for i in message_ids if i in self.replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for msg in messages:
            nid = msg.metadata.dst_node_id
            TaskIdentity.node_id = nid
            try:
                reply = fa.client_app(msg, self.contexts[nid])
            except Exception as err:  # as Flower does: a raising ClientApp becomes an error reply
                reply = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=msg)
            finally:
                TaskIdentity.node_id = 0
            if self.tamper is not None and msg.metadata.message_type == fa.TRAIN:
                reply = self.tamper(nid, msg, reply)
            if reply is not None:
                replies.append(reply)
        return replies


@pytest.fixture()
def task_identity():
    old = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = old


def serve(cfg: dict, out: Path, tamper: Callable | None = None) -> dict:
    grid = FakeGrid(cfg, tamper)
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                  run_config={"hetfl-config": json.dumps(cfg), "out-dir": str(out), "data-root": "data"})
    fa.server_main(grid, ctx)
    return json.loads((out / "summary.json").read_text())


def test_a_supernodes_partition_leaves_out_the_validation_share_as_the_simulator_does() -> None:
    cfg = config(validation=0.25)
    exp = prepare(cfg)
    for pid in range(cfg["clients"]):
        data = fa._client_data(json.dumps(cfg, sort_keys=True), "data", pid)
        assert torch.equal(data.x, exp.client_data[pid].x) and torch.equal(data.y, exp.client_data[pid].y)
    held = {tuple(r.flatten().tolist()) for r in exp.splits.val.x}
    assert not any(tuple(r.flatten().tolist()) in held for d in exp.client_data for r in d.x)


def test_node_state_survives_in_context_state() -> None:
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    assert fa.state_from_records(ctx, "moon") == {}
    fa.state_to_records({"prev": torch.arange(6.0).view(2, 3), "round": 3, "tag": "x"}, ctx, "moon")
    fa.state_to_records({"other": 1}, ctx, "moon-b")
    state = fa.state_from_records(ctx, "moon")
    assert torch.equal(state.pop("prev"), torch.arange(6.0).view(2, 3)) and state == {"round": 3, "tag": "x"}
    assert fa.state_from_records(ctx, "moon-b") == {"other": 1}  # one method never sees another's state


def test_fake_grid_equals_simulator_one_shot_and_rounds(tmp_path: Path, task_identity: None) -> None:
    cfg = config(methods={"ensemble": {}, "fedavg": {}, "dense": {"epochs": 2, "generator_steps": 2, "batch_size": 16}},
                 client={**BASE["client"], "model": ["cnn2", "lenet5"]}, server={"model": "cnn2"})
    sent: list[int] = []
    flower = serve(cfg, tmp_path / "fl", lambda nid, msg, reply: sent.append(nid) or reply)
    assert sorted(sent) == [100, 101, 102]  # the one-shot methods share one client round
    assert_same_results(flower, simulate(cfg, tmp_path / "sim"))
    rounds = config(methods={"fedavg": {"rounds": 2, "sample_ratio": 0.67}})
    flower = serve(rounds, tmp_path / "fl2")
    assert flower["engine"]["name"] == "flower"
    assert_same_results(flower, simulate(rounds, tmp_path / "sim2"))
    assert flower["results"]["fedavg"]["client_sample_passes"] > 0


def test_a_reply_without_its_cost_leaves_the_client_cost_unrecorded(tmp_path: Path, task_identity: None) -> None:
    def older_node(nid: int, msg: Message, reply: Message) -> Message:  # a node of a hetfl before hetfl.cost
        return Message(fa.to_record(fa.from_record(reply.content)), reply_to=msg) if nid == 101 else reply

    result = serve(config(methods={"fedavg": {"rounds": 2}}), tmp_path / "fl", older_node)["results"]["fedavg"]
    assert result["client_sample_passes"] is None and "missing_clients" not in result
    assert fa.reply_cost(RecordDict({fa.COST: ConfigRecord({"seconds": 1.5, "sample_passes": 40})})) == (1.5, 40)
    assert fa.reply_cost(RecordDict({fa.COST: ConfigRecord({"seconds": -1.0, "sample_passes": 40})})) is None


def test_fake_grid_keeps_each_methods_client_state_apart_and_moon_equals_the_simulator(
        tmp_path: Path, task_identity: None) -> None:
    from tests.probes import ProbeState  # noqa: F401  (registers probe_state)

    cfg = config(methods={"a": {"method": "probe_state"}, "b": {"method": "probe_state"},
                          "moon": {"rounds": 3, "sample_ratio": 0.67}, "moon-b": {"method": "moon", "rounds": 2}},
                 client={**BASE["client"], "model": "simplecnn"}, server={"model": "simplecnn"})
    flower = serve(cfg, tmp_path / "fl")
    for name, result in flower["results"].items():  # a probe's client raises on another method's state
        assert "client_failures" not in result, (name, result.get("client_failures"))
    sim = simulate(cfg, tmp_path / "sim")
    assert_same_results(flower, sim)
    for name in ("a", "moon"):  # client_info answers are counted alike; the models' tensor bytes too
        assert flower["results"][name]["tensor_bytes"] == sim["results"][name]["tensor_bytes"]


def test_fake_grid_kdia_and_its_baselines_equal_the_simulator(tmp_path: Path, task_identity: None) -> None:
    cfg = config(methods={"kdia": {"rounds": 3, "sample_ratio": 0.67, "gen_epochs": 1, "gen_batches": 3,
                                   "gen_batch_size": 16},
                          "fedgkd": {"rounds": 3, "sample_ratio": 0.67},
                          "fedgen": {"rounds": 3, "sample_ratio": 0.67, "gen_steps": 3},
                          "fedcog": {"rounds": 3, "sample_ratio": 0.67, "start_round": 2, "g_steps": 3, "g_size": 16}},
                 client={**BASE["client"], "model": "simplecnn"}, server={"model": "simplecnn"})
    flower, sim = serve(cfg, tmp_path / "fl"), simulate(cfg, tmp_path / "sim")
    assert_same_results(flower, sim)
    for name in ("kdia", "fedgkd", "fedgen", "fedcog"):
        assert flower["results"][name]["tensor_bytes"] == sim["results"][name]["tensor_bytes"]
    assert flower["results"]["kdia"]["models"] == pytest.approx(sim["results"]["kdia"]["models"], abs=1e-6)


def test_fake_grid_hfldd_and_fedseq_book_the_same_bytes_as_the_simulator(tmp_path: Path,
                                                                          task_identity: None) -> None:
    fast = {"rounds": 2, "aux_size": 20, "pretrain_epochs": 1, "distilled_size": 4, "kip_steps": 2,
            "head_epochs": 1, "clusters": 2}
    cfg = config(methods={"hfldd": fast, "fedseq": {"rounds": 2, "clusters": 2}}, clients=4,
                 partition={"kind": "classes", "per_client": 1})
    flower, sim = serve(cfg, tmp_path / "fl"), simulate(cfg, tmp_path / "sim")
    assert_same_results(flower, sim)
    for name in ("hfldd", "fedseq"):
        assert flower["results"][name]["tensor_bytes"] == sim["results"][name]["tensor_bytes"]
        assert flower["results"][name]["bytes_peer"] == sim["results"][name]["bytes_peer"] > 0


def _corrupt(kind: str) -> Callable[[Payload], Payload]:
    def nan(p: Payload) -> Payload:
        name = next(k for k, v in p.tensors.items() if v.is_floating_point())
        p.tensors[name] = torch.full_like(p.tensors[name], float("nan"))
        return p

    def shape(p: Payload) -> Payload:
        name = next(iter(p.tensors))
        p.tensors[name] = torch.zeros(7)
        return p

    def arch(p: Payload) -> Payload:
        p.meta["arch"] = "lenet5"
        return p

    return {"nan": nan, "shape": shape, "arch": arch}[kind]


@pytest.mark.parametrize(("kind", "reason"), [("nan", "NaN or inf"), ("shape", "has shape"),
                                              ("arch", "architecture 'lenet5'"), ("garbage", "not a hetfl record")])
def test_malformed_upload_is_rejected_with_reason_and_run_completes(tmp_path: Path, task_identity: None,
                                                                    kind: str, reason: str) -> None:
    def tamper(nid: int, msg: Message, reply: Message) -> Message:
        if nid != 101:
            return reply
        if kind == "garbage":
            return Message(RecordDict(), reply_to=msg)
        return Message(fa.to_record(_corrupt(kind)(fa.from_record(reply.content))), reply_to=msg)

    summary = serve(config(methods={"fedavg": {}}), tmp_path / "fl", tamper)
    result = summary["results"]["fedavg"]
    assert result["missing_clients"] == [1]
    [failure] = result["client_failures"]
    assert failure["client"] == 1 and reason in failure["reason"]
    assert 0 <= result["accuracy"] <= 100


def test_error_reply_and_silence_are_missing_clients_and_rounds_skip_them(tmp_path: Path, task_identity: None) -> None:
    def tamper(nid: int, msg: Message, reply: Message) -> Message | None:
        round_ = int(msg.metadata.group_id)
        if nid == 102 and round_ == 1:
            return Message(Error(code=1, reason="out of memory"), reply_to=msg)
        if nid == 100 and round_ == 2:
            return None  # never answers
        return reply

    start = time.monotonic()
    summary = serve(config(methods={"fedavg": {"rounds": 2}}, flower={"timeout": 1, "node_wait": 1}),
                    tmp_path / "fl", tamper)
    assert time.monotonic() - start >= 1  # the silent node is waited for, up to the timeout
    failures = summary["results"]["fedavg"]["client_failures"]
    assert [(f["round"], f["client"]) for f in failures] == [(1, 2), (2, 0)]
    assert "out of memory" in failures[0]["reason"] and "no reply" in failures[1]["reason"]


def test_too_few_uploads_fail_with_min_clients(tmp_path: Path, task_identity: None) -> None:
    with pytest.raises(RuntimeError, match="min_clients = 3"):
        serve(config(min_clients=3, flower={"timeout": 1, "node_wait": 1}), tmp_path / "fl",
              lambda nid, msg, reply: None if nid == 100 else reply)


def test_transport_pulls_until_every_reply_has_come(task_identity: None) -> None:
    class SlowGrid(FakeGrid):  # replies show up only from the third pull on
        def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
            self.pulls += 1
            return [self.replies.pop(i) for i in message_ids if i in self.replies] if self.pulls >= 3 else []

    grid = SlowGrid(config())
    transport = fa.FlowerTransport(grid, 3, timeout=30, node_wait=1, poll=0.01)
    assert transport.connect() == {0: 100, 1: 101, 2: 102} and grid.pulls == 3


def test_node_with_wrong_partition_count_is_refused(tmp_path: Path, task_identity: None) -> None:
    grid = FakeGrid(config())
    grid.contexts[102].node_config["num-partitions"] = 5
    transport = fa.FlowerTransport(grid, 3, timeout=5, node_wait=1)
    assert transport.connect() == {0: 100, 1: 101}


# ---- real SuperLink and SuperNodes on 127.0.0.1 ---------------------------------------------
@pytest.mark.slow
def test_tls_with_node_authentication_refuses_an_unregistered_node(tmp_path: Path) -> None:
    """Everything over TLS, registered node keys; an intruder with an unregistered key is turned
    away while two sampled rounds of FedAvg and of MOON (its client state in the SuperNodes' context)
    complete, equal the simulator and leave no process.
    (One federation covers all of it: each one costs about a minute of process start-ups on 2 cores.
    The insecure transport runs in the killed-SuperNode and Ctrl-C tests; two methods' client states kept
    apart and a generator stage, DENSE, are checked against the simulator through the fake Grid, and MOON's
    state on Flower's simulation runtime in tests/test_ray.py.)"""
    cfg = config(methods={"fedavg": {"rounds": 2, "sample_ratio": 0.67}, "moon": {"rounds": 2, "sample_ratio": 0.67}},
                 client={**BASE["client"], "model": "simplecnn"}, server={"model": "simplecnn"})
    feds: list[LocalFederation] = []

    def intrude(fed: LocalFederation, run_id: int) -> None:
        feds.append(fed)
        intruder = fed.start_supernode(0, name="intruder", register=False,
                                       extra=["--max-retries", "1", "--max-wait-time", "10"])
        assert intruder.wait(timeout=60) != 0
        assert "Failed to activate SuperNode" in fed.tail("intruder", 50)
        nodes = json.loads(fed.flwr("supernode", "list", "hetfl", "--format", "json").stdout)["nodes"]
        assert len(nodes) == 3

    summary = run_local(cfg, tmp_path / "fl", auth=True, log=lambda line: None, on_started=intrude)
    engine = summary["engine"]
    assert engine["status"] == "finished:completed" and engine["tls"] is True and engine["auth"] is True
    assert sorted(engine["nodes"]) == ["0", "1", "2"]
    assert_same_results(summary, simulate(cfg, tmp_path / "sim"))
    assert feds[0].alive() == [] and not feds[0].home.exists()


@pytest.mark.slow
def test_killed_supernode_is_recorded_missing_and_one_shot_run_finishes(tmp_path: Path) -> None:
    cfg = config(methods={"ensemble": {}}, flower={"timeout": 40, "node_wait": 60})
    connected = threading.Event()

    def log(line: str) -> None:
        if "round 0: sent" in line:
            connected.set()

    feds: list[LocalFederation] = []

    def kill_one(fed: LocalFederation, run_id: int) -> None:
        feds.append(fed)
        assert connected.wait(timeout=120)
        time.sleep(0.5)
        fed.kill("supernode-2")

    summary = run_local(cfg, tmp_path / "fl", log=log, on_started=kill_one)
    assert summary["engine"]["status"] == "finished:completed" and summary["engine"]["tls"] is False
    result = summary["results"]["ensemble"]
    assert result["missing_clients"] == [2]
    assert "no reply" in result["client_failures"][0]["reason"]
    assert feds[0].alive() == [] and not feds[0].home.exists()  # insecure mode leaves no process either


# ---- CLI ------------------------------------------------------------------------------------------
def test_core_package_does_not_import_flwr_or_ray() -> None:
    code = ("import sys, hetfl, hetfl.cli, hetfl.methods, hetfl.engine.simulator, hetfl.reproduce.runner, "
            "hetfl.reproduce.ray_grid, hetfl.engine.flower_sim; "
            "sys.exit(int(any(m.split('.')[0] in ('flwr', 'ray') for m in sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_certs_and_node_keys_are_valid(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    assert main(["flower", "certs", "--host", "10.0.0.5", "--host", "fl.example.org", "--out", str(tmp_path)]) == 0
    cert = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert san.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    assert main(["flower", "key", str(tmp_path / "keys" / "node-0")]) == 0
    private = load_ssh_private_key((tmp_path / "keys" / "node-0").read_bytes(), None)
    public = load_ssh_public_key((tmp_path / "keys" / "node-0.pub").read_bytes())
    assert private.curve.name == "secp384r1" and public.public_numbers() == private.public_key().public_numbers()


def test_flower_local_refuses_simulator_only_methods_before_any_process_and_takes_clients(tmp_path: Path, capsys,
                                                                                          monkeypatch) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "methods": {"fedavg": {}, "central": {}}}))
    homes = set(Path(tempfile.gettempdir()).glob("hetfl-flower-*"))
    assert main(["flower", "local", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert "methods ['central'] read the clients' raw data on the server" in capsys.readouterr().err
    assert set(Path(tempfile.gettempdir()).glob("hetfl-flower-*")) == homes  # nothing started
    seen = {}
    monkeypatch.setattr("hetfl.engine.flower_local.run_local",
                        lambda cfg, out, **kw: seen.update(cfg) or {"results": {}})
    monkeypatch.setattr("hetfl.report.write_plots", lambda out, summary: [])
    monkeypatch.setattr("hetfl.report.results_table", lambda results: "")
    assert main(["flower", "local", str(cfg), "--clients", "5", "--methods", "fedavg", "--out", str(tmp_path)]) == 0
    assert seen["clients"] == 5 and list(seen["methods"]) == ["fedavg"]


def test_a_federation_folder_whose_owner_is_gone_is_removed(tmp_path: Path) -> None:
    from hetfl.engine.flower_local import HOME_PREFIX, OWNER, clean_stale_homes

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, live = tmp_path / f"{HOME_PREFIX}a", tmp_path / f"{HOME_PREFIX}b"
    for home, pid in ((stale, dead.stdout.strip()), (live, str(os.getpid()))):
        (home / "certificates").mkdir(parents=True)
        (home / OWNER).write_text(pid)
    assert clean_stale_homes(tmp_path) == [stale]
    assert not stale.exists() and live.exists()


README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_the_readmes_flower_example_runs_as_written(tmp_path: Path, capsys) -> None:
    line = next(x for x in README.read_text().splitlines() if "hetfl flower local configs/" in x)
    command = line.split("`")[1].split()
    assert command[0] == ".venv/bin/hetfl"
    os.chdir(README.parent)
    assert main([*command[1:], "--out", str(tmp_path / "o")]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["engine"]["status"] == "finished:completed" and summary["engine"]["tls"] is True
    assert set(summary["results"]) == {"fedavg", "ensemble"}
    shown = capsys.readouterr().out
    assert "hetfl: round 0: sent" in shown and "HTTP Request" not in shown  # hetfl's progress, not Flower's
    assert "hetfl: round 0: sent" in (tmp_path / "o" / "flower.log").read_text()  # every line kept there


def start_flower_local(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    """``hetfl flower local`` of a slow config in a subprocess, once its run is submitted; and its FLWR_HOME."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "client": {**BASE["client"], "epochs": 50}}))
    proc = subprocess.Popen([sys.executable, "-m", "hetfl.cli", "flower", "local", str(cfg), *flags, "--out",
                             str(tmp_path / "o")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    home = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if "FLWR_HOME" in line:
            home = Path(line.rsplit("FLWR_HOME", 1)[1].strip())
        if "submitted" in line:
            break
    assert home is not None
    return proc, home


@pytest.mark.slow
def test_kill_9_of_flower_local_leaves_no_process_and_no_keys(tmp_path: Path) -> None:
    proc, home = start_flower_local(tmp_path, "--tls")
    assert (home / "certificates").is_dir()
    time.sleep(2)
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while (live_processes_with_home(home) or home.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_processes_with_home(home) == [] and not home.exists()


@pytest.mark.slow
def test_flower_local_cli_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    proc, home = start_flower_local(tmp_path)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    assert live_processes_with_home(home) == []
    assert not home.exists()
