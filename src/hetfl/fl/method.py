"""The contract between a method and an engine: the method drives, the engine lends.

A method is a server part plus client tasks (see :mod:`hetfl.fl.client`). An engine calls
``method.run(ctx)`` and nothing else; the :class:`ServerContext` lends shapes, device, output
folder, ``exchange`` (messages to clients, accepted uploads back, bytes counted), evaluation,
validation, logging, progress bars, ``client_info`` and the round driver (resume, evaluate every
model, checkpoint). Two templates:

* :class:`OneShotMethod`: one exchange (every client, through the upload cache), then
  :meth:`OneShotMethod.server`, which returns the named global model(s).
* :class:`RoundMethod`: :meth:`RoundMethod.setup`, then per round: sample -> ``configure_round``
  -> exchange -> record in the :class:`~hetfl.fl.clientbook.ClientBook` -> ``aggregate`` (server
  randomness seeded by (seed, method, round)) -> the engine evaluates and checkpoints. A method may
  override :meth:`RoundMethod.run_round` (several exchanges) or :meth:`RoundMethod.run` (stages
  before the loop).
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from hetfl.data.base import ImageDataset
from hetfl.fl.client import train_message
from hetfl.fl.clientbook import DEFAULT_MEMORY_LIMIT, SPILL_DIR, ClientBook
from hetfl.fl.params import ParamError, check
from hetfl.fl.payload import Payload, PayloadError
from hetfl.fl.train_config import TrainConfig
from hetfl.models import build_model, is_factory, missing_attributes, model_names

log = logging.getLogger("hetfl")


def _no_engine(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("this server context has no engine behind it")


def derive_seed(*parts: Any) -> int:
    """A stable 31-bit seed from any printable parts (run seed, purpose, client id, ...)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") & 0x7FFFFFFF


@dataclass
class ServerContext:
    """Everything the engine lends to a method's server part."""

    seed: int
    num_classes: int
    shape: tuple[int, int, int]
    num_clients: int
    client_archs: list[str]
    server_arch: str
    train_cfg: TrainConfig
    device: torch.device
    out_dir: Path
    evaluate: Callable[[nn.Module], dict[str, Any]]
    log: Callable[..., None]
    progress: Callable[..., Any]
    pooled_train_data: Callable[[], ImageDataset]
    dataset: str = ""
    data_root: Path = Path("data")
    resume: bool = True
    trim_log: Callable[[int], None] = lambda step: None  # drop logged rows after ``step`` (on resume)
    # on resume: the accuracies evaluated before the checkpoint, so best-over-epochs covers every epoch
    restore_history: Callable[[list[float]], None] = lambda accuracies: None
    # accuracy on the validation split (a share of the training split held out before partitioning),
    # None without one; ``evaluate`` also records it for every tracked evaluation
    validate: Callable[[nn.Module], dict[str, Any] | None] = lambda model: None
    record: dict[str, Any] = field(default_factory=dict)
    # exchange(step, {client: message}, relay=None) -> (accepted uploads, {client: why left out});
    # relay {sender: receiver}: those uploads are data for another client, which the method forwards
    # under ``relayed/`` in the receiver's next message (counted once, as the sender's ``peer`` upload);
    # cacheable=True (a round method's stage whose answers depend on the request and the client's data
    # alone, no client state): answered from the upload cache where another run asked the same
    exchange: Callable[..., tuple[dict[int, Payload], dict[int, str]]] = field(default=_no_engine)
    # every client's sample count and label histogram: {"num_samples": [N], "label_counts": [N x C]}
    client_info: Callable[[], dict[str, list]] = field(default=_no_engine)
    # the round driver: the rounds left (after a resume), and after each round evaluate and checkpoint
    rounds: Callable[[RoundMethod], Iterable[int]] = field(default=_no_engine)
    end_round: Callable[[int, RoundMethod], None] = field(default=_no_engine)

    def build(self, arch: str, purpose: str = "global") -> nn.Module:
        """A freshly initialised model, seeded by (run seed, purpose, arch)."""
        torch.manual_seed(derive_seed(self.seed, purpose, arch))
        return build_model(arch, self.shape[0], self.shape[1], self.num_classes).to(self.device)

    def add_prior_seconds(self, seconds: float) -> None:
        """Count work a resumed stage did before its checkpoint (``seconds_before_resume``): the
        simulator adds it to the method's ``seconds`` and ``server_seconds``. Nothing to add (0: a
        fresh start, or a file written before its seconds were kept) leaves the record as it is."""
        if seconds <= 0:
            return
        self.record["seconds_before_resume"] = self.record.get("seconds_before_resume", 0.0) + seconds

    def init_seed(self, arch: str) -> int:
        """The shared initial seed of every client of one architecture (as in DENSE's
        pre-training, all clients of an architecture start from the same weights)."""
        return derive_seed(self.seed, "client-init", arch)


