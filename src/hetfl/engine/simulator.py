"""In-process simulator: drives every method's clients and server on one machine.

For each method in a config it builds a :class:`ServerContext`, sends each (sampled) client the
method's message, runs the client task through the upload cache, counts the bytes both ways,
evaluates on the official test split and writes ``DIR/<method>/`` (models, metrics). A
multi-round method is checkpointed after every round and resumes from there when the same
config is run again into the same folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

import hetfl
import hetfl.methods  # noqa: F401  (registers methods and client tasks)
from hetfl.config import SIMULATOR_KEYS, ConfigError, check_device, client_archs
from hetfl.data import DatasetSplits, ImageDataset, Partition, load_dataset, make_partition
from hetfl.fl.cache import UploadCache, request_key, uploads_digest
from hetfl.fl.client import ClientEnv, group_key, handle, handle_group
from hetfl.fl.comm import CommLedger
from hetfl.fl.method import (
    Method,
    OneShotMethod,
    RoundMethod,
    ServerContext,
    create_method,
    sample_clients,
)
from hetfl.fl.payload import Payload, PayloadError, json_safe, jsonl_rows
from hetfl.fl.training import TrainCheckpoint, TrainConfig, bf16_native, evaluate
from hetfl.host import flush_denormal_setting, flush_denormals, malloc_setting
from hetfl.methods.checks import check_methods

log = logging.getLogger("hetfl")


class Transport(Protocol):
    """How one exchange's messages reach remote clients (for example the Flower adapter).

    ``exchange`` returns the uploads that arrived and, for every other addressed client, the
    reason it is missing (timeout, error reply, not connected). The simulator's own default is
    in-process and needs no transport."""

    def exchange(self, round_: int, messages: dict[int, Payload]) -> tuple[dict[int, Payload], dict[int, str]]: ...


def resolve_device(name: str) -> torch.device:
    """``auto`` = the GPU if torch sees one, else the CPU; a named device must be on this machine
    (a :class:`ConfigError` says so before any data is loaded, instead of torch failing mid-run)."""
    check_device(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(f"device: {name!r} asked for, but torch {torch.__version__} ({built}) sees no "
                              "CUDA GPU here; use device auto or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device: {name!r} asked for, but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device: {name!r} asked for, but torch sees no MPS device here; use auto or cpu")
    return device


@dataclass
class Experiment:
    """A validated config with its data loaded and partitioned."""

    cfg: dict[str, Any]
    splits: DatasetSplits
    partition: Partition | None  # None on a remote server, which never sees the clients' data
    archs: list[str]
    device: torch.device
    client_data: list[ImageDataset] = field(init=False)

    def __post_init__(self) -> None:
        indices = self.partition.indices if self.partition is not None else []
        self.client_data = [self.splits.train.subset(torch.from_numpy(idx)) for idx in indices]

    def fingerprint(self, client_id: int) -> dict[str, Any]:
        idx = self.partition.indices[client_id]
        return {
            "dataset": self.cfg["dataset"], "data": self.cfg["data"], "partition": self.cfg["partition"],
            "clients": self.cfg["clients"], "seed": self.cfg["seed"], "client": client_id,
            "indices": hashlib.sha256(idx.astype(np.int64).tobytes()).hexdigest(),
        }


def prepare(cfg: dict[str, Any], data_root: str | None = None, partitioned: bool = True,
            splits: DatasetSplits | None = None) -> Experiment:
    """Load the dataset and make the partition (fails early on bad partitions). A remote
    server (``partitioned=False``) only evaluates on the test split and never partitions. ``splits``:
    the dataset, already loaded with ``cfg``'s dataset and data settings (a caller that prepares many
    cells of one dataset loads it once)."""
    check_methods(cfg)  # an unknown method or parameter fails before the data loads
    device = resolve_device(cfg["device"])
    if splits is None:
        splits = load_dataset(cfg["dataset"], data_root or cfg["data_root"], cfg["data"])
    partition = make_partition(splits.train.y.numpy(), cfg["clients"], cfg["partition"], cfg["seed"],
                               num_classes=splits.num_classes) if partitioned else None
    return Experiment(cfg, splits, partition, client_archs(cfg), device)


def config_hash(cfg: dict[str, Any], method: str) -> str:
    keep = {k: v for k, v in cfg.items() if k not in ("methods", "name", "device", "eval_every", "flower")}
    # simulator settings at their defaults leave the hash out: the hashes of earlier runs hold
    changed = {k: v for k, v in keep.pop("simulator", {}).items() if SIMULATOR_KEYS.get(k) != v}
    if changed:
        keep["simulator"] = changed
    keep["method"] = {method: cfg["methods"][method]}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Simulator:
    """Runs the methods of one :class:`Experiment` and writes their outputs under ``out_dir``."""

    def __init__(self, exp: Experiment, out_dir: Path, cache_dir: Path | None = None,
                 quiet: bool = False, resume: bool = True, data_root: str | None = None,
                 transport: Transport | None = None, checkpoint_every_s: float | None = 120.0) -> None:
        self.exp = exp
        # a client whose upload goes to the cache saves its local training this often (None: never),
        # under the cache key, and resumes from it when interrupted (hetfl.fl.training.TrainCheckpoint)
        self.checkpoint_every_s = checkpoint_every_s
        # ``simulator.batch_clients``: train the clients of one exchange whose requests share a group
        # key as one vectorised batch (hetfl.fl.client.handle_group); other bits than one client at a
        # time, so their uploads are cached under keys of their own
        self.batch_clients = bool(exp.cfg.get("simulator", {}).get("batch_clients")) and transport is None
        # ``simulator.flush_denormal``: subnormal floats flushed to zero in this process (hetfl.host;
        # fully so where the command line set it before any torch work); other bits, so the uploads
        # are cached under keys of their own. The keys follow the process, which stays flushed once an
        # earlier run in it asked for that.
        if exp.cfg.get("simulator", {}).get("flush_denormal") and transport is None and not flush_denormals():
            raise ConfigError("simulator.flush_denormal: this CPU cannot flush subnormal floats to zero")
        self.flush_denormal = flush_denormal_setting() and transport is None
        self.transport = transport
        if transport is None and exp.partition is None:
            raise ValueError("an in-process simulation needs the partitioned client data")
        self.data_root = data_root
        self.out_dir = Path(out_dir)
        self.cache = UploadCache(cache_dir) if cache_dir else None
        self.quiet = quiet
        self.resume = resume
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.cached_calls = 0
        self.trained_uploads = 0  # uploads this simulator trained and put into its cache (all its methods)
        self.engine_info: dict[str, Any] = {"name": "simulator"} if transport is None else {"name": "remote"}
        if self.batch_clients:
            self.engine_info["batch_clients"] = True
        self._answered: dict[tuple[int, str], Payload] = {}  # remote one-shot uploads of this run

    # ---- helpers lent to methods -------------------------------------------------------------
    def progress(self, iterable: Any = None, **kw: Any) -> tqdm:
        return tqdm(iterable, disable=self.quiet, dynamic_ncols=True, leave=False, **kw)

    def _metrics_file(self, method: str) -> Path:
        return self.out_dir / method / "metrics.jsonl"

    def _log(self, method: str, step: int, **metrics: Any) -> None:
        """Append one row to the method's metrics.jsonl, stamped ``logged_at`` (Unix seconds, from which
        ``hetfl status`` reads the recent pace per step)."""
        row = {"method": method, "step": step, **metrics}
        row.setdefault("logged_at", round(time.time(), 2))
        with open(self._metrics_file(method), "a") as f:
            f.write(json.dumps(json_safe(row)) + "\n")

    def _trim_metrics(self, method: str, keep_until: int) -> None:
        """Drop rows after step ``keep_until`` (all rows when it is -1): a re-run or a resumed
        run never duplicates rows."""
        path = self._metrics_file(method)
        if path.is_file():
            rows = [r for r in jsonl_rows(path) if 0 <= r.get("step", -1) <= keep_until]  # a cut line goes too
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def _context(self, name: str, ledger: CommLedger, history: list[float], make_dir: bool = True) -> ServerContext:
        exp, cfg = self.exp, self.exp.cfg
        train_cfg = TrainConfig(**{k: v for k, v in cfg["client"].items() if k != "model"})

        def evaluate_model(model: nn.Module, track: bool = True) -> dict[str, Any]:
            report = evaluate(model, exp.splits.test, exp.device)
            if track:
                history.append(report["accuracy"])
            return report

        def pooled() -> ImageDataset:
            if exp.partition is None:
                raise ValueError("this method needs the clients' raw data on the server (centralised "
                                 "training); it cannot run on a remote engine")
            for cid, data in enumerate(exp.client_data):  # raw data travels: count it
                ledger.add(0, cid, "up", data.x.numel() * data.x.element_size() + data.y.numel())
            index = torch.from_numpy(np.concatenate(exp.partition.indices))
            return exp.splits.train.subset(index)

        method_dir = self.out_dir / name
        if make_dir:
            method_dir.mkdir(parents=True, exist_ok=True)
        return ServerContext(
            seed=cfg["seed"], num_classes=exp.splits.num_classes, shape=exp.splits.shape,
            num_clients=cfg["clients"], client_archs=exp.archs, server_arch=cfg["server"]["model"],
            train_cfg=train_cfg, device=exp.device, out_dir=method_dir, evaluate=evaluate_model,
            log=lambda step, **m: self._log(name, step, **m), progress=self.progress,
            pooled_train_data=pooled, dataset=cfg["dataset"], data_root=Path(self.data_root or cfg["data_root"]),
            resume=self.resume, trim_log=lambda step: self._trim_metrics(name, step),
            restore_history=lambda accuracies: history.__setitem__(slice(None), list(accuracies)),
        )

    def _fingerprint(self, cid: int) -> dict[str, Any]:
        """What the cache keys a client's data by; batched training and flushed subnormals mark it
        (other bits)."""
        fingerprint = self.exp.fingerprint(cid)
        if self.batch_clients:
            fingerprint["batched"] = True
        if self.flush_denormal:
            fingerprint["flush_denormal"] = True
        return fingerprint

    def _key(self, cid: int, message: Payload) -> str:
        return request_key(self._fingerprint(cid), message, self.exp.device)

    def _env(self, cid: int, states: dict[int, dict], bar: tqdm | None = None, label: str = "") -> ClientEnv:
        env = ClientEnv(cid, self.exp.client_data[cid], self.exp.device, states.setdefault(cid, {}))
        if bar is not None:
            env.progress = lambda epoch, loss: bar.set_postfix(client=label or cid, epoch=epoch, loss=f"{loss:.3f}")
        return env

    def _train_groups(self, messages: dict[int, Payload], states: dict[int, dict], cacheable: bool,
                      bar: tqdm | None = None) -> dict[int, tuple[Payload, float]]:
        """With ``batch_clients``: the requests not in the cache whose :func:`group_key` they share with
        another, trained group by group (:func:`handle_group`); client -> (upload, seconds, an equal
        share of its group's)."""
        groups: dict[Any, list[int]] = {}
        for cid, message in messages.items():
            if cacheable and self.cache and self.cache.has(self._key(cid, message)):
                continue
            key = group_key(message, self._env(cid, states))
            if key is not None:
                groups.setdefault(key, []).append(cid)
        done: dict[int, tuple[Payload, float]] = {}
        for cids in (c for c in groups.values() if len(c) > 1):
            start = time.perf_counter()
            label = f"{cids[0]}-{cids[-1]} ({len(cids)} at once)"
            envs = [self._env(cid, states, bar, label) for cid in cids]
            uploads = handle_group([messages[cid] for cid in cids], envs)
            seconds = (time.perf_counter() - start) / len(cids)
            done.update({cid: (upload, seconds) for cid, upload in zip(cids, uploads)})
        return done

    def _client(self, cid: int, message: Payload, round_: int, ledger: CommLedger,
                states: dict[int, dict], cacheable: bool, timing: dict[int, float] | None = None,
                bar: tqdm | None = None, trained: tuple[Payload, float] | None = None) -> Payload:
        """One client call through the cache (``trained``: its upload and seconds from a group that
        trained together, :meth:`_train_groups`). Bytes are counted whether or not the upload was
        cached (the transfer would have happened); timing stays out of the payload so that the
        bytes are deterministic."""
        exp = self.exp
        ledger.add(round_, cid, "down", message.nbytes)
        key = self._key(cid, message) if cacheable and self.cache else None
        upload = self.cache.get(key) if key and trained is None else None
        if upload is None:
            start = time.perf_counter()
            checkpoint = None
            if trained is not None:
                upload, seconds = trained
            else:
                env = self._env(cid, states, bar)
                if key and self.checkpoint_every_s is not None:
                    checkpoint = env.checkpoint = TrainCheckpoint(self.cache.partial_path(key), self.checkpoint_every_s)
                prior = checkpoint.saved_seconds() if checkpoint else 0.0  # trained before a resume
                if prior:
                    log.warning("client %d: local training goes on from its checkpoint (%.0f s of it done "
                                "before): %s", cid, prior, checkpoint.path)
                upload = handle(message, env)
                seconds = prior + time.perf_counter() - start
            if key:
                self.trained_uploads += 1
                # the thread count is recorded, not keyed: CPU kernels split their sums by thread,
                # so retraining with another count gives other bits (a cached upload is reused as is)
                self.cache.put(key, upload, {"fingerprint": self._fingerprint(cid), "request": message.meta,
                                             "request_tensors": sorted(message.tensors),
                                             "keyed_for": {"torch": torch.__version__, "device": exp.device.type},
                                             "seconds": seconds, "torch_threads": torch.get_num_threads(),
                                             **({"resumed_after_seconds": prior} if checkpoint and prior else {})})
            if checkpoint is not None:
                checkpoint.clear()
        else:  # report the time it took when it was trained, so cached methods show the same cost
            seconds = float(self.cache.info(key).get("seconds", 0.0))
            self.cached_calls += 1
        if timing is not None:
            timing[cid] = seconds
        ledger.add(round_, cid, "up", upload.nbytes)
        return upload

    # ---- drivers -------------------------------------------------------------------------------
    def _exchange(self, method: Method, ctx: ServerContext, round_: int, messages: dict[int, Payload],
                  ledger: CommLedger, states: dict[int, dict], cacheable: bool,
                  timing: dict[int, float] | None = None, desc: str = "") -> dict[int, Payload]:
        """Send ``messages``, collect the uploads, and keep those ``method.validate_upload``
        accepts. Missing and rejected clients are logged and recorded, never fatal here."""
        failures: dict[int, str] = {}
        if self.transport is None:
            bar = self.progress(list(messages), desc=desc, unit="client")
            trained = self._train_groups(messages, states, cacheable, bar) if self.batch_clients else {}
            uploads = {cid: self._client(cid, messages[cid], round_, ledger, states, cacheable, timing, bar,
                                         trained.get(cid))
                       for cid in bar}
        else:
            for cid, message in messages.items():
                ledger.add(round_, cid, "down", message.nbytes)
            uploads, failures = self._remote(round_, messages, cacheable)
            for cid, upload in uploads.items():
                ledger.add(round_, cid, "up", upload.nbytes)
        accepted: dict[int, Payload] = {}
        for cid, upload in sorted(uploads.items()):
            try:
                method.validate_upload(cid, messages[cid], upload, ctx)
                accepted[cid] = upload
            except PayloadError as err:
                failures[cid] = f"upload rejected: {err}"
        for cid, reason in sorted(failures.items()):
            log.warning("%s: round %d: client %d left out: %s", method.name, round_, cid, reason)
            ctx.record.setdefault("client_failures", []).append({"round": round_, "client": cid, "reason": reason})
        return accepted

    def _remote(self, round_: int, messages: dict[int, Payload],
                cacheable: bool) -> tuple[dict[int, Payload], dict[int, str]]:
        """Through the transport. A cacheable request a client already answered in this run (the
        same one-shot request from another method) is answered from memory, so every one-shot
        method gets the byte-identical upload and the client trains once; bytes are counted as
        if sent, as with the local upload cache."""
        keys = {cid: (cid, m.sha256()) for cid, m in messages.items()}
        known = {cid: self._answered[k] for cid, k in keys.items() if cacheable and k in self._answered}
        todo = {c: m for c, m in messages.items() if c not in known}
        uploads, failures = self.transport.exchange(round_, todo) if todo else ({}, {})
        if cacheable:
            self._answered.update({keys[cid]: up for cid, up in uploads.items()})
        return {**uploads, **known}, failures

    def _one_shot(self, method: OneShotMethod, ctx: ServerContext, ledger: CommLedger) -> dict[str, nn.Module]:
        uploads: dict[int, Payload] = {}
        ctx.record["client_seconds"] = 0.0
        if method.needs_uploads:
            timing: dict[int, float] = {}
            self.cached_calls = 0
            messages = {cid: method.client_message(cid, ctx) for cid in range(ctx.num_clients)}
            uploads = self._exchange(method, ctx, 0, messages, ledger, {}, cacheable=True, timing=timing,
                                     desc=f"{method.name}: local training")
            ctx.record["client_seconds"] = sum(timing.values())
            ctx.record["uploads_sha256"] = uploads_digest(uploads)
            if self.transport is None:
                ctx.record["cached_uploads"] = self.cached_calls
            missing = sorted(set(messages) - set(uploads))
            if missing:
                ctx.record["missing_clients"] = missing
            need = min(int(self.exp.cfg["min_clients"]), ctx.num_clients)
            if len(uploads) < need:
                raise RuntimeError(f"{method.name}: only {len(uploads)} of {ctx.num_clients} clients uploaded "
                                   f"(min_clients = {need}); missing {missing}")
        start = time.perf_counter()
        models = method.server(uploads, ctx)
        ctx.record["server_seconds"] = time.perf_counter() - start + ctx.record.get("seconds_before_resume", 0.0)
        return models

    def _rounds(self, name: str, method: RoundMethod, ctx: ServerContext, ledger: CommLedger,
                history: list[float], chash: str) -> dict[str, nn.Module]:
        method.setup(ctx)
        ckpt = ctx.out_dir / "checkpoint.safetensors"
        ckpt_info = ctx.out_dir / "checkpoint.json"
        start_round = 1
        if self.resume and ckpt.is_file() and ckpt_info.is_file():
            info = json.loads(ckpt_info.read_text())
            if info.get("config_hash") == chash:
                method.load_state_dict(load_file(str(ckpt), device=str(ctx.device)))
                start_round = info["round"] + 1
                history[:] = info["history"]
                ledger.records[:] = [tuple(r) for r in info["ledger"]]
                ctx.record["resumed_from_round"] = info["round"]
        self._trim_metrics(name, start_round - 1 if start_round > 1 else -1)
        states: dict[int, dict] = {}
        every = self.exp.cfg["eval_every"]
        bar = self.progress(range(start_round, method.rounds + 1), desc=f"{method.name}: rounds",
                            unit="round", initial=start_round - 1, total=method.rounds)
        for round_ in bar:
            chosen = sample_clients(ctx.num_clients, method.sample_ratio, round_, ctx.seed)
            messages = {cid: method.client_message(cid, round_, ctx) for cid in chosen}
            uploads = self._exchange(method, ctx, round_, messages, ledger, states, cacheable=False)
            if uploads:  # a round whose every client failed leaves the global model as it was
                method.aggregate(round_, uploads, ctx)
            if round_ % every == 0 or round_ == method.rounds:
                head = next(iter(method.models().values()))
                report = ctx.evaluate(head)
                bar.set_postfix(acc=f"{report['accuracy']:.2f}")
                ctx.log(round_, accuracy=report["accuracy"], clients=chosen,
                        bytes_up=ledger.total("up"), bytes_down=ledger.total("down"))
            save_file({k: v.detach().cpu().contiguous() for k, v in method.state_dict().items()}, str(ckpt))
            ckpt_info.write_text(json.dumps({"config_hash": chash, "round": round_, "history": history,
                                             "ledger": ledger.records}))
        return method.models()

    def train_uploads(self, methods: dict[str, dict[str, Any]],
                      clients: Collection[int] | None = None) -> dict[str, int]:
        """Train the one-shot uploads of ``methods`` (name -> parameters, e.g. other methods of the
        same cell than the config runs) into the upload cache (or find them there) without running
        their server stages; returns the accepted uploads per method. ``clients``: only these client
        ids (a shard of the cell's clients, so that several processes can train one cell's clients
        side by side, each a disjoint shard; default all).
        Methods then started in other processes read every upload from the cache: two processes that
        train the same request at once waste the work, and on a GPU they get different bytes, so
        the methods of one comparison would not share their client models."""
        if self.cache is None or self.transport is not None:
            raise ValueError("train_uploads fills the local upload cache: give the simulator a cache_dir "
                             "and no transport")
        n = int(self.exp.cfg["clients"])
        ids = list(range(n)) if clients is None else sorted(set(clients))
        bad = [c for c in ids if not 0 <= c < n]
        if bad:
            raise ValueError(f"train_uploads: no client {bad} in a cell of {n} clients")
        counts: dict[str, int] = {}
        for name, params in methods.items():
            method = create_method(name, params)
            if not isinstance(method, OneShotMethod) or not method.needs_uploads:
                continue
            ctx = self._context(name, CommLedger(), [], make_dir=False)
            messages = {cid: method.client_message(cid, ctx) for cid in ids}
            uploads = self._exchange(method, ctx, 0, messages, CommLedger(), {}, cacheable=True,
                                     desc=f"{name}: local training")
            counts[name] = len(uploads)
        return counts

    def cached_uploads(self, name: str) -> tuple[OneShotMethod, dict[int, Payload], ServerContext]:
        """The one-shot method ``name`` of the config, its clients' uploads read from the upload cache
        (no client trains: a missing upload is an error that names the clients) and a server context
        that writes nothing. For studies of a server stage on the uploads a cell ran on."""
        if self.cache is None:
            raise ValueError("cached_uploads reads the upload cache: give the simulator a cache_dir")
        if name not in self.exp.cfg["methods"]:
            raise ValueError(f"no method {name!r} in the config (it has {sorted(self.exp.cfg['methods'])})")
        method = create_method(name, self.exp.cfg["methods"][name])
        if not isinstance(method, OneShotMethod) or not method.needs_uploads:
            raise ValueError(f"{name} takes no one-shot uploads")
        ctx = self._context(name, CommLedger(), [], make_dir=False)
        uploads: dict[int, Payload] = {}
        for cid in range(ctx.num_clients):
            upload = self.cache.get(self._key(cid, method.client_message(cid, ctx)))
            if upload is not None:
                uploads[cid] = upload
        missing = sorted(set(range(ctx.num_clients)) - set(uploads))
        if missing:
            raise ValueError(f"{name}: clients {missing} have no upload in the cache {self.cache.root}")
        return method, uploads, ctx

    def _check(self, name: str, method: Method) -> None:
        try:
            method.check(self._context(name, CommLedger(), []))
        except ValueError as err:
            raise ValueError(f"methods.{name}: {err}") from err

    def run_method(self, name: str) -> dict[str, Any]:
        method: Method = create_method(name, self.exp.cfg["methods"][name])
        ledger, history = CommLedger(), []
        ctx = self._context(name, ledger, history)
        start = time.perf_counter()
        if isinstance(method, RoundMethod):
            models = self._rounds(name, method, ctx, ledger, history, config_hash(self.exp.cfg, name))
        else:
            if not any(ctx.out_dir.glob("checkpoint*")):  # a checkpointing stage trims on resume itself
                self._trim_metrics(name, -1)
            models = self._one_shot(method, ctx, ledger)
        seconds = time.perf_counter() - start + ctx.record.get("seconds_before_resume", 0.0)  # a resumed stage
        reports = {key: ctx.evaluate(model, track=False) for key, model in models.items()}
        head = next(iter(models))
        final = reports[head]
        save_models(models, ctx.out_dir)
        (ctx.out_dir / "communication.json").write_text(json.dumps(
            {"per_client": ledger.per_client(), "per_round": ledger.per_round()}, indent=1))
        result = {
            "method": method.method,
            "accuracy": final["accuracy"],
            "best_accuracy": max([final["accuracy"], *history]),
            "seconds": seconds,
            "bytes_up": ledger.total("up"),
            "bytes_down": ledger.total("down"),
            "per_class": final["per_class"],
            **({"models": {k: r["accuracy"] for k, r in reports.items()}} if len(models) > 1 else {}),
            "params": method.params,  # the settings it ran with, defaults filled in (they change between versions)
            **ctx.record,
        }
        self._log(name, -1, final=True, accuracy=final["accuracy"])
        return json_safe(result)

    def run(self) -> dict[str, Any]:
        exp = self.exp
        if exp.partition is not None:
            (self.out_dir / "partition.json").write_text(json.dumps(exp.partition.stats()))
        (self.out_dir / "config.json").write_text(json.dumps(exp.cfg, indent=1))
        for name, params in exp.cfg["methods"].items():  # every method checks the setting before any training
            self._check(name, create_method(name, params))
        results = {}
        for name in exp.cfg["methods"]:
            results[name] = self.run_method(name)
            self.write_summary(results)
        with open(self.out_dir / "metrics.jsonl", "w") as out:
            for name in exp.cfg["methods"]:
                if self._metrics_file(name).is_file():
                    out.write(self._metrics_file(name).read_text())
        return self.write_summary(results)

    def write_summary(self, results: dict[str, Any]) -> dict[str, Any]:
        summary = {
            "config": self.exp.cfg,
            "results": results,
            "clients": {"archs": self.exp.archs,
                        **({"sizes": self.exp.partition.sizes.tolist(),
                            "class_counts": self.exp.partition.counts.tolist()}  # (clients, classes)
                           if self.exp.partition is not None else {})},
            "engine": self.engine_info,
            "environment": run_environment(self.exp.device),
            # uploads this run trained into its cache (train_uploads included): where every method then
            # read them from the cache, its results alone would not tell that the run trained them
            **({UPLOADS_TRAINED: self.trained_uploads} if self.trained_uploads else {}),
        }
        (self.out_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=1))
        return summary


