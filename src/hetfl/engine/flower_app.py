"""The Flower adapter: one generic ``ServerApp`` and one generic ``ClientApp`` for every method.

Nothing here knows a method by name. The ServerApp's ``main`` runs the in-process simulator's
drivers (:class:`~hetfl.engine.simulator.Simulator`) with a :class:`FlowerTransport`, so a
one-shot method makes one exchange and then runs its server stage, and a multi-round method
makes one exchange per round with the same seeded client sampling. The ClientApp routes every
``train.hetfl`` message to the client task named in the payload (:func:`hetfl.fl.client.handle`).

Wire format: a :class:`~hetfl.fl.payload.Payload` travels as a ``RecordDict`` with its named
tensors in the ``ArrayRecord`` ``"arrays"`` and its JSON metadata in the ``ConfigRecord``
``"config"`` (key ``"meta"``), so the bytes the ledger counts are the tensors that are sent.

Each SuperNode knows only its own partition: ``--node-config "partition-id=I num-partitions=N"``
(plus an optional ``data-root``). It reads the experiment config from the run config, loads the
dataset from its own disk, recomputes the seeded partition and keeps its own share only. With the
config's ``flower.node_data``, a SuperNode started with ``--node-config "data-dir=DIR"`` serves its own
``DIR/train`` instead, labelled by the run's classes and converted to the run's shape, both of which the
server's info query sends; the server reads only the test split of ``dataset``.

Run configuration (``flwr run APP CONN --run-config FILE.toml``; values are scalars):
``hetfl-config`` (the validated experiment config as JSON), ``out-dir`` (where the ServerApp
writes ``summary.json``, as ``hetfl run`` does) and ``data-root`` (the server's dataset folder,
used for the test split only).

This module imports ``flwr``; install the extra ``hetfl[flower]``. The core package never
imports it.
"""

from __future__ import annotations

import json
import logging
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from hetfl.data import ImageDataset, hold_out, load_dataset, make_partition
from hetfl.data.user import load_node_folder
from hetfl.engine.experiment import resolve_device
from hetfl.engine.simulator import Simulator, prepare
from hetfl.fl.client import ClientEnv, handle
from hetfl.fl.payload import Payload, PayloadError
from hetfl.fl.training import counting_sample_passes
from hetfl.methods.checks import validate

log = logging.getLogger("hetfl")

TRAIN = "train.hetfl"  # run a client task, reply with its upload
INFO = "query.hetfl_info"  # which partition does this node hold?
ROUTE = "hetfl.route"  # ConfigRecord of a train message: {"state": the method label whose client state it uses}
# ConfigRecord of a train reply, beside the upload: {"seconds": the task's seconds on the node, "sample_passes":
# the samples of its training steps}; outside the payload, so the bytes counted are the upload's alone
COST = "hetfl.cost"


def _state_keys(namespace: str) -> tuple[str, str]:
    """The ``context.state`` records of one method's client state (tensors, JSON values)."""
    return f"hetfl.state.{namespace}.arrays", f"hetfl.state.{namespace}.config"


# ---- Payload <-> RecordDict ------------------------------------------------------------------
def to_record(payload: Payload, namespace: str = "", client: int | None = None) -> RecordDict:
    """``namespace``: the method label whose client state the task uses; ``client``: the addressed client id
    (a SuperNode serving its own data learns its id from it)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in payload.tensors.items()}
    records = {"arrays": ArrayRecord(torch_state_dict=tensors),
               "config": ConfigRecord({"meta": json.dumps(payload.meta)})}
    if namespace or client is not None:
        records[ROUTE] = ConfigRecord({"state": namespace or "default",
                                       **({"client": int(client)} if client is not None else {})})
    return RecordDict(records)


def from_record(content: RecordDict) -> Payload:
    """Rebuild a payload; anything that is not a well-formed hetfl record raises PayloadError."""
    try:
        arrays = content.array_records["arrays"] if "arrays" in content.array_records else ArrayRecord()
        meta = json.loads(str(content.config_records["config"]["meta"]))
        tensors = dict(arrays.to_torch_state_dict())
    except (KeyError, TypeError, ValueError) as err:
        raise PayloadError(f"not a hetfl record (ArrayRecord 'arrays' + ConfigRecord 'config.meta'): {err}") from err
    if not isinstance(meta, dict):
        raise PayloadError("payload metadata must be a JSON object")
    return Payload(tensors, meta)


def state_to_records(state: dict[str, Any], context: Context, namespace: str) -> None:
    """Keep one method's client state (tensors and JSON values) in ``context.state`` under its label."""
    arrays, config = _state_keys(namespace)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    rest = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    context.state[arrays] = ArrayRecord(torch_state_dict=tensors)
    context.state[config] = ConfigRecord({"json": json.dumps(rest)})


