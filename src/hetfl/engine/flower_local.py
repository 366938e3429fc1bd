"""``hetfl flower local``: a SuperLink and N SuperNodes on loopback, one run, then a clean stop.

Starts every process in its own session (so its children, the ServerApp and ClientApp
processes Flower spawns, are stopped with it), submits the run with ``flwr run``, streams its log,
polls ``flwr list`` until the run has really finished (``flwr run`` returns on submission),
reads the ``summary.json`` the ServerApp wrote, and stops everything it started, also on
Ctrl-C and on failure. Offline: update check, telemetry and runtime dependency installation
are off and ``FLWR_HOME`` is a temporary folder.

``tls=True`` makes a throw-away CA and a server certificate for 127.0.0.1/localhost;
``auth=True`` (implies TLS) also turns on SuperNode authentication and registers one EC P-384
key per SuperNode with ``flwr supernode register``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONNECTION = "hetfl"
OWNER = "owner.pid"  # in each federation's FLWR_HOME: the pid of the hetfl process that made it
HOME_PREFIX = "hetfl-flower-"
APP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "hetfl-flower-app"
version = "1.0.0"
description = "hetfl's generic Flower app: every hetfl method through one ServerApp and one ClientApp"
license = { file = "LICENSE" }
dependencies = ["flwr>=1.41,<1.42", "hetfl"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "hetfl"
fab-format-version = 1
flwr-version-target = "1.41.0"

[tool.flwr.app.components]
serverapp = "hetfl.engine.flower_app:server_app"
clientapp = "hetfl.engine.flower_app:client_app"

[tool.flwr.app.config]
hetfl-config = ""
out-dir = ""
data-root = ""
"""


class FlowerError(RuntimeError):
    """The Flower run could not start or did not complete."""