UPLOADS_TRAINED = "uploads_trained"  # summary key: client uploads the run trained and put in its cache


def run_environment(device: torch.device) -> dict[str, Any]:
    """What a summary records of the machine a run on ``device`` used (its ``environment``): versions,
    thread count, processor and its bf16 units, allocator and denormal settings, accelerator."""
    return {"hetfl": hetfl.__version__, "torch": torch.__version__,
            "device": str(device), "threads": torch.get_num_threads(),
            "machine": platform.machine(), "python": platform.python_version(),
            "cpu": processor_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_bf16": cpu_bf16_units(),
            "bf16_native": bf16_native(device.type), "malloc": malloc_setting(),
            "flush_denormal": flush_denormal_setting(),
            "accelerator": accelerator_name(device)}


def cpuinfo_value(key: str, cpuinfo: str | None = None) -> str | None:
    """The value of the first ``key : value`` line of ``/proc/cpuinfo`` (``cpuinfo``: that file's text,
    for tests); None without such a line or a readable file (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return None


def processor_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else :func:`platform.processor`): timings
    recorded in a summary are only comparable on the same processor."""
    return cpuinfo_value("model name") or platform.processor() or "unknown"


# /proc/cpuinfo flags that decide bf16 speed on a CPU, weakest first: torch's ``get_cpu_capability()``
# reads AVX512 on all three kinds of machine this project met (AVX-512 alone, with avx512_bf16, with
# AMX), whose bf16 convolutions differ by several times (docs/BENCHMARKS.md).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_units(cpuinfo: str | None = None) -> list[str]:
    """The :data:`BF16_FLAGS` in the CPU's ``flags`` (:func:`cpuinfo_value`); empty without any."""
    flags = set((cpuinfo_value("flags", cpuinfo) or "").split())
    return [f for f in BF16_FLAGS if f in flags]


def accelerator_name(device: torch.device) -> str | None:
    """The GPU's name (``NVIDIA H100 80GB HBM3``) for a CUDA device, else None: "cuda" alone does not
    say which card the recorded minutes are from."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def save_models(models: dict[str, nn.Module], folder: Path) -> None:
    """Each returned model as ``<name>.safetensors`` with its architecture in the metadata; a model
    whose ``save`` attribute is False (one built from other returned models, such as a vote) is not."""
    for key, model in models.items():
        if getattr(model, "save", True) is False:
            continue
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        arch = getattr(model, "arch", type(model).__name__)
        safe = key.replace("[", "_").replace("]", "")
        save_file(state, str(folder / f"{safe}.safetensors"), metadata={"arch": str(arch), "name": key})