def state_from_records(context: Context, namespace: str) -> dict[str, Any]:
    """One method's client state (empty before its first task on this node)."""
    arrays, config = _state_keys(namespace)
    state: dict[str, Any] = {}
    if config in context.state.config_records:
        state.update(json.loads(str(context.state.config_records[config]["json"])))
    if arrays in context.state.array_records:
        state.update(context.state.array_records[arrays].to_torch_state_dict())
    return state


# ---- client side -------------------------------------------------------------------------------
def experiment_config(run_config: dict[str, Any]) -> dict[str, Any]:
    if "hetfl-config" not in run_config:
        raise ValueError("run config lacks 'hetfl-config' (the experiment config as JSON)")
    return validate(json.loads(str(run_config["hetfl-config"])))


@lru_cache(maxsize=2)
def _partitioned(cfg_json: str, data_root: str) -> tuple[ImageDataset, list]:
    """The training split and its seeded partition, once per process (a simulation's worker serves many
    virtual nodes of one run one after the other)."""
    cfg = json.loads(cfg_json)
    splits = hold_out(load_dataset(cfg["dataset"], data_root, cfg["data"]), cfg.get("validation", 0.0), cfg["seed"])
    partition = make_partition(splits.train.y.numpy(), cfg["clients"], cfg["partition"], cfg["seed"],
                               num_classes=splits.num_classes)
    return splits.train, partition.indices


def _client_data(cfg_json: str, data_root: str, partition_id: int) -> ImageDataset:
    train, indices = _partitioned(cfg_json, data_root)
    return train.subset(torch.from_numpy(indices[partition_id]))


def node_partition(context: Context, cfg: dict[str, Any]) -> int:
    """This node's partition id, checked against the experiment's number of clients."""
    nc = context.node_config
    if "partition-id" not in nc or "num-partitions" not in nc:
        raise ValueError("start the SuperNode with --node-config \"partition-id=I num-partitions=N\"")
    pid, n = int(nc["partition-id"]), int(nc["num-partitions"])
    if n != cfg["clients"] or not 0 <= pid < n:
        raise ValueError(f"node config partition-id={pid} num-partitions={n} does not fit an experiment "
                         f"with {cfg['clients']} clients")
    return pid


RUN_DATA = "hetfl.run-data"  # context.state ConfigRecord: the run's classes and shape, from the info query


@lru_cache(maxsize=2)
def _own_data(folder: str, classes: tuple[str, ...], shape: tuple[int, ...]) -> ImageDataset:
    return load_node_folder(Path(folder).expanduser(), classes, shape)


def own_data(context: Context, cfg: dict[str, Any]) -> ImageDataset | None:
    """A node started with ``--node-config "data-dir=DIR"``: its own ``DIR/train``, labelled by the run's
    classes (which the server's info query sent); None for a node that holds a partition."""
    folder = context.node_config.get("data-dir")
    if not cfg["flower"]["node_data"]:
        if folder is not None:
            raise ValueError(f"this node serves its own data (data-dir={folder}) but the run partitions "
                             "its dataset; set flower.node_data: true in the config")
        return None
    if folder is None:
        raise ValueError("this run's SuperNodes serve their own data: start the SuperNode with "
                         "--node-config \"data-dir=DIR\" (DIR/train/<class>/<image>)")
    if RUN_DATA not in context.state.config_records:
        raise ValueError("no class list from the server yet (its info query comes first)")
    run = context.state.config_records[RUN_DATA]
    return _own_data(str(folder), tuple(json.loads(str(run["classes"]))), tuple(json.loads(str(run["shape"]))))