def flower_env(home: Path) -> dict[str, str]:
    """The environment of every Flower process we start: offline and isolated."""
    env = dict(os.environ)
    env.update(FLWR_HOME=str(home), FLWR_DISABLE_UPDATE_CHECK="1", FLWR_TELEMETRY_ENABLED="0",
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", PYTHONUNBUFFERED="1",
               # SuperExec asks for new app processes to start every 1 s by default
               FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.2")
    # the SuperLink and SuperNodes start flower-superexec / flwr-*app by name: use this venv's
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # the processes run in FLWR_HOME: a config's plugins importable from here must be importable there
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    return env


def processes_with_home(home: Path) -> list[int]:
    """PIDs of processes whose environment has ``FLWR_HOME=home`` (Linux /proc). Flower starts
    some helpers detached from our sessions (SuperExec); this finds them anyway."""
    want = f"FLWR_HOME={home}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if want in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return [p for p in pids if p != os.getpid()]


def live_processes_with_home(home: Path) -> list[int]:
    """:func:`processes_with_home` without zombies (exited, not yet reaped by their parent)."""
    return [pid for pid in processes_with_home(home) if _pid_alive(pid)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def binary(name: str) -> str:
    """A Flower console script next to this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if not found:
        raise FlowerError(f"{name} not found: install the Flower extra with pip install 'hetfl[flower]'")
    return found


# ---- certificates and keys -------------------------------------------------------------------
def make_certificates(folder: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                      days: int = 2) -> dict[str, Path]:
    """A CA and a server certificate/key for ``hosts`` (PEM files in ``folder``), valid ``days``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hetfl throw-away CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


def make_node_key(path: Path) -> Path:
    """An EC P-384 key pair for SuperNode authentication: ``path`` (private, PEM) and
    ``path.pub`` (public, OpenSSH format, what ``flwr supernode register`` takes)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    path = Path(path)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    pub = path.with_name(path.name + ".pub")
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                  serialization.PublicFormat.OpenSSH))
    return pub


def write_app(folder: Path, cfg: dict[str, Any], out_dir: Path, data_root: str) -> Path:
    """The Flower app folder ``flwr run`` submits: ``pyproject.toml`` naming hetfl's generic
    ServerApp/ClientApp, a LICENSE, and ``run-config.toml`` carrying the experiment config.
    ``out_dir`` and ``data_root`` are paths on the machine that runs the ServerApp."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(APP_PYPROJECT)
    (folder / "LICENSE").write_text("hetfl is licensed under the Apache License, Version 2.0.\n")
    (folder / "run-config.toml").write_text(f"hetfl-config = {json.dumps(json.dumps(cfg))}\n"
                                            f"out-dir = {json.dumps(str(Path(out_dir).resolve()))}\n"
                                            f"data-root = {json.dumps(str(Path(data_root).resolve()))}\n")
    return folder


# ---- the local federation ----------------------------------------------------------------------
@dataclass
class LocalFederation:
    """A SuperLink and SuperNodes on 127.0.0.1 with their own ``FLWR_HOME``."""

    num_nodes: int
    tls: bool = False
    client_data: list[str] | None = None  # one folder per SuperNode, which serves it as its own data
    auth: bool = False
    data_root: str | None = None
    log: Callable[[str], None] = print
    home: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix=HOME_PREFIX)))
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    port: int = 0
    certs: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.auth:
            self.tls = True  # Flower's node authentication needs TLS
        self.env = flower_env(self.home)
        self.logs = self.home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    # processes
    def _start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.home)
        self.procs[name] = proc
        return proc

    def _security(self, node: bool) -> list[str]:
        if not self.tls:
            return ["--insecure"]
        if node:
            return ["--root-certificates", str(self.certs["ca"])]
        return ["--ssl-ca-certfile", str(self.certs["ca"]), "--ssl-certfile", str(self.certs["cert"]),
                "--ssl-keyfile", str(self.certs["key"])]

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([binary("flwr"), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=self.home)

    def start_superlink(self) -> None:
        if self.tls:
            self.certs = make_certificates(self.home / "certificates")
        self.port = free_port()
        cmd = [binary("flower-superlink"), *self._security(node=False), "--host", "127.0.0.1",
               "--port", str(self.port), "--disable-runtime-dependency-installation"]
        if self.auth:
            cmd.append("--enable-supernode-auth")
        self._start("superlink", cmd)
        conn = [f"[superlink]\ndefault = \"{CONNECTION}\"\n\n[superlink.{CONNECTION}]",
                f"address = \"127.0.0.1:{self.port}\""]
        conn.append(f"root-certificates = \"{self.certs['ca']}\"" if self.tls else "insecure = true")
        (self.home / "config.toml").write_text("\n".join(conn) + "\n")
        self._wait_port(self.port, "superlink")

    def _wait_port(self, port: int, name: str, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise FlowerError(f"{name} exited with {self.procs[name].returncode}:\n{self.tail(name)}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise FlowerError(f"{name} did not open port {port} in {seconds:g} s:\n{self.tail(name)}")

    def start_supernode(self, pid: int, name: str | None = None, register: bool = True,
                        extra: list[str] | None = None) -> subprocess.Popen:
        """SuperNode holding partition ``pid``; with ``auth``, a fresh key registered (or not)."""
        name = name or f"supernode-{pid}"
        node_config = f"partition-id={pid} num-partitions={self.num_nodes}"
        if self.client_data:
            node_config = f"data-dir='{Path(self.client_data[pid]).resolve()}' partition-id={pid}"
        if self.data_root:
            node_config += f" data-root='{Path(self.data_root).resolve()}'"
        cmd = [binary("flower-supernode"), *self._security(node=True), "--superlink", f"127.0.0.1:{self.port}",
               "--port", str(free_port()), "--node-config", node_config, *(extra or [])]
        if self.auth:
            key = self.home / "keys" / name
            key.parent.mkdir(exist_ok=True)
            pub = make_node_key(key)
            if register:
                done = self.flwr("supernode", "register", str(pub), CONNECTION)
                if done.returncode != 0:
                    raise FlowerError(f"flwr supernode register failed: {done.stdout}{done.stderr}")
            cmd += ["--auth-supernode-private-key", str(key)]
        return self._start(name, cmd)

    def start(self) -> None:
        self.start_superlink()
        for pid in range(self.num_nodes):
            self.start_supernode(pid)

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""

    def kill(self, *names: str, grace: float = 5.0) -> None:
        """Stop processes and their children: SIGTERM to every group at once, SIGKILL to the
        groups still running after ``grace`` seconds."""
        procs = [self.procs[n] for n in names if n in self.procs and self.procs[n].poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
            deadline = time.monotonic() + grace
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)
        for proc in procs:  # children that outlived their parent
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        self.kill(*[n for n in self.procs if n != "superlink"])
        self.kill("superlink")
        for sig in (signal.SIGTERM, signal.SIGKILL):  # detached helpers (SuperExec, app processes)
            pids = processes_with_home(self.home)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 5
            while pids and time.monotonic() < deadline:
                time.sleep(0.1)
                pids = processes_with_home(self.home)
        for proc in self.procs.values():  # reap our direct children
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)

    def alive(self) -> list[int]:
        """PIDs of any process of this federation still running (zombies excluded)."""
        return live_processes_with_home(self.home)

    # runs
    def submit(self, cfg: dict[str, Any], out_dir: Path, data_root: str) -> int:
        app = write_app(self.home / "app", cfg, out_dir, data_root)
        done = self.flwr("run", str(app), CONNECTION, "--run-config", str(app / "run-config.toml"),
                         "--format", "json")
        try:
            return int(json.loads(done.stdout)["run-id"])
        except (ValueError, KeyError) as err:
            raise FlowerError(f"flwr run failed ({done.returncode}): {done.stdout}{done.stderr}") from err

    def run_info(self, run_id: int) -> dict[str, Any]:
        """``flwr list --run-id`` as a dictionary (status, network traffic, compute time)."""
        done = self.flwr("list", CONNECTION, "--run-id", str(run_id), "--format", "json")
        try:
            return dict(json.loads(done.stdout)["runs"][0])
        except (ValueError, KeyError, IndexError, TypeError):
            return {}

    def stream(self, run_id: int) -> subprocess.Popen:
        """Forward the run's log (``flwr log --stream``) to ``self.log`` from a thread."""
        proc = subprocess.Popen([binary("flwr"), "log", str(run_id), CONNECTION, "--stream"], env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, cwd=self.home)
        self.procs["log"] = proc

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.log(line.rstrip())

        threading.Thread(target=pump, daemon=True).start()
        return proc

    def wait(self, run_id: int, timeout: float, poll: float = 30.0, settle: float = 3.0) -> dict[str, Any]:
        """Wait until the run has finished; return its final ``run_info`` (``["status"]`` is the
        status). Each ``flwr list`` is a CLI start-up (about 2 s of CPU), which competes with the
        ClientApps for the cores, so while the log stream runs the status is asked only every
        ``poll`` s (a fallback: the stream ends when the run does); once it has ended, or when there
        is no stream, every ``settle`` s."""
        deadline = time.monotonic() + timeout
        stream = self.procs.get("log")
        interval = poll if stream is not None else settle
        info: dict[str, Any] = {}
        next_poll = time.monotonic() + interval
        while time.monotonic() < deadline:
            if stream is not None and stream.poll() is not None:
                stream, interval, next_poll = None, settle, time.monotonic()
            if time.monotonic() >= next_poll:
                info = self.run_info(run_id)
                if str(info.get("status", "")).startswith("finished"):
                    return info
                next_poll = time.monotonic() + interval
            if self.procs["superlink"].poll() is not None:
                raise FlowerError(f"the SuperLink died:\n{self.tail('superlink')}")
            time.sleep(0.1)
        last = info.get("status", "unknown")
        raise FlowerError(f"run {run_id} did not finish in {timeout:g} s (last status {last!r})")


def remote_refusals(cfg: dict[str, Any]) -> list[str]:
    """The config's methods that only the in-process simulator can run (``runs_remotely = False``)."""
    from hetfl.fl.method import create_method

    return [label for label, params in cfg["methods"].items()
            if not getattr(create_method(label, params), "runs_remotely", True)]


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def remove_federation(home: Path) -> None:
    """Kill every process of the federation at ``home`` and delete the folder (its TLS keys)."""
    for _ in range(3):
        for pid in processes_with_home(home):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    shutil.rmtree(home, ignore_errors=True)


def clean_stale_homes(tmp: Path | None = None) -> list[Path]:
    """Remove the federations a killed ``hetfl flower local`` left behind (owner process gone)."""
    removed = []
    for home in sorted(Path(tmp or tempfile.gettempdir()).glob(f"{HOME_PREFIX}*")):
        try:
            owner = int((home / OWNER).read_text())
        except (OSError, ValueError):
            continue
        if not _pid_alive(owner):
            remove_federation(home)
            removed.append(home)
    return removed


def watch(parent: int, home: Path, every: float = 0.5) -> None:
    """The watchdog of one federation: when ``parent`` is gone (kill -9 included) kill every process
    of the federation and delete ``home``; exit when ``home`` is gone (a normal stop removed it)."""
    while home.exists():
        if not _pid_alive(parent):
            remove_federation(home)
            return
        time.sleep(every)


def start_watchdog(home: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "FLWR_HOME"}
    return subprocess.Popen([sys.executable, "-m", "hetfl.engine.flower_local", "--watch", str(os.getpid()),
                             str(home)], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def run_local(cfg: dict[str, Any], out_dir: Path, num_nodes: int | None = None, tls: bool = False,
              auth: bool = False, data_root: str | None = None, timeout: float = 3600,
              log: Callable[[str], None] = print,
              on_started: Callable[[LocalFederation, int], None] | None = None,
              client_data: list[str] | None = None) -> dict[str, Any]:
    """Run ``cfg`` on a loopback federation; return the ServerApp's ``summary.json``.
    ``on_started(federation, run_id)`` runs after submission (fault-injection hook for tests);
    ``client_data``: one folder per SuperNode, served as its own data (``cfg``'s flower.node_data)."""
    if client_data:
        missing = [d for d in client_data if not (Path(d) / "train").is_dir()]
        if missing:
            raise ValueError(f"--client-data {missing[0]}: no train/ folder (expected {missing[0]}/train/<class>/...)")
        if any("'" in str(Path(d).resolve()) for d in client_data):
            raise ValueError("--client-data: a folder path with a quote (') cannot go into a node config")
        cfg = {**cfg, "clients": len(client_data), "flower": {**cfg["flower"], "node_data": True}}
        if isinstance(cfg["dataset"], dict):  # the ServerApp runs in the federation's folder
            cfg["dataset"] = {**cfg["dataset"], "path": str(Path(cfg["dataset"]["path"]).expanduser().resolve())}
    num_nodes = num_nodes or int(cfg["clients"])
    if num_nodes != cfg["clients"]:
        raise ValueError(f"--clients {num_nodes} differs from the config's clients: {cfg['clients']}; "
                         "each SuperNode holds one client's partition")
    refused = remote_refusals(cfg)
    if refused:
        raise ValueError(f"methods {refused} read the clients' raw data on the server, which only the "
                         "in-process simulator (hetfl run) has; leave them out (--methods) to run on Flower")
    for home in clean_stale_homes():
        log(f"hetfl flower: removed {home}, left by a stopped run")
    data_root = data_root or cfg["data_root"]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").unlink(missing_ok=True)
    fed = LocalFederation(num_nodes, tls=tls, auth=auth, client_data=client_data, data_root=data_root, log=log)
    (fed.home / OWNER).write_text(str(os.getpid()))
    watchdog = start_watchdog(fed.home)
    try:
        fed.start()
        log(f"hetfl flower: SuperLink on 127.0.0.1:{fed.port} ({'TLS' if fed.tls else 'insecure'}"
            f"{', node authentication' if fed.auth else ''}), {num_nodes} SuperNodes, FLWR_HOME {fed.home}")
        run_id = fed.submit(cfg, out_dir, data_root)
        log(f"hetfl flower: run {run_id} submitted")
        fed.stream(run_id)
        if on_started is not None:
            on_started(fed, run_id)
        info = fed.wait(run_id, timeout)
        status = str(info["status"])
        summary_path = out_dir / "summary.json"
        if status != "finished:completed" or not summary_path.is_file():
            raise FlowerError(f"run {run_id} ended with status {status!r}; SuperLink log:\n{fed.tail('superlink')}")
        summary = json.loads(summary_path.read_text())
        summary.setdefault("engine", {}).update(run_id=run_id, status=status, tls=fed.tls, auth=fed.auth,
                                                network_traffic=info.get("network-traffic"),
                                                compute_time=info.get("compute-time"))
        summary_path.write_text(json.dumps(summary, indent=1))
        return summary
    finally:
        fed.stop()
        left = fed.alive()
        if left:
            log(f"hetfl flower: could not stop {left}")
        shutil.rmtree(fed.home, ignore_errors=True)
        with contextlib.suppress(subprocess.TimeoutExpired):
            watchdog.wait(timeout=5)  # it sees the folder gone and exits


if __name__ == "__main__":  # the watchdog: python -m hetfl.engine.flower_local --watch PARENT_PID HOME
    if len(sys.argv) == 4 and sys.argv[1] == "--watch":
        watch(int(sys.argv[2]), Path(sys.argv[3]))