class Method(ABC):
    """Common part: a name, documented defaults and validated parameters."""

    name: ClassVar[str]
    defaults: ClassVar[dict[str, Any]] = {}  # every key with its default: the default's type is the key's type
    # ranges and choices of keys beyond hetfl.fl.params.COMMON_RANGES, e.g. {"r_th": {"gt": 0, "le": 1}}
    ranges: ClassVar[dict[str, dict[str, Any]]] = {}
    # attributes the method calls on its models beyond forward (KDIA: extract, classify, feature_shape);
    # :meth:`check_models` checks every model of the run for them before any training
    model_needs: ClassVar[tuple[str, ...]] = ()
    # what a reader of a results table must know when this method ends at chance (a known failure of the
    # method as its paper writes it, and where it is measured); tables mark such a row
    caveat: ClassVar[str] = ""

    def __init__(self, params: dict[str, Any] | None = None, label: str | None = None) -> None:
        params = dict(params or {})
        self.method = type(self).name  # the registered method
        self.name = label or self.method  # the config's label: names outputs and seeds the method's streams
        overrides = params.pop("client", {}) or {}
        if not isinstance(overrides, dict):
            raise ParamError("client", f"{overrides!r}: must be a mapping of local training keys")
        TrainConfig.checked(overrides, where="client")  # types and ranges of the keys given
        self.client_overrides: dict[str, Any] = dict(overrides)
        self.params = check(self.method, self.defaults, params, self.ranges)

    def check_models(self, ctx: ServerContext) -> None:
        """ValueError naming the first model of the run (client or server) that lacks one of
        :attr:`model_needs`, and the base class that has them; engines call it before :meth:`check`."""
        if not self.model_needs:
            return
        for arch in sorted({*ctx.client_archs, ctx.server_arch}):
            with torch.random.fork_rng(devices=[]):
                model = build_model(arch, ctx.shape[0], ctx.shape[1], ctx.num_classes)
            if missing := missing_attributes(model, self.model_needs):
                raise ValueError(f"{self.method} needs models with {', '.join(self.model_needs)}; the model "
                                 f"{arch!r} ({type(model).__name__}) lacks {', '.join(missing)}: subclass "
                                 "hetfl.models.HetflModel (forward = classify(extract(x)))")

    def check(self, ctx: ServerContext) -> None:
        """Raise ValueError if this method cannot run on this setting (called by engines for every
        method before any training, so a bad combination fails early). Default: any setting."""
        return None

    def validate_upload(self, client_id: int, message: Payload, upload: Payload, ctx: ServerContext) -> None:
        """Raise :class:`PayloadError` unless ``upload`` answers ``message`` from ``client_id``.

        Engines call this on every upload before the server part sees it, and drop (and log) the
        uploads it rejects. Default: the task and client id match the request, values are finite,
        and a classifier upload has the requested architecture with its exact tensor names and
        shapes. Methods whose uploads are not classifiers may override it."""
        if upload.meta.get("task") != message.meta.get("task"):
            raise PayloadError(f"task {upload.meta.get('task')!r} answers a {message.meta.get('task')!r} request")
        if upload.meta.get("client_id") != client_id:
            raise PayloadError(f"upload claims client {upload.meta.get('client_id')!r}, expected {client_id}")
        arch = message.meta.get("arch")
        if isinstance(arch, str) and (arch in model_names() or is_factory(arch)) and "arch" in upload.meta:
            if upload.meta["arch"] != arch:
                raise PayloadError(f"architecture {upload.meta['arch']!r}, expected {arch!r}")
            upload.validate(_state_shapes(arch, ctx.shape, ctx.num_classes), required_meta=("num_samples",))
        else:
            upload.validate()

    def local_config(self, ctx: ServerContext) -> TrainConfig:
        """The clients' training config, with this method's ``client:`` overrides applied."""
        base = ctx.train_cfg.to_dict()
        unknown = sorted(set(self.client_overrides) - set(base))
        if unknown:
            raise ValueError(f"method {self.name!r}: unknown client keys {unknown}; valid: {sorted(base)}")
        return TrainConfig(**{**base, **self.client_overrides})


