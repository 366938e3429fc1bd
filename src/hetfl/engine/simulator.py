"""In-process simulator: runs every method of a config on one machine.

For each method it builds a :class:`ServerContext` and binds what the engine lends (``exchange``
through the :class:`~hetfl.engine.uploads.ClientExchange`, i.e. the upload cache or a transport;
``client_info``; the round driver ``rounds`` / ``end_round``), calls ``method.run(ctx)``, evaluates
on the official test split and writes ``DIR/<method>/`` (models, metrics, communication) and
``DIR/summary.json`` (with the machine's :mod:`~hetfl.engine.environment`). A multi-round method is
checkpointed after every round (one atomic file) and resumes from there when the same config is run
again into the same folder. The experiment itself (config, data, partition, device) comes from
:func:`hetfl.engine.experiment.prepare`, importable from here too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

import hetfl.methods  # noqa: F401  (registers methods and client tasks)
from hetfl.config import SIMULATOR_KEYS
from hetfl.data import ImageDataset, dataset_label
from hetfl.engine.environment import code_revision, run_environment
from hetfl.engine.experiment import Experiment, prepare  # noqa: F401  (prepare: callers import it from here)
from hetfl.engine.uploads import ClientExchange, Transport
from hetfl.fl.cache import uploads_digest
from hetfl.fl.clientbook import SPILL_DIR
from hetfl.fl.clientstate import STATE_DIR, ClientStates
from hetfl.fl.comm import CommLedger
from hetfl.fl.method import (
    Method,
    OneShotMethod,
    RoundMethod,
    ServerContext,
    create_method,
)
from hetfl.fl.payload import Payload, PayloadError, json_safe, jsonl_rows
from hetfl.fl.train_config import TrainConfig
from hetfl.fl.training import evaluate


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
                 transport: Transport | None = None, checkpoint_every_s: float | None = 120.0,
                 keep_checkpoints: bool = False) -> None:
        self.exp = exp
        self.keep_checkpoints = keep_checkpoints  # False: a method's checkpoints go once its results are written
        self.prior_results: dict[str, Any] = {}  # results of an earlier run into out_dir, kept in summary.json
        self.prior_methods: dict[str, Any] = {}  # and the settings of its methods, kept in the summary's config
        self.prior_minutes: float | None = None  # set: summary.json counts minutes (earlier runs' + this one's)
        code_revision()  # read now (it is kept): the code this run started with, not a later edit's
        self._created = time.perf_counter()
        self._val_history: dict[str, list[float | None]] = {}  # per method, aligned with its test accuracies
        self._models_history: dict[str, dict[str, list[float | None]]] = {}  # per method, every model's accuracies
        self.quiet = quiet
        # the exchange with the clients: the upload cache (under cache_dir), batched clients, a transport
        self.clients = ClientExchange(exp, cache_dir, transport, checkpoint_every_s, self.progress)
        self.clients.on_client = self._client_progress
        self.data_root = data_root
        self.out_dir = Path(out_dir)
        self.resume = resume
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.engine_info: dict[str, Any] = {"name": "simulator"} if transport is None else {"name": "remote"}
        if self.clients.batch_clients:
            self.engine_info["batch_clients"] = True

    @property
    def trained_uploads(self) -> int:
        """Uploads this simulator trained and put into its cache (all its methods)."""
        return self.clients.trained_uploads

    @property
    def cached_calls(self) -> int:
        """Uploads the last one-shot stage (and any :meth:`train_uploads` since) read from the cache."""
        return self.clients.cached_calls

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

        val_history = self._val_history.setdefault(name, [])  # aligned with history; None: not measured

        def validate_model(model: nn.Module) -> dict[str, Any] | None:
            return evaluate(model, exp.splits.val, exp.device) if exp.splits.val is not None else None

        def evaluate_model(model: nn.Module, track: bool = True) -> dict[str, Any]:
            report = evaluate(model, exp.splits.test, exp.device)
            if track:
                history.append(report["accuracy"])
                val = validate_model(model)
                val_history.append(val["accuracy"] if val else None)
                if val:
                    report["val_accuracy"] = val["accuracy"]
            return report

        def restore(accuracies: list[float]) -> None:
            history[:] = list(accuracies)
            val_history[:] = [None] * len(history)  # the validation accuracies before a resume are not kept

        def pooled() -> ImageDataset:
            if exp.partition is None:
                raise ValueError("this method needs the clients' raw data on the server (centralised "
                                 "training); it cannot run on a remote engine")
            for cid, data in enumerate(exp.client_data):  # raw data travels: count it
                nbytes = data.x.numel() * data.x.element_size() + data.y.numel()  # one byte per label
                ledger.add(0, cid, "up", nbytes, "raw_data", nbytes)
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
            pooled_train_data=pooled, dataset=dataset_label(cfg["dataset"]),
            data_root=Path(self.data_root or cfg["data_root"]),
            resume=self.resume, trim_log=lambda step: self._trim_metrics(name, step),
            restore_history=restore, validate=validate_model,
        )

    # ---- what the engine lends a method's run (ServerContext.exchange, client_info, rounds, end_round) -----
    def _bind(self, name: str, method: Method, ctx: ServerContext, ledger: CommLedger, history: list[float],
              states: dict[int, dict]) -> None:
        """Bind the context's engine calls for one method's run. ``states``: its clients' state (this
        method's alone), saved with its round checkpoint."""
        one_shot = isinstance(method, OneShotMethod)
        addressed: dict[int, set[int]] = {}  # round -> clients sent a message (the metrics row names them)
        models_history: dict[str, list[float | None]] = {}  # every model's test accuracy per evaluation
        self._models_history[name] = models_history
        clock = {"start": time.perf_counter()}

        def exchange(step: int, messages: dict[int, Payload], *, relay: dict[int, int] | None = None,
                     desc: str = "", cacheable: bool = False) -> tuple[dict[int, Payload], dict[int, str]]:
            addressed.setdefault(step, set()).update(messages)
            if one_shot:
                return self._one_shot_exchange(method, ctx, messages, ledger, relay)
            timing: dict[int, float] = {}
            passes: dict[int, int | None] = {}
            began = time.perf_counter()
            replies = self.clients.exchange(method, ctx, step, messages, ledger, states, cacheable=cacheable,
                                            timing=timing, relay=relay, desc=desc or f"{method.name}: round {step}",
                                            passes=passes)
            add_sample_passes(ctx.record, passes)
            if timing:  # the clients' own seconds, summed (remote clients report theirs); a cached reply
                # counts the seconds it took when trained, so the server's are the wall time outside exchanges
                ctx.record["client_seconds"] = ctx.record.get("client_seconds", 0.0) + sum(timing.values())
                ctx.record["exchange_seconds"] = ctx.record.get("exchange_seconds", 0.0) + time.perf_counter() - began
            return replies

        def client_info() -> dict[str, list]:
            info = (self.clients.transport.client_info() if self.clients.transport is not None
                    else {"num_samples": self.exp.partition.sizes.tolist(),
                          "label_counts": self.exp.partition.counts.tolist()})
            for cid in range(ctx.num_clients):  # the clients' answers travel: count them
                nbytes = len(json.dumps({"num_samples": info["num_samples"][cid],
                                         "label_counts": info["label_counts"][cid]}).encode())
                ledger.add(0, cid, "up", nbytes, "info", 0)
            return info

        def rounds(round_method: RoundMethod):  # noqa: ANN202  (a generator of round numbers)
            ckpt = ctx.out_dir / ROUND_CHECKPOINT
            done = self._resume_rounds(ckpt, name, round_method, ctx, ledger, states) if self.resume else 0
            self._trim_metrics(name, done if done else -1)
            clock["start"] = time.perf_counter() - ctx.record.get("seconds_before_resume", 0.0)
            yield from self.progress(range(done + 1, round_method.rounds + 1), desc=f"{method.name}: rounds",
                                     unit="round", initial=done, total=round_method.rounds)

        def end_round(round_: int, round_method: RoundMethod) -> None:
            if round_ % self.exp.cfg["eval_every"] == 0 or round_ == round_method.rounds:
                models, head = round_method.models(), round_method.headline(ctx)
                accs: dict[str, float] = {}
                vals: dict[str, float] = {}
                for key, model in models.items():
                    report = ctx.evaluate(model, track=key == head)
                    accs[key] = report["accuracy"]
                    models_history.setdefault(key, []).append(report["accuracy"])
                    val = report.get("val_accuracy") if key == head else (ctx.validate(model) or {}).get("accuracy")
                    if val is not None:
                        vals[key] = val
                row: dict[str, Any] = {"accuracy": accs[head], "clients": sorted(addressed.get(round_, ()))}
                if "client_seconds" in ctx.record:  # cumulative, as the bytes
                    wall = time.perf_counter() - clock["start"]
                    row["client_seconds"] = round(ctx.record["client_seconds"], 3)
                    row["server_seconds"] = round(max(0.0, wall - ctx.record["exchange_seconds"]), 3)
                if ctx.record.get("client_sample_passes") is not None:
                    row["client_sample_passes"] = ctx.record["client_sample_passes"]
                if vals:
                    row["val_accuracy"] = vals[head]
                if len(models) > 1:
                    row.update(headline=head, models=accs, **({"models_val": vals} if vals else {}))
                ctx.log(round_, **row, **{k: v for k, v in ledger.summary().items() if k != "tensor_bytes"})
            if isinstance(states, ClientStates):  # states past the limit go to disk: few clients take part
                states.spill(round_)
            self._save_rounds(ctx.out_dir / ROUND_CHECKPOINT, name, round_, round_method, ctx, ledger, history,
                              states, time.perf_counter() - clock["start"])

        ctx.exchange, ctx.client_info, ctx.rounds, ctx.end_round = exchange, client_info, rounds, end_round

    def _one_shot_exchange(self, method: Method, ctx: ServerContext, messages: dict[int, Payload], ledger: CommLedger,
                           relay: dict[int, int] | None) -> tuple[dict[int, Payload], dict[int, str]]:
        """A one-shot method's exchange: through the upload cache, its clients' seconds, the uploads' digest
        and the missing clients recorded; fewer than ``min_clients`` uploads stop the method."""
        timing: dict[int, float] = {}
        passes: dict[int, int | None] = {}
        self.clients.cached_calls = 0
        uploads, failures = self.clients.exchange(method, ctx, 0, messages, ledger, {}, cacheable=True,
                                                  timing=timing, relay=relay, desc=f"{method.name}: local training",
                                                  passes=passes)
        ctx.record["client_seconds"] = ctx.record.get("client_seconds", 0.0) + sum(timing.values())
        add_sample_passes(ctx.record, passes)
        ctx.record["uploads_sha256"] = uploads_digest(uploads)
        if self.clients.transport is None:
            ctx.record["cached_uploads"] = self.clients.cached_calls
        missing = sorted(set(messages) - set(uploads))
        if missing:
            ctx.record["missing_clients"] = missing
        need = min(int(self.exp.cfg["min_clients"]), len(messages))
        if len(uploads) < need:
            raise RuntimeError(f"{method.name}: only {len(uploads)} of {len(messages)} clients uploaded "
                               f"(min_clients = {need}); missing {missing}")
        ctx.record["_server_start"] = time.perf_counter()
        return uploads, failures

    def _save_rounds(self, path: Path, name: str, round_: int, method: RoundMethod, ctx: ServerContext,
                     ledger: CommLedger, history: list[float], states: dict[int, dict], seconds: float) -> None:
        """One file, written to a temporary name and renamed (hetfl.fl.payload.Payload.write): the
        method's state, every client's state (tensors by name, the rest as JSON), the round, the
        evaluations, the ledger, the method's record (client failures, clusters, ...) and the seconds so far."""
        tensors = {f"method.{k}": v.detach().cpu().contiguous() for k, v in method.state_dict().items()}
        client_json: dict[str, dict[str, Any]] = {}
        spilled = isinstance(states, ClientStates)
        for cid, state in (states.in_memory() if spilled else states).items():  # the spilled ones: by file
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"client.{cid}.{key}"] = value.detach().cpu().contiguous()
                else:
                    client_json.setdefault(str(cid), {})[key] = value
        meta = {"config_hash": config_hash(self.exp.cfg, name), "round": round_, "history": history,
                "val_history": self._val_history.get(name, []),
                "models_history": self._models_history.get(name, {}), "ledger": ledger.records,
                "record": {k: v for k, v in ctx.record.items() if not k.startswith("_") and k not in NOT_RESUMED},
                "seconds": seconds,
                "client_state": client_json, **({"client_state_files": states.files()} if spilled else {})}
        Payload(tensors, json_safe(meta)).write(path)
        if spilled:
            states.committed()

    def _resume_rounds(self, path: Path, name: str, method: RoundMethod, ctx: ServerContext, ledger: CommLedger,
                       states: dict[int, dict]) -> int:
        """The round a checkpoint of this config holds, its state restored; 0 (a fresh start, with a
        warning) for none, an unreadable or truncated file, or one written for another config."""
        if not path.is_file():
            return 0
        try:
            saved = Payload.from_bytes(path.read_bytes())
            meta = saved.meta
            if meta.get("config_hash") != config_hash(self.exp.cfg, name):
                raise PayloadError("it was written for another config")
            method.load_state_dict({k[len("method."):]: v.to(ctx.device) for k, v in saved.tensors.items()
                                    if k.startswith("method.")})
        except (OSError, PayloadError, KeyError, RuntimeError, ValueError) as err:
            warnings.warn(f"{path}: not resumed ({err}); the rounds start over", stacklevel=2)
            return 0
        memory: dict[int, dict[str, Any]] = {}
        for key, value in saved.tensors.items():
            if key.startswith("client."):
                _, cid, state_key = key.split(".", 2)
                memory.setdefault(int(cid), {})[state_key] = value
        for cid, values in meta.get("client_state", {}).items():
            memory.setdefault(int(cid), {}).update(values)
        if isinstance(states, ClientStates):
            try:
                states.restore(memory, meta.get("client_state_files", {}))
            except PayloadError as err:
                warnings.warn(f"{path}: not resumed ({err}); the rounds start over", stacklevel=2)
                return 0
        else:
            states.update(memory)
        ctx.restore_history(meta["history"])
        val = meta.get("val_history") or []
        if len(val) == len(meta["history"]):
            self._val_history[name][:] = val
        self._models_history[name].update(meta.get("models_history", {}))
        ledger.restore(meta["ledger"])
        ctx.record.update(meta.get("record", {}))
        ctx.add_prior_seconds(float(meta.get("seconds", 0.0)))
        ctx.record["resumed_from_round"] = meta["round"]
        return int(meta["round"])

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
        if self.clients.cache is None or self.clients.transport is not None:
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
            uploads, _ = self.clients.exchange(method, ctx, 0, messages, CommLedger(), {}, cacheable=True,
                                               desc=f"{name}: local training")
            counts[name] = len(uploads)
        return counts

    def cached_uploads(self, name: str) -> tuple[OneShotMethod, dict[int, Payload], ServerContext]:
        """The one-shot method ``name`` of the config, its clients' uploads read from the upload cache
        (no client trains: a missing upload is an error that names the clients) and a server context
        that writes nothing. For studies of a server stage on the uploads a cell ran on."""
        if self.clients.cache is None:
            raise ValueError("cached_uploads reads the upload cache: give the simulator a cache_dir")
        if name not in self.exp.cfg["methods"]:
            raise ValueError(f"no method {name!r} in the config (it has {sorted(self.exp.cfg['methods'])})")
        method = create_method(name, self.exp.cfg["methods"][name])
        if not isinstance(method, OneShotMethod) or not method.needs_uploads:
            raise ValueError(f"{name} takes no one-shot uploads")
        ctx = self._context(name, CommLedger(), [], make_dir=False)
        uploads = self.clients.cached({cid: method.client_message(cid, ctx) for cid in range(ctx.num_clients)})
        missing = sorted(set(range(ctx.num_clients)) - set(uploads))
        if missing:
            raise ValueError(f"{name}: clients {missing} have no upload in the cache {self.clients.cache.root}")
        return method, uploads, ctx

    def _check(self, name: str, method: Method) -> None:
        try:
            ctx = self._context(name, CommLedger(), [], make_dir=False)
            method.check_models(ctx)
            method.check(ctx)
        except ValueError as err:
            raise ValueError(f"methods.{name}: {err}") from err

    def _announce(self, i: int, n: int, name: str, elapsed: float) -> None:
        """The overall progress line: stage i of n and, after the first, the time left at the mean pace of
        the stages so far (the first one also trains the clients, so early estimates run high)."""
        if self.quiet:
            return
        left = f", about {elapsed / (i - 1) * (n - i + 1) / 60:.1f} min left" if i > 1 else ""
        tqdm.write(f"hetfl: stage {i} of {n}: {name} ({elapsed / 60:.1f} min so far{left})")

    def _client_progress(self, name: str, round_: int, done: int, total: int) -> None:
        """``<method>/clients.json``: how far the clients of its current exchange are (``hetfl status``)."""
        folder = self.out_dir / name
        if folder.is_dir():
            tmp = folder / "clients.json.tmp"
            tmp.write_text(json.dumps({"round": round_, "done": done, "total": total, "logged_at": time.time()}))
            os.replace(tmp, folder / "clients.json")

    def run_method(self, name: str) -> dict[str, Any]:
        method: Method = create_method(name, self.exp.cfg["methods"][name])
        ledger, history = CommLedger(), []
        self._val_history[name] = []
        ctx = self._context(name, ledger, history)
        states = ClientStates(ctx.out_dir / STATE_DIR, int(self.exp.cfg["simulator"]["state_memory_mb"] * 2**20))
        self._bind(name, method, ctx, ledger, history, states)
        if not isinstance(method, RoundMethod) and not any(ctx.out_dir.glob("checkpoint*")):
            self._trim_metrics(name, -1)  # a checkpointing stage trims on resume itself
        start = time.perf_counter()
        models = method.run(ctx)
        end = time.perf_counter()
        prior = ctx.record.get("seconds_before_resume", 0.0)  # a resumed stage's work before its checkpoint
        seconds = end - start + prior
        if isinstance(method, OneShotMethod):
            ctx.record["server_seconds"] = end - ctx.record.pop("_server_start", start) + prior
        elif "exchange_seconds" in ctx.record:  # the rest: server stages, evaluations, checkpoints
            ctx.record["server_seconds"] = max(0.0, seconds - ctx.record["exchange_seconds"])
        reports = {key: ctx.evaluate(model, track=False) for key, model in models.items()}
        head = next(iter(models))
        final = reports[head]
        save_models(models, ctx.out_dir)
        (ctx.out_dir / "communication.json").write_text(json.dumps(
            {"per_client": ledger.per_client(), "per_round": ledger.per_round(),
             "tensor_bytes": ledger.summary()["tensor_bytes"]}, indent=1))
        result = {
            "method": method.method,
            "accuracy": final["accuracy"],
            "best_accuracy": max([final["accuracy"], *history]),
            "seconds": seconds,
            **ledger.summary(),
            "per_class": final["per_class"],
            **({"models": {k: r["accuracy"] for k, r in reports.items()}} if len(models) > 1 else {}),
            "params": method.params,  # the settings it ran with, defaults filled in (they change between versions)
            "client": method.local_config(ctx).to_dict(),  # the clients' resolved training settings
            "code": code_revision(),  # the git revision that ran it (a resumed cell's methods may differ)
            **ctx.record,
        }
        if len(models) > 1 and self._models_history.get(name):
            result["models_best"] = {k: max([reports[k]["accuracy"], *(a for a in self._models_history[name].get(k, [])
                                                                        if a is not None)]) for k in models}
        result.update(self._selected(name, ctx, models[head], final["accuracy"], history))
        self._log(name, -1, final=True, accuracy=final["accuracy"])
        return json_safe(result)

    def _selected(self, name: str, ctx: ServerContext, model: nn.Module, final: float,
                  history: list[float]) -> dict[str, Any]:
        """Model selection, labelled: ``test_selected_accuracy`` = the best test accuracy over the
        evaluations (the papers' protocol); with a validation split, ``val_selected_accuracy`` = the test
        accuracy of the evaluation (the final model included) with the best validation accuracy, the
        earliest among equals."""
        out: dict[str, Any] = {"test_selected_accuracy": max([final, *history])}
        val = ctx.validate(model)
        if val is not None:
            pairs = [(v, t) for v, t in zip(self._val_history.get(name, []), history) if v is not None]
            best_val, selected = max([*pairs, (val["accuracy"], final)], key=lambda p: p[0])
            out.update(val_accuracy=val["accuracy"], best_val_accuracy=best_val, val_selected_accuracy=selected)
        return out

    def run(self) -> dict[str, Any]:
        exp = self.exp
        if exp.partition is not None:
            (self.out_dir / "partition.json").write_text(json.dumps(exp.partition.stats()))
        (self.out_dir / "config.json").write_text(json.dumps(exp.cfg, indent=1))
        for name, params in exp.cfg["methods"].items():  # every method checks the setting before any training
            self._check(name, create_method(name, params))
        results = {}
        start, names = time.perf_counter(), list(exp.cfg["methods"])
        for i, name in enumerate(names, 1):
            self._announce(i, len(names), name, time.perf_counter() - start)
            results[name] = self.run_method(name)
            self.write_summary(results)
            if not self.keep_checkpoints:  # the stage is done and its results are written
                for path in (self.out_dir / name).glob("checkpoint*"):
                    path.unlink(missing_ok=True)
                shutil.rmtree(self.out_dir / name / SPILL_DIR, ignore_errors=True)  # the ClientBook's models
                shutil.rmtree(self.out_dir / name / STATE_DIR, ignore_errors=True)  # spilled client states
        with open(self.out_dir / "metrics.jsonl", "w") as out:
            for name in exp.cfg["methods"]:
                if self._metrics_file(name).is_file():
                    out.write(self._metrics_file(name).read_text())
        return self.write_summary(results)

    def write_summary(self, results: dict[str, Any]) -> dict[str, Any]:
        summary = {
            "config": {**self.exp.cfg, "methods": {**self.prior_methods, **self.exp.cfg["methods"]}},
            "results": {**self.prior_results, **results},
            "clients": {"archs": self.exp.archs,
                        **({"sizes": self.exp.partition.sizes.tolist(),
                            "class_counts": self.exp.partition.counts.tolist()}  # (clients, classes)
                           if self.exp.partition is not None else {})},
            # what the data was: the models' input shape and classes (hetfl.load_run rebuilds models from it)
            "data": {"name": dataset_label(self.exp.cfg["dataset"]), "shape": list(self.exp.splits.shape),
                     "num_classes": self.exp.splits.num_classes, "class_names": self.exp.splits.train.class_names,
                     "train": len(self.exp.splits.train), "test": len(self.exp.splits.test),
                     **({"sha256": self.exp.splits.sha256} if self.exp.splits.sha256 else {})},
            "engine": self.engine_info,
            "environment": run_environment(self.exp.device),
            # uploads this run trained into its cache (train_uploads included): where every method then
            # read them from the cache, its results alone would not tell that the run trained them
            **({UPLOADS_TRAINED: self.trained_uploads} if self.trained_uploads else {}),
            **({"minutes": self.prior_minutes + (time.perf_counter() - self._created) / 60}
               if self.prior_minutes is not None else {}),
        }
        # atomic: a page rewritten while this cell runs (another cell of the grid finished) never reads half a file
        tmp = self.out_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(json_safe(summary), indent=1))
        os.replace(tmp, self.out_dir / "summary.json")
        return summary


ROUND_CHECKPOINT = "checkpoint.safetensors"  # a round method's checkpoint: one file (_save_rounds)
# record keys a round checkpoint does not carry over (the resume sets them anew; "_..." keys are transient)
NOT_RESUMED = ("resumed_from_round", "seconds_before_resume")
UPLOADS_TRAINED = "uploads_trained"  # summary key: client uploads the run trained and put in its cache


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


def add_sample_passes(record: dict[str, Any], passes: dict[int, int | None]) -> None:
    """Add an exchange's client sample-passes to ``record["client_sample_passes"]`` (cumulative); None from
    the first client that did not record them (a cached upload from before they were counted) on."""
    if not passes:
        return
    if None in passes.values() or ("client_sample_passes" in record and record["client_sample_passes"] is None):
        record["client_sample_passes"] = None
    else:
        record["client_sample_passes"] = int(record.get("client_sample_passes", 0)) + sum(
            int(v) for v in passes.values())  # type: ignore[arg-type]  (no None left here)