def node_data(context: Context, client: int | None = None) -> tuple[dict[str, Any], int, ImageDataset]:
    """The experiment config, this node's client id and its training data: a partition of the dataset, or
    the node's own folder (its id: ``partition-id`` if given, else the one the server addresses)."""
    cfg = experiment_config(context.run_config)
    if (data := own_data(context, cfg)) is not None:
        pid = int(context.node_config.get("partition-id", -1 if client is None else client))
        return cfg, pid, data
    pid = node_partition(context, cfg)
    root = str(context.node_config.get("data-root", cfg["data_root"]))
    return cfg, pid, _client_data(json.dumps(cfg, sort_keys=True), root, pid)


def client_env(context: Context, namespace: str, client: int | None = None) -> ClientEnv:
    cfg, pid, data = node_data(context, client)
    return ClientEnv(pid, data, resolve_device(cfg["device"]), state_from_records(context, namespace),
                     data_root=str(context.node_config.get("data-root", cfg["data_root"])))


client_app = ClientApp()


@client_app.query("hetfl_info")
def node_info(msg: Message, context: Context) -> Message:
    run = msg.content.config_records.get("run")
    if run is not None:  # the run's classes and shape: a node serving its own data labels it by them
        context.state[RUN_DATA] = ConfigRecord({"classes": str(run["classes"]), "shape": str(run["shape"])})
    cfg, pid, data = node_data(context)
    info = {"partition-id": pid, "num-partitions": cfg["clients"], "num-samples": len(data),
            "label-counts": json.dumps(data.label_counts().tolist())}
    return Message(RecordDict({"config": ConfigRecord(info)}), reply_to=msg)


@client_app.train("hetfl")
def client_task(msg: Message, context: Context) -> Message:
    route = msg.content.config_records.get(ROUTE)
    namespace = str(route["state"]) if route is not None else "default"
    client = int(route["client"]) if route is not None and "client" in route else None
    env = client_env(context, namespace, client)
    start = time.perf_counter()
    with counting_sample_passes() as meter:
        upload = handle(from_record(msg.content), env)
    reply = to_record(upload)
    reply[COST] = ConfigRecord({"seconds": time.perf_counter() - start, "sample_passes": sum(meter.values())})
    state_to_records(env.state, context, namespace)
    return Message(reply, reply_to=msg)


def reply_cost(content: RecordDict) -> tuple[float, int] | None:
    """A train reply's :data:`COST` (the node's seconds and sample-passes); None where it has none or a
    malformed one (a node of an older hetfl): the run then records no client cost for it."""
    try:
        cost = content.config_records[COST]
        seconds, passes = float(cost["seconds"]), int(cost["sample_passes"])
    except (KeyError, TypeError, ValueError):
        return None
    return (seconds, passes) if seconds >= 0 and passes >= 0 else None