_SHAPES: dict[tuple[str, tuple[int, int, int], int], dict[str, tuple[int, ...]]] = {}


def _state_shapes(arch: str, shape: tuple[int, int, int], num_classes: int) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of an architecture's state dict (built once per setting)."""
    key = (arch, tuple(shape), num_classes)
    if key not in _SHAPES:
        with torch.random.fork_rng(devices=[]):  # building must not move the caller's RNG
            model = build_model(arch, shape[0], shape[1], num_classes)
        _SHAPES[key] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return _SHAPES[key]


class OneShotMethod(Method):
    """One upload per client, then a server-side stage."""

    multi_round: ClassVar[bool] = False
    needs_uploads: ClassVar[bool] = True  # False: the engine skips the client round (central)
    # False: the server part reads the clients' raw data (ServerContext.pooled_train_data), which only
    # the in-process simulator has; remote engines refuse the method before any process starts
    runs_remotely: ClassVar[bool] = True

    def client_message(self, client_id: int, ctx: ServerContext) -> Payload:
        """Default request: train the client's classifier from the shared initialisation."""
        arch = ctx.client_archs[client_id]
        return train_message(arch, ctx.shape, ctx.num_classes, self.local_config(ctx),
                             init_seed=ctx.init_seed(arch),
                             seed=derive_seed(ctx.seed, "client-train", client_id))

    def run(self, ctx: ServerContext) -> dict[str, nn.Module]:
        """One exchange with every client (none where :attr:`needs_uploads` is False), then :meth:`server`."""
        uploads: dict[int, Payload] = {}
        if self.needs_uploads:
            uploads, _ = ctx.exchange(0, {cid: self.client_message(cid, ctx) for cid in range(ctx.num_clients)})
        return self.server(uploads, ctx)

    @abstractmethod
    def server(self, uploads: dict[int, Payload], ctx: ServerContext) -> dict[str, nn.Module]:
        """Return the named global model(s); the first one is the method's headline result."""


