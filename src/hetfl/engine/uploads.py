"""The simulator's exchange with its clients: one exchange's messages out, the accepted uploads back.

In process (no transport) each client task runs here through the upload cache
(:class:`~hetfl.fl.cache.UploadCache`), keyed by the client's data fingerprint, the request and the
device: every one-shot method that sends the same request gets the same upload, and a client's local
training that goes to the cache saves a checkpoint under that key and resumes from it after an
interruption. With ``simulator.batch_clients`` the requests that share a group key train together as
one vectorised batch (:func:`~hetfl.fl.client.handle_group`). Through a :class:`Transport` (the Flower
adapter) the messages go elsewhere. Either way the bytes are counted both ways and every upload passes
the method's ``validate_upload``; rejected and missing clients are logged and recorded, never fatal here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from hetfl.config import ConfigError
from hetfl.engine.experiment import Experiment
from hetfl.fl.cache import UploadCache, request_key
from hetfl.fl.checkpoint import TrainCheckpoint
from hetfl.fl.client import ClientEnv, group_key, handle, handle_group
from hetfl.fl.comm import CommLedger
from hetfl.fl.method import Method, ServerContext
from hetfl.fl.payload import Payload, PayloadError
from hetfl.fl.training import counting_sample_passes
from hetfl.host import flush_denormal_setting, flush_denormals

log = logging.getLogger("hetfl")


class Transport(Protocol):
    """How one exchange's messages reach remote clients (for example the Flower adapter).

    ``exchange`` returns the uploads that arrived and, for every other addressed client, the
    reason it is missing (timeout, error reply, not connected); ``namespace`` (the method's label)
    keys the clients' state, so two methods of one run never see each other's. After an exchange, an
    optional ``costs`` attribute (client -> (seconds, sample-passes) as the client measured them, or None)
    gives the clients' cost of its uploads. The simulator's own default is in-process and needs no
    transport."""

    def exchange(self, round_: int, messages: dict[int, Payload],
                 namespace: str = "") -> tuple[dict[int, Payload], dict[int, str]]: ...

    def client_info(self) -> dict[str, list]:
        """Every client's sample count and label histogram (``num_samples``, ``label_counts``)."""
        ...


class ClientExchange:
    """Sends the messages of one exchange to the clients and returns the uploads that arrived and that
    ``method.validate_upload`` accepts (module docstring), counting the bytes in the exchange's ledger.

    ``cache_dir``: the upload cache's folder (None: no cache, every client trains); ``transport``: where
    the messages go (None: this process); ``checkpoint_every_s``: how often a client whose upload goes to
    the cache saves its local training (None: never); ``progress``: makes an exchange's progress bar."""

    def __init__(self, exp: Experiment, cache_dir: Path | None, transport: Transport | None,
                 checkpoint_every_s: float | None, progress: Callable[..., tqdm]) -> None:
        settings = exp.cfg.get("simulator", {})
        # ``simulator.batch_clients``: train the clients of one exchange whose requests share a group
        # key as one vectorised batch (hetfl.fl.client.handle_group); other bits than one client at a
        # time, so their uploads are cached under keys of their own
        self.batch_clients = bool(settings.get("batch_clients")) and transport is None
        # ``simulator.flush_denormal``: subnormal floats flushed to zero in this process (hetfl.host;
        # fully so where the command line set it before any torch work); other bits, so the uploads
        # are cached under keys of their own. The keys follow the process, which stays flushed once an
        # earlier run in it asked for that.
        if settings.get("flush_denormal") and transport is None and not flush_denormals():
            raise ConfigError("simulator.flush_denormal: this CPU cannot flush subnormal floats to zero")
        self.flush_denormal = flush_denormal_setting() and transport is None
        if transport is None and exp.partition is None:
            raise ValueError("an in-process simulation needs the partitioned client data")
        self.exp = exp
        self.transport = transport
        self.cache = UploadCache(cache_dir) if cache_dir else None
        # a client whose upload goes to the cache saves its local training this often (None: never),
        # under the cache key, and resumes from it when interrupted (hetfl.fl.checkpoint.TrainCheckpoint)
        self.checkpoint_every_s = checkpoint_every_s
        self.progress = progress
        self.cached_calls = 0  # uploads read from the cache (the simulator resets it per one-shot stage)
        self.trained_uploads = 0  # uploads trained and put into the cache (all exchanges)
        # remote one-shot uploads of this run, with their clients' cost (seconds, sample-passes)
        self._answered: dict[tuple[int, str], tuple[Payload, tuple[float, int] | None]] = {}
        # called after each local client call: (method label, round, clients done, clients asked)
        self.on_client: Callable[[str, int, int, int], None] | None = None

    def exchange(self, method: Method, ctx: ServerContext, round_: int, messages: dict[int, Payload],
                 ledger: CommLedger, states: dict[int, dict], cacheable: bool,
                 timing: dict[int, float] | None = None, desc: str = "",
                 relay: dict[int, int] | None = None,
                 passes: dict[int, int | None] | None = None) -> tuple[dict[int, Payload], dict[int, str]]:
        """Send ``messages``, collect the uploads, and keep those ``method.validate_upload``
        accepts; returns them and, per other addressed client, why it is left out. ``timing`` and
        ``passes`` receive each local client's seconds and training sample-passes
        (:func:`~hetfl.fl.training.counting_sample_passes`; None: a cached upload that did not record
        them), from a remote transport what its clients report (its ``costs``). Missing and rejected
        clients are logged and recorded, never fatal here. ``relay`` {sender: receiver}: those clients'
        uploads are data for another client, forwarded by the server, and count once, as ``peer``."""
        failures: dict[int, str] = {}
        up = {cid: "peer" if relay and cid in relay else "up" for cid in messages}
        for cid, message in messages.items():
            ledger.add_payload(round_, cid, "down", message)
        if self.transport is None:
            bar = self.progress(list(messages), desc=desc, unit="client")
            trained = self._train_groups(messages, states, cacheable, bar) if self.batch_clients else {}
            uploads = {}
            for done, cid in enumerate(bar, 1):
                uploads[cid] = self._client(cid, messages[cid], round_, ledger, states, cacheable, timing, bar,
                                            trained.get(cid), up[cid], passes)
                if self.on_client is not None:
                    self.on_client(method.name, round_, done, len(messages))
        else:
            uploads, failures, costs = self._remote(round_, messages, cacheable, method.name)
            for cid, upload in uploads.items():
                ledger.add_payload(round_, cid, up[cid], upload)
                cost = costs.get(cid)
                if timing is not None and cost is not None:
                    timing[cid] = cost[0]
                if passes is not None:
                    passes[cid] = None if cost is None else cost[1]
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
        return accepted, failures

    def cached(self, messages: dict[int, Payload]) -> dict[int, Payload]:
        """The uploads in the cache for ``messages`` (client -> request); a client without one is left out.
        Nothing trains and nothing is counted."""
        if self.cache is None:
            return {}
        uploads = {cid: self.cache.get(self._key(cid, message)) for cid, message in messages.items()}
        return {cid: upload for cid, upload in uploads.items() if upload is not None}

    def _remote(self, round_: int, messages: dict[int, Payload], cacheable: bool, namespace: str
                ) -> tuple[dict[int, Payload], dict[int, str], dict[int, tuple[float, int] | None]]:
        """Through the transport; also returns each upload's client cost (the transport's ``costs``). A
        cacheable request a client already answered in this run (the same one-shot request from another
        method) is answered from memory, so every one-shot method gets the byte-identical upload and the
        client trains once; bytes and cost are counted as if sent, as with the local upload cache."""
        keys = {cid: (cid, m.sha256()) for cid, m in messages.items()}
        known = {cid: self._answered[k] for cid, k in keys.items() if cacheable and k in self._answered}
        todo = {c: m for c, m in messages.items() if c not in known}
        uploads, failures = self.transport.exchange(round_, todo, namespace) if todo else ({}, {})
        reported = getattr(self.transport, "costs", {}) if todo else {}
        costs = {cid: reported.get(cid) for cid in uploads}
        if cacheable:
            self._answered.update({keys[cid]: (up, costs[cid]) for cid, up in uploads.items()})
        return ({**uploads, **{c: up for c, (up, _) in known.items()}}, failures,
                {**costs, **{c: cost for c, (_, cost) in known.items()}})

    def _client(self, cid: int, message: Payload, round_: int, ledger: CommLedger,
                states: dict[int, dict], cacheable: bool, timing: dict[int, float] | None = None,
                bar: tqdm | None = None, trained: tuple[Payload, float, int] | None = None,
                direction: str = "up", passes: dict[int, int | None] | None = None) -> Payload:
        """One client call through the cache (``trained``: its upload, seconds and sample-passes from a
        group that trained together, :meth:`_train_groups`). Bytes are counted whether or not the upload
        was cached (the transfer would have happened); timing and sample-passes stay out of the payload,
        so that the bytes are the same with or without them."""
        exp = self.exp
        key = self._key(cid, message) if cacheable and self.cache else None
        upload = self.cache.get(key) if key and trained is None else None
        if upload is None:
            start = time.perf_counter()
            checkpoint = None
            if trained is not None:
                upload, seconds, samples = trained
            else:
                env = self._env(cid, states, bar)
                if key and self.checkpoint_every_s is not None:
                    checkpoint = env.checkpoint = TrainCheckpoint(self.cache.partial_path(key), self.checkpoint_every_s)
                prior = checkpoint.saved_seconds() if checkpoint else 0.0  # trained before a resume
                if prior:
                    log.warning("client %d: local training goes on from its checkpoint (%.0f s of it done "
                                "before): %s", cid, prior, checkpoint.path)
                with counting_sample_passes() as meter:
                    upload = handle(message, env)
                seconds, samples = prior + time.perf_counter() - start, sum(meter.values())
            if key:
                self.trained_uploads += 1
                # the thread count is recorded, not keyed: CPU kernels split their sums by thread,
                # so retraining with another count gives other bits (a cached upload is reused as is)
                self.cache.put(key, upload, {"fingerprint": self._fingerprint(cid), "request": message.meta,
                                             "request_tensors": sorted(message.tensors),
                                             "keyed_for": {"torch": torch.__version__, "device": exp.device.type},
                                             "seconds": seconds, "sample_passes": samples,
                                             "torch_threads": torch.get_num_threads(),
                                             **({"resumed_after_seconds": prior} if checkpoint and prior else {})})
            if checkpoint is not None:
                checkpoint.clear()
        else:  # report the time it took when it was trained, so cached methods show the same cost
            info = self.cache.info(key)
            seconds, samples = float(info.get("seconds", 0.0)), info.get("sample_passes")
            self.cached_calls += 1
        if timing is not None:
            timing[cid] = seconds
        if passes is not None:
            passes[cid] = samples
        ledger.add_payload(round_, cid, direction, upload)
        return upload

    def _train_groups(self, messages: dict[int, Payload], states: dict[int, dict], cacheable: bool,
                      bar: tqdm | None = None) -> dict[int, tuple[Payload, float, int]]:
        """With ``batch_clients``: the requests not in the cache whose :func:`group_key` they share with
        another, trained group by group (:func:`handle_group`); client -> (upload, seconds: an equal
        share of its group's, its own sample-passes)."""
        groups: dict[Any, list[int]] = {}
        for cid, message in messages.items():
            if cacheable and self.cache and self.cache.has(self._key(cid, message)):
                continue
            key = group_key(message, self._env(cid, states))
            if key is not None:
                groups.setdefault(key, []).append(cid)
        done: dict[int, tuple[Payload, float, int]] = {}
        for cids in (c for c in groups.values() if len(c) > 1):
            start = time.perf_counter()
            label = f"{cids[0]}-{cids[-1]} ({len(cids)} at once)"
            envs = [self._env(cid, states, bar, label) for cid in cids]
            with counting_sample_passes() as meter:
                uploads = handle_group([messages[cid] for cid in cids], envs)
            seconds = (time.perf_counter() - start) / len(cids)
            done.update({cid: (upload, seconds, meter[k]) for k, (cid, upload) in enumerate(zip(cids, uploads))})
        return done

    def _env(self, cid: int, states: dict[int, dict], bar: tqdm | None = None, label: str = "") -> ClientEnv:
        env = ClientEnv(cid, self.exp.client_data[cid], self.exp.device, states.setdefault(cid, {}),
                        data_root=self.exp.data_root or self.exp.cfg["data_root"])
        if bar is not None:
            env.progress = lambda epoch, loss: bar.set_postfix(client=label or cid, epoch=epoch, loss=f"{loss:.3f}")
        return env

    def _key(self, cid: int, message: Payload) -> str:
        return request_key(self._fingerprint(cid), message, self.exp.device)

    def _fingerprint(self, cid: int) -> dict[str, Any]:
        """What the cache keys a client's data by; batched training and flushed subnormals mark it
        (other bits)."""
        fingerprint = self.exp.fingerprint(cid)
        if self.batch_clients:
            fingerprint["batched"] = True
        if self.flush_denormal:
            fingerprint["flush_denormal"] = True
        return fingerprint