# ---- server side -------------------------------------------------------------------------------
class FlowerTransport:
    """Sends each exchange's messages to the SuperNodes holding the addressed partitions."""

    def __init__(self, grid: Grid, num_clients: int, timeout: float, node_wait: float,
                 poll: float = 0.2, classes: list[str] | None = None, shape: tuple[int, ...] | None = None) -> None:
        self.grid, self.num_clients, self.timeout, self.node_wait = grid, num_clients, timeout, node_wait
        self.poll = poll
        self.classes, self.shape = classes, shape  # sent to the nodes (those serving their own data use them)
        self.nodes: dict[int, int] = {}  # client (partition) id -> node id
        self.info: dict[int, tuple[int, list[int]]] = {}  # client id -> (sample count, label histogram)
        self.refused: dict[int, str] = {}  # node id -> why it holds no client of this run
        self.exchanges = 0
        self.costs: dict[int, tuple[float, int] | None] = {}  # the last exchange's uploads: client -> reply_cost

    def _query(self, nid: int) -> Message:
        content = RecordDict()
        if self.classes is not None and self.shape is not None:
            content["run"] = ConfigRecord({"classes": json.dumps(list(self.classes)),
                                           "shape": json.dumps(list(self.shape))})
        return Message(content, dst_node_id=nid, message_type=INFO)

    def connect(self) -> dict[int, int]:
        """Wait up to ``node_wait`` s for the SuperNodes, then ask each which partition it holds."""
        deadline = time.monotonic() + self.node_wait
        while len(ids := list(self.grid.get_node_ids())) < self.num_clients and time.monotonic() < deadline:
            time.sleep(0.5)
        log.info("hetfl: %d SuperNode(s) connected (expected %d)", len(ids), self.num_clients)
        unassigned = []  # nodes serving their own data without a partition-id: ids in node-id order
        for reply in sorted(self.send_and_receive([self._query(nid) for nid in ids]),
                            key=lambda r: r.metadata.src_node_id):
            nid = reply.metadata.src_node_id
            if reply.has_error():
                self.refused[nid] = reply.error.reason
                log.warning("hetfl: node %s refused: %s", nid, reply.error.reason)
                continue
            info = reply.content.config_records["config"]
            pid = int(info["partition-id"])
            counts = (int(info["num-samples"]), json.loads(str(info["label-counts"])))
            if pid < 0:
                unassigned.append((nid, counts))
            elif pid in self.nodes or pid >= self.num_clients:
                self.refused[nid] = f"claims client {pid}, " + (f"held by node {self.nodes[pid]}" if pid in self.nodes
                                                                 else f"beyond the run's {self.num_clients} clients")
                log.warning("hetfl: node %s %s: ignored", nid, self.refused[nid])
            else:
                self.nodes[pid], self.info[pid] = nid, counts
        free = (c for c in range(self.num_clients) if c not in self.nodes)
        for nid, counts in unassigned:
            if (pid := next(free, None)) is None:
                self.refused[nid] = f"one node more than the run's {self.num_clients} clients"
                log.warning("hetfl: node %s is %s: ignored", nid, self.refused[nid])
                continue
            self.nodes[pid], self.info[pid] = nid, counts
        return self.nodes

    def client_info(self) -> dict[str, list]:
        """Every client's sample count and label histogram, from its node's info reply (zeros for a
        partition no node holds)."""
        num_classes = len(next(iter(self.info.values()))[1]) if self.info else 0
        rows = [self.info.get(cid, (0, [0] * num_classes)) for cid in range(self.num_clients)]
        return {"num_samples": [r[0] for r in rows], "label_counts": [r[1] for r in rows]}

    def send_and_receive(self, messages: list[Message]) -> list[Message]:
        """Push ``messages``, then pull their replies every ``poll`` s until all have come or
        ``timeout`` s have passed. Flower's own ``Grid.send_and_receive`` sleeps 3 s between
        pulls, which adds 1.5 s on average to every exchange."""
        pending = set(self.grid.push_messages(messages))
        deadline = time.monotonic() + self.timeout
        replies: list[Message] = []
        while pending:
            got = list(self.grid.pull_messages(sorted(pending)))
            replies += got
            pending -= {reply.metadata.reply_to_message_id for reply in got}
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(self.poll)
        return replies

    def exchange(self, round_: int, messages: dict[int, Payload],
                 namespace: str = "") -> tuple[dict[int, Payload], dict[int, str]]:
        self.exchanges += 1
        self.costs = {}
        failures = {cid: "no SuperNode holds this partition" for cid in messages if cid not in self.nodes}
        by_node = {self.nodes[cid]: cid for cid in messages if cid in self.nodes}
        out = [Message(to_record(messages[cid], namespace, cid), dst_node_id=nid, message_type=TRAIN,
                       group_id=str(round_)) for nid, cid in by_node.items()]
        start = time.perf_counter()
        log.info("hetfl: round %d: sent %d message(s)", round_, len(out))
        uploads: dict[int, Payload] = {}
        for reply in self.send_and_receive(out):
            cid = by_node.get(reply.metadata.src_node_id)
            if cid is None:
                continue
            if reply.has_error():
                failures[cid] = f"client error: {reply.error.reason}"
                continue
            try:
                uploads[cid] = from_record(reply.content)
                self.costs[cid] = reply_cost(reply.content)
            except PayloadError as err:
                failures[cid] = f"upload rejected: {err}"
        for cid in by_node.values():
            if cid not in uploads and cid not in failures:
                failures[cid] = f"no reply within {self.timeout:g} s"
        log.info("hetfl: round %d: %d upload(s) in %.1f s, %d missing", round_, len(uploads),
                 time.perf_counter() - start, len(failures))
        return uploads, failures