class RoundMethod(Method):
    """T rounds; each samples a fraction of the clients (module docstring)."""

    multi_round: ClassVar[bool] = True
    keep_client_models: ClassVar[bool] = False  # True: the ClientBook keeps each client's last model

    @property
    def rounds(self) -> int:
        return int(self.params.get("rounds", 1))

    @property
    def sample_ratio(self) -> float:
        return float(self.params.get("sample_ratio", 1.0))

    def run(self, ctx: ServerContext) -> dict[str, nn.Module]:
        """The template loop; returns the models, the headline first."""
        self.start(ctx)
        for round_ in ctx.rounds(self):  # resumes from a checkpoint of this config
            self.run_round(round_, ctx)
            ctx.end_round(round_, self)
        models = self.models()
        head = self.headline(ctx)
        return {head: models[head], **{k: m for k, m in models.items() if k != head}}

    def start(self, ctx: ServerContext) -> None:
        """Fresh client records, then :meth:`setup` (the state a checkpoint then overwrites)."""
        limit = float(self.params.get("book_memory_mb", DEFAULT_MEMORY_LIMIT / 2**20))  # kept models past it: on disk
        self.book = ClientBook(ctx.num_clients, ctx.num_classes, self.keep_client_models,
                               spill_dir=ctx.out_dir / SPILL_DIR, memory_limit=int(limit * 2**20))
        self.setup(ctx)

    def run_round(self, round_: int, ctx: ServerContext) -> None:
        """Sample, send, record the accepted uploads, aggregate. A round without uploads leaves the
        models as they were (logged)."""
        chosen = sample_clients(ctx.num_clients, self.sample_ratio, round_, ctx.seed)
        uploads, _ = ctx.exchange(round_, self.configure_round(round_, chosen, ctx))
        self.book.update(round_, uploads)
        if not uploads:
            log.warning("%s: round %d: no upload arrived; the models stay as they were", self.name, round_)
            ctx.record.setdefault("empty_rounds", []).append(round_)
            return
        torch.manual_seed(derive_seed(ctx.seed, "server", self.name, round_))
        self.aggregate(round_, uploads, ctx)

    def configure_round(self, round_: int, clients: list[int], ctx: ServerContext) -> dict[int, Payload]:
        """The round's messages (default: :meth:`client_message` per sampled client)."""
        return {cid: self.client_message(cid, round_, ctx) for cid in clients}

    def headline(self, ctx: ServerContext) -> str:
        """The model the method reports (default: the first of :meth:`models`)."""
        return next(iter(self.models()))

    @abstractmethod
    def setup(self, ctx: ServerContext) -> None: ...

    def client_message(self, client_id: int, round_: int, ctx: ServerContext) -> Payload:
        raise NotImplementedError(f"{type(self).__name__} builds its messages in configure_round")

    @abstractmethod
    def aggregate(self, round_: int, uploads: dict[int, Payload], ctx: ServerContext) -> None: ...

    @abstractmethod
    def models(self) -> dict[str, nn.Module]: ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors that let an engine resume after an interruption (default: the models and the
        client records)."""
        out = {f"{name}.{k}": v for name, m in self.models().items() for k, v in m.state_dict().items()}
        out.update({f"book.{k}": v for k, v in self.book.state_dict().items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, model in self.models().items():
            prefix = f"{name}."
            model.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        self.book.load_state_dict({k[5:]: v for k, v in state.items() if k.startswith("book.")})


METHODS: dict[str, Callable[..., Method]] = {}
# Presets: named parameter sets of a registered method (``{"method": name, **params}``), filled by
# the methods package from its presets.yaml. A config label may name one where it names a method.
PRESETS: dict[str, dict[str, Any]] = {}


def register(name: str) -> Callable:
    """Class decorator or factory registration under a config name."""

    def deco(obj: Any) -> Any:
        if name in METHODS:
            raise ValueError(f"method {name!r} registered twice")
        METHODS[name] = obj
        return obj

    return deco


def register_method(name: str) -> Callable:
    """The public decorator (``hetfl.register_method``): a :class:`Method` subclass becomes ``method: name``
    in configs, on every engine (Flower SuperNodes import the same plugin module); its client tasks are
    registered with :func:`hetfl.fl.client.client_task`. A name taken raises ``ValueError``."""

    def deco(obj: Any) -> Any:
        if not (isinstance(obj, type) and issubclass(obj, Method)):
            raise ValueError(f"register_method({name!r}) needs a Method subclass, got {obj!r}")
        if name in PRESETS:
            raise ValueError(f"method {name!r} clashes with a preset")
        obj.name = name
        return register(name)(obj)

    return deco


def register_preset(name: str, spec: dict[str, Any]) -> None:
    """Register ``name`` as ``spec["method"]`` with the other keys of ``spec`` as its defaults."""
    if name in METHODS or name in PRESETS:
        raise ValueError(f"preset {name!r} clashes with a registered method or preset")
    if spec.get("method") not in METHODS:
        raise ValueError(f"preset {name!r}: unknown method {spec.get('method')!r}")
    PRESETS[name] = dict(spec)


def resolve_method(label: str, params: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The registered method and parameters of one ``methods:`` entry: ``method:`` names a method or a
    preset (absent: the label does); a preset's parameters come first, the entry's override them."""
    params = dict(params or {})
    name = params.pop("method", label)
    if name in PRESETS:
        preset = dict(PRESETS[name])
        name = preset.pop("method")
        params = {**preset, **params}
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(sorted(METHODS))} "
                         f"(presets: {', '.join(sorted(PRESETS)) or 'none'})")
    return name, params


def create_method(label: str, params: dict[str, Any] | None) -> Method:
    """The method of the config entry ``label: params`` (see :func:`resolve_method`), named ``label``."""
    name, params = resolve_method(label, params)
    return METHODS[name](params, label=label)


def sample_clients(num_clients: int, ratio: float, round_: int, seed: int) -> list[int]:
    """``max(1, round(ratio * N))`` distinct clients for this round, seeded by (seed, round)."""
    if not 0 < ratio <= 1:
        raise ValueError(f"sample_ratio must be in (0, 1], got {ratio}")
    k = max(1, int(round(ratio * num_clients)))
    g = torch.Generator().manual_seed(derive_seed(seed, "sample", round_))
    return sorted(torch.randperm(num_clients, generator=g)[:k].tolist())

