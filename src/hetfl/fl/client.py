"""The client side: a registry of tasks a client can perform on a message from the server.

A method's client part is a task: ``task(message, env) -> upload``. Engines (the in-process
simulator, the Flower ``ClientApp``) only look tasks up by the ``task`` name in the message's
metadata, so they never know a method by name. :func:`handle` stamps every upload with what the
server may know about the client (id, sample count, label histogram, task). A task may have a batched
form (:func:`client_group_task`) that an engine holding several clients in one process may use for
requests of one group key (:func:`handle_group`; the simulator's ``batch_clients``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hetfl.data.base import ImageDataset
from hetfl.fl.checkpoint import TrainCheckpoint
from hetfl.fl.objectives import build_terms, objective
from hetfl.fl.payload import Payload, PayloadError, state_payload
from hetfl.fl.train_config import TrainConfig
from hetfl.fl.training import local_train, local_train_group, prepare
from hetfl.models import build_model


@dataclass
class ClientEnv:
    """What a client has locally: its id, its data, a device and state kept between rounds."""

    client_id: int
    data: ImageDataset
    device: torch.device
    state: dict[str, Any] = field(default_factory=dict)
    progress: Callable[[int, float], None] | None = None  # (epoch, loss) callback for progress bars
    # where a long local training may keep a resumable state (an engine that can key it by the request)
    checkpoint: TrainCheckpoint | None = None
    data_root: str = "data"  # the client's own dataset folder (auxiliary sets are read there)


ClientTask = Callable[[Payload, ClientEnv], Payload]
CLIENT_TASKS: dict[str, ClientTask] = {}


def client_task(name: str) -> Callable[[ClientTask], ClientTask]:
    """Register ``fn`` as the client part for messages whose ``task`` is ``name``."""

    def register(fn: ClientTask) -> ClientTask:
        if name in CLIENT_TASKS and CLIENT_TASKS[name] is not fn:
            raise ValueError(f"client task {name!r} registered twice")
        CLIENT_TASKS[name] = fn
        return fn

    return register


GroupTask = Callable[[list[Payload], list[ClientEnv]], list[Payload]]
# task -> (how a request groups with others: equal keys can train together, None = alone; the
# batched task). An engine that holds several clients in one process (the simulator) may run a group
# of equal-keyed requests through it instead of one task call per client.
CLIENT_GROUP_TASKS: dict[str, tuple[Callable[[Payload, ClientEnv], Any], GroupTask]] = {}


def client_group_task(name: str, key: Callable[[Payload, ClientEnv], Any]) -> Callable[[GroupTask], GroupTask]:
    """Register ``fn`` as the batched form of task ``name``: ``fn(messages, envs)`` returns one upload
    per client, for requests whose ``key`` values are equal (and not None)."""

    def register(fn: GroupTask) -> GroupTask:
        CLIENT_GROUP_TASKS[name] = (key, fn)
        return fn

    return register


def _stamp(upload: Payload, task: str, env: ClientEnv) -> Payload:
    upload.meta.update(
        task=task,
        client_id=env.client_id,
        num_samples=len(env.data),
        label_counts=env.data.label_counts().tolist(),
    )
    return upload


def handle(message: Payload, env: ClientEnv) -> Payload:
    """Run the task named in ``message`` on this client and return its upload."""
    task = message.meta.get("task")
    if task not in CLIENT_TASKS:
        raise PayloadError(f"unknown client task {task!r}; known: {sorted(CLIENT_TASKS)}")
    return _stamp(CLIENT_TASKS[task](message, env), task, env)


def group_key(message: Payload, env: ClientEnv) -> tuple[str, Any] | None:
    """The key under which ``message`` can train in one batch with other clients' requests (see
    :data:`CLIENT_GROUP_TASKS`), or None where its task has no batched form or this request cannot
    join one."""
    task = message.meta.get("task")
    if task not in CLIENT_GROUP_TASKS:
        return None
    key = CLIENT_GROUP_TASKS[task][0](message, env)
    return None if key is None else (task, key)


def handle_group(messages: list[Payload], envs: list[ClientEnv]) -> list[Payload]:
    """Run requests of one :func:`group_key` as one batch; the uploads carry what :func:`handle`
    stamps on them."""
    keys = {group_key(m, e) for m, e in zip(messages, envs)}
    if len(keys) != 1 or None in keys:
        raise ValueError(f"handle_group needs requests of one group key, got {keys}")
    task = messages[0].meta["task"]
    uploads = CLIENT_GROUP_TASKS[task][1](messages, envs)
    return [_stamp(u, task, e) for u, e in zip(uploads, envs)]


def model_from_message(message: Payload) -> torch.nn.Module:
    """Build the classifier a message describes; load its tensors if it carries weights (those without a
    ``name/`` prefix, or those under ``meta["weights_under"]``, e.g. a model forwarded under ``relayed/``),
    otherwise initialise from ``init_seed``."""
    m = message.meta
    torch.manual_seed(int(m["init_seed"]))
    model = build_model(m["arch"], int(m["in_channels"]), int(m["image_size"]), int(m["num_classes"]))
    prefix = m.get("weights_under")
    weights = ({k[len(prefix):]: v for k, v in message.tensors.items() if k.startswith(prefix)} if prefix
               else {k: v for k, v in message.tensors.items() if "/" not in k})  # "name/...": other models sent
    if weights:
        model.load_state_dict(weights)
    return model


def train_message(arch: str, shape: tuple[int, int, int], num_classes: int, cfg: TrainConfig,
                  init_seed: int, seed: int, weights: dict[str, torch.Tensor] | None = None,
                  task: str = "train_classifier", **extra: Any) -> Payload:
    """A request to train a classifier locally (from ``weights`` if given, else from scratch)."""
    meta = dict(arch=arch, in_channels=shape[0], image_size=shape[1], num_classes=num_classes,
                init_seed=init_seed, seed=seed, train=cfg.to_dict(), **extra)
    meta["task"] = task
    return Payload(dict(weights or {}), meta)


@client_task("train_classifier")
def train_classifier(message: Payload, env: ClientEnv) -> Payload:
    """Local SGD on the client's data, cross-entropy plus the request's named loss terms
    (:mod:`hetfl.fl.objectives`); upload the full model state."""
    cfg = TrainConfig(**message.meta["train"])
    # the training layout before the terms copy the model: their frozen models then run in it too
    model = prepare(model_from_message(message), env.device, cfg.channels_last)
    terms = build_terms(message.meta.get("terms") or {}, model,
                        {k: v.to(env.device) for k, v in message.tensors.items() if "/" in k}, env.state,
                        {"num_samples": len(env.data), "batch_size": cfg.batch_size, "epochs": cfg.epochs,
                         "label_counts": env.data.label_counts().tolist(),
                         "shape": (int(message.meta["in_channels"]), int(message.meta["image_size"]),
                                   int(message.meta["image_size"])),
                         "channels_last": cfg.channels_last, "seed": derive_term_seed(int(message.meta["seed"]))})
    loss = objective(terms)
    stats = local_train(model, env.data, cfg, env.device, seed=int(message.meta["seed"]), progress=env.progress,
                        checkpoint=env.checkpoint, **({"loss_fn": loss} if loss else {}))
    for term in terms:
        term.after(model, env.state)
    return state_payload(model.cpu(), arch=message.meta["arch"], train_loss=stats["loss"])


def derive_term_seed(seed: int) -> int:
    """The seed of a loss term's own random stream (generated labels and noise), apart from the batch order."""
    return (seed * 1_000_003 + 7) & 0x7FFFFFFF


def _train_group_key(message: Payload, env: ClientEnv) -> tuple[Any, ...] | None:
    """From scratch only (a request with weights is a multi-round step: trained alone), one model
    description and one training config; any data sizes (:func:`local_train_group` steps each client
    through its own batches)."""
    m = message.meta
    if message.tensors or m.get("terms") or len(env.data) == 0:
        return None
    return (m["arch"], m["in_channels"], m["image_size"], m["num_classes"], tuple(sorted(m["train"].items())))


@client_group_task("train_classifier", key=_train_group_key)
def train_classifier_group(messages: list[Payload], envs: list[ClientEnv]) -> list[Payload]:
    """:func:`train_classifier` of several clients as one vectorised network
    (:func:`hetfl.fl.training.local_train_group`)."""
    models = [model_from_message(m) for m in messages]
    cfg = TrainConfig(**messages[0].meta["train"])
    stats = local_train_group(models, [e.data for e in envs], cfg, envs[0].device,
                              seeds=[int(m.meta["seed"]) for m in messages], progress=envs[0].progress)
    return [state_payload(model.cpu(), arch=m.meta["arch"], train_loss=s["loss"])
            for model, m, s in zip(models, messages, stats)]
