"""The client side: a registry of tasks a client can perform on a message from the server.

A method's client part is a task: ``task(message, env) -> upload``. Engines (the in-process
simulator, the Flower ``ClientApp``) only look tasks up by the ``task`` name in the message's
metadata, so they never know a method by name. :func:`handle` stamps every upload with what the
server may know about the client (id, sample count, label histogram, task).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hetfl.data.base import ImageDataset
from hetfl.fl.payload import Payload, PayloadError, state_payload
from hetfl.fl.training import TrainConfig, local_train
from hetfl.models import build_model


@dataclass
class ClientEnv:
    """What a client has locally: its id, its data, a device and state kept between rounds."""

    client_id: int
    data: ImageDataset
    device: torch.device
    state: dict[str, Any] = field(default_factory=dict)
    progress: Callable[[int, float], None] | None = None  # (epoch, loss) callback for progress bars


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


def handle(message: Payload, env: ClientEnv) -> Payload:
    """Run the task named in ``message`` on this client and return its upload."""
    task = message.meta.get("task")
    if task not in CLIENT_TASKS:
        raise PayloadError(f"unknown client task {task!r}; known: {sorted(CLIENT_TASKS)}")
    upload = CLIENT_TASKS[task](message, env)
    upload.meta.update(
        task=task,
        client_id=env.client_id,
        num_samples=len(env.data),
        label_counts=env.data.label_counts().tolist(),
    )
    return upload


def model_from_message(message: Payload) -> torch.nn.Module:
    """Build the classifier a message describes; load its tensors if it carries weights,
    otherwise initialise from ``init_seed``."""
    m = message.meta
    torch.manual_seed(int(m["init_seed"]))
    model = build_model(m["arch"], int(m["in_channels"]), int(m["image_size"]), int(m["num_classes"]))
    if message.tensors:
        model.load_state_dict(message.tensors)
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
    """Plain local SGD on the client's data; upload the full model state."""
    model = model_from_message(message)
    cfg = TrainConfig(**message.meta["train"])
    stats = local_train(model, env.data, cfg, env.device, seed=int(message.meta["seed"]), progress=env.progress)
    return state_payload(model.cpu(), arch=message.meta["arch"], train_loss=stats["loss"])