def run_classes(test: ImageDataset) -> list[str]:
    """The run's class names (a node serving its own data labels its folders by them); 0..C-1 unnamed."""
    return list(test.class_names or [str(c) for c in range(test.num_classes)])


server_app = ServerApp()


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = experiment_config(context.run_config)
    out = Path(str(context.run_config.get("out-dir", f"runs/{cfg['name']}-flower")))
    root = str(context.run_config.get("data-root", "")) or cfg["data_root"]
    exp = prepare(cfg, root, partitioned=False)  # the server reads the test split only
    transport = FlowerTransport(grid, cfg["clients"], float(cfg["flower"]["timeout"]),
                                float(cfg["flower"]["node_wait"]), classes=run_classes(exp.splits.test),
                                shape=exp.splits.shape, poll=float(context.run_config.get("poll", 0.2)))
    nodes = transport.connect()
    sim = Simulator(exp, out, cache_dir=None, quiet=True, resume=False, data_root=root, transport=transport)
    sim.engine_info = {"name": "flower", "nodes": {str(k): v for k, v in sorted(nodes.items())},
                       "missing_nodes": sorted(set(range(cfg["clients"])) - set(nodes)),
                       **({"refused_nodes": {str(k): v for k, v in sorted(transport.refused.items())}}
                          if transport.refused else {})}
    if cfg["flower"]["node_data"]:  # what each node serves: its sample count and label histogram
        sim.engine_info["node_data"] = {str(c): {"node": nodes[c], "num_samples": transport.info[c][0],
                                                 "label_counts": transport.info[c][1]} for c in sorted(nodes)}
    summary = sim.run()
    for name, result in summary["results"].items():
        log.info("hetfl: %s accuracy %.2f (best %.2f)", name, result["accuracy"], result["best_accuracy"])
    log.info("hetfl: summary written to %s", out / "summary.json")


# ---- Flower's simulation runtime -----------------------------------------------------------------
def simulation_apps(run_config: dict[str, str], threads: int = 1) -> tuple[ServerApp, ClientApp]:
    """The ServerApp and ClientApp above for ``flwr.simulation.run_simulation``, which gives its apps an
    empty run config: these carry ``run_config`` (the keys of a ``flwr run`` run config) with them to the
    Ray workers and hand it over before each call. Each ClientApp call trains on ``threads`` torch threads."""
    sim_client, sim_server = ClientApp(), ServerApp()

    def _with_config(context: Context) -> Context:
        """The same node and state (the runtime keeps the state's changes) with the run config filled in
        (the runtime refuses changes to a context's own run config)."""
        return Context(run_id=context.run_id, node_id=context.node_id, node_config=context.node_config,
                       state=context.state, run_config={**context.run_config, **run_config})

    @sim_client.query("hetfl_info")
    def sim_info(msg: Message, context: Context) -> Message:
        torch.set_num_threads(threads)
        return node_info(msg, _with_config(context))

    @sim_client.train("hetfl")
    def sim_train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(threads)
        return client_task(msg, _with_config(context))

    @sim_server.main()
    def sim_main(grid: Grid, context: Context) -> None:
        server_main(grid, _with_config(context))

    return sim_server, sim_client
