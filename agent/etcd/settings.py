"""How to reach etcd: endpoints, TLS and credentials, validated up front.

Everything a user can get wrong (a typo in a path, a password on the command line) is
caught here, before any connection is tried, and reported as one :class:`EtcdConfigError`
line that names the problem and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from elastic import contract

DEFAULT_PORT = 2379


class EtcdConfigError(ValueError):
    """A setting the user can fix; the message is the one line they will read."""


@dataclass(frozen=True)
class EtcdSettings:
    """Connection settings for an etcd v3 cluster.

    Several endpoints give failover: a request that fails on one member is retried on the
    next. The password never travels on a command line (it would show in ``ps``); it comes
    from ``ELASTIC_ETCD_PASSWORD`` or a file.
    """

    endpoints: tuple[tuple[str, int], ...]
    cacert: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    request_timeout: float = 5.0

    @property
    def secure(self) -> bool:
        return self.cacert is not None

    def describe(self) -> str:
        """Endpoints as a user typed them, for error messages."""
        scheme = "https" if self.secure else "http"
        return ",".join(f"{scheme}://{host}:{port}" for host, port in self.endpoints)


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """Parse ``host[:port][,host[:port]...]``, tolerating ``http(s)://`` prefixes."""
    endpoints: list[tuple[str, int]] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        item = item.rstrip("/")
        if item.startswith("["):  # [ipv6]:port
            host, _, rest = item[1:].partition("]")
            port_text = rest.lstrip(":")
        elif item.count(":") == 1:
            host, port_text = item.split(":")
        else:
            host, port_text = item, ""
        try:
            port = int(port_text) if port_text else DEFAULT_PORT
        except ValueError:
            raise EtcdConfigError(
                f"etcd endpoint {raw.strip()!r} has a bad port; use HOST:PORT, e.g. 10.0.0.5:2379"
            ) from None
        if not host or not 0 < port < 65536:
            raise EtcdConfigError(
                f"etcd endpoint {raw.strip()!r} is not HOST:PORT; use e.g. 10.0.0.5:2379"
            )
        endpoints.append((host, port))
    if not endpoints:
        raise EtcdConfigError(
            "no etcd endpoint given; pass --rdzv-endpoint HOST:PORT[,HOST:PORT...]"
        )
    return tuple(endpoints)


def _readable_file(value: str | os.PathLike[str] | None, what: str, flag: str) -> Path | None:
    if value in (None, ""):
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise EtcdConfigError(f"{what} file {str(path)!r} does not exist; fix {flag}")
    if not os.access(path, os.R_OK):
        raise EtcdConfigError(f"{what} file {str(path)!r} is not readable; fix its permissions")
    return path


def read_password(
    password_file: str | None, env: Mapping[str, str] | None = None
) -> str | None:
    """The etcd password from ``password_file``, ``ELASTIC_ETCD_PASSWORD(_FILE)``, or none."""
    env = os.environ if env is None else env
    file_value = password_file or env.get(contract.ETCD_PASSWORD_FILE_ENV)
    if file_value:
        path = _readable_file(file_value, "etcd password", "password_file")
        assert path is not None
        return path.read_text().strip("\r\n")
    return env.get(contract.ETCD_PASSWORD_ENV) or None


def settings_from_options(
    endpoint: str,
    options: Mapping[str, str],
    env: Mapping[str, str] | None = None,
) -> EtcdSettings:
    """Build settings from torchrun's ``--rdzv-endpoint`` and ``--rdzv-conf`` options."""
    if "password" in options:
        raise EtcdConfigError(
            "refusing an etcd password on the command line (it shows in ps); "
            f"set {contract.ETCD_PASSWORD_ENV} or --rdzv-conf password_file=PATH instead"
        )
    cacert = _readable_file(options.get("cacert"), "etcd CA certificate", "cacert=")
    cert = _readable_file(options.get("cert"), "etcd client certificate", "cert=")
    key = _readable_file(options.get("key"), "etcd client key", "key=")
    if (cert is None) != (key is None):
        raise EtcdConfigError("etcd client TLS needs both cert= and key=; one is missing")
    if cert is not None and cacert is None:
        raise EtcdConfigError("etcd client certificates need cacert= (the CA that signed etcd's cert)")
    user = options.get("user") or None
    password = read_password(options.get("password_file"), env)
    if user and password is None:
        raise EtcdConfigError(
            f"etcd user {user!r} given without a password; set {contract.ETCD_PASSWORD_ENV} "
            "or --rdzv-conf password_file=PATH"
        )
    if password is not None and not user:
        raise EtcdConfigError("an etcd password is set but no user; add --rdzv-conf user=NAME")
    timeout_text = options.get("request_timeout", "5")
    try:
        request_timeout = float(timeout_text)
    except ValueError:
        raise EtcdConfigError(f"request_timeout={timeout_text!r} is not a number of seconds") from None
    if request_timeout <= 0:
        raise EtcdConfigError("request_timeout must be positive (seconds)")
    return EtcdSettings(
        endpoints=parse_endpoints(endpoint),
        cacert=cacert,
        cert=cert,
        key=key,
        user=user,
        password=password,
        request_timeout=request_timeout,
    )
