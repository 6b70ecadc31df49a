"""Nodes on their own network: a bridge, one network namespace per node, real faults.

:class:`NodeNetwork` builds, as root, a Linux bridge in the root namespace with one
address (the *central* address: etcd, a Prometheus, the test itself live there) and one
namespace per node, joined to the bridge by a veth pair. Each namespace has ``lo`` up,
one IPv4 address on ``eth0`` in a private /24 (no IPv6 addresses, not even link-local),
and **no default route**: it can reach the bridge and its peers and nothing else. Faults
are real network faults:

* :meth:`NodeNetwork.partition`: the node's link goes down (its veth end on the bridge),
  as when a switch port drops; :meth:`NodeNetwork.heal` brings it back.
* :meth:`NodeNetwork.cut_from_peers` / :meth:`NodeNetwork.cut_from_central`: blackhole
  routes inside the node's namespace, so it loses its peers but not etcd, or etcd (and
  everything else in the root namespace) but not its peers.

Facts established on the development machine (a Firecracker microVM running a real Linux
6.18 kernel; ``/etc/hosts`` names it ``runsc`` too, but the network stack is Linux's):

* ``ip netns``, veth pairs, a bridge, link down/up and blackhole routes all work as root;
  ``tc qdisc ... netem`` fails ("Specified qdisc kind is unknown"); there is no ``ping``
  or ``iptables``. The root namespace has ``ip_forward`` 0, so even a misrouted packet
  from a namespace could not be forwarded out through ``eth0``.
* ``ip netns exec NS cmd`` execs ``cmd``: the pid ``Popen`` returns is the command's own,
  so SIGKILL/SIGSTOP of that process tree stays node loss / a frozen node.
* A *partition* (host-side veth down): inside the namespace the link shows NO-CARRIER and
  its route stays, marked ``linkdown``. An established TCP connection does not error:
  ``send`` of a little data returns at once (it is buffered) and ``recv`` blocks until its
  timeout; a new ``connect`` from the node fails with EHOSTUNREACH after about 1 s (the
  neighbour entry fails), and a ``connect`` to the node from outside times out. After the
  link comes back, a blocked connection carries on at its next retransmission (within
  about 0.1 s of the heal with a 5 s cut), as on a real network.
* A *blackhole* route to an address: ``connect`` from the node fails at once with EINVAL;
  ``connect`` to the node from that address times out (its SYN arrives, the SYN-ACK is
  dropped); established connections hang both ways, as above, and resume after the route
  is deleted (at the next retransmission, ~1.6 s later after a 5 s cut).
* So a cut-off process is never told: it learns only from its own timeouts. That is why
  a node must judge its etcd lease by its own clock (issue 19).

Cleanup: :meth:`NodeNetwork.close` (also run by the context manager, ``atexit``, and a
handler for SIGTERM/SIGINT where they would kill the process outright) kills processes
still inside the namespaces, then removes veths, bridge and namespaces. Every name starts
``et<owner pid>x<instance>``, so :func:`sweep` (run at each start) removes what dead owners
left behind and never touches a live run's.
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Iterator, Sequence

from checkpoints.pids import pid_alive

from agent.local.netns_names import (
    DEFAULT_POOL, Names, NetnsNameError, central_addr, node_addr, owner_pid, pick_subnet,
)

log = logging.getLogger(__name__)

NODE_IFNAME = "eth0"  # the node-side veth, renamed inside its namespace to look like a host's NIC
IP_TIMEOUT = 10.0  # one `ip` call; they take milliseconds
_LOCK = Path(tempfile.gettempdir()) / "elastic-netns.lock"
_instances = itertools.count(1)  # instance 0 is the availability probe's
_live: "weakref.WeakSet[NodeNetwork]" = weakref.WeakSet()
_hooks_installed = False


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message carries its stderr."""


@dataclass(frozen=True)
class Namespace:
    """One node's network namespace: its name, address and interfaces."""

    node: str
    name: str
    addr: str
    host_link: str  # veth end on the bridge (root namespace)
    ifname: str = NODE_IFNAME  # veth end inside the namespace

    def prefix(self) -> list[str]:
        """Prepend to a command to run it inside; ``ip netns exec`` execs, keeping the pid."""
        return ["ip", "netns", "exec", self.name]

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        return [*self.prefix(), *cmd]


@dataclass(frozen=True)
class ProbeResult:
    """One bounded TCP connect: did it get through, and if not, how did it fail."""

    ok: bool
    error: str  # "" when ok; else e.g. "TimeoutError", "OSError: [Errno 22] Invalid argument"
    seconds: float


_PROBE = """
import socket, sys, time, json
t = time.monotonic()
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    err = ""
except OSError as e:
    err = type(e).__name__ if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
print(json.dumps({"error": err, "seconds": time.monotonic() - t}))
"""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise :class:`NetnsError` with its stderr when ``check``."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done


@dataclass(eq=False)  # identity semantics: it is kept in a WeakSet
class NodeNetwork:
    """A bridge and one namespace per node. Use as a context manager (or start/close).

    ``nodes`` are node names (or a count: ``n0``, ``n1``...). ``pool`` is the range a free
    /24 is chosen from, one that overlaps no route or address already on the machine.
    """

    nodes: Sequence[str] | int
    pool: ipaddress.IPv4Network = DEFAULT_POOL
    names: Names = field(default_factory=lambda: Names(os.getpid(), next(_instances)))
    subnet: ipaddress.IPv4Network | None = None
    namespaces: dict[str, Namespace] = field(default_factory=dict)
    _down: set[str] = field(default_factory=set)  # nodes whose link is down
    _holes: dict[str, set[str]] = field(default_factory=dict)  # node -> blackholed addresses
    _closed: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.nodes, int):
            self.nodes = [f"n{i}" for i in range(self.nodes)]
        if len(set(self.nodes)) != len(self.nodes):
            raise NetnsNameError(f"node names must be distinct: {list(self.nodes)}")
        for index, node in enumerate(self.nodes):  # validate every name before touching the system
            self.names.namespace(node)
            self.names.node_link(index)  # as long as host_link(index), the longest
        _ = self.names.bridge

    # -- addresses ---------------------------------------------------------------------
    @property
    def bridge(self) -> str:
        return self.names.bridge

    @property
    def central_addr(self) -> str:
        """The root namespace's address on the bridge: where etcd should listen."""
        assert self.subnet is not None, "start() first"
        return central_addr(self.subnet)

    def __getitem__(self, node: str) -> Namespace:
        return self.namespaces[node]

    def __iter__(self) -> Iterator[Namespace]:
        return iter(self.namespaces.values())

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "NodeNetwork":
        _install_hooks()
        _live.add(self)
        try:
            with _locked():  # sweep, pick and claim the subnet atomically among harnesses
                sweep()
                self.subnet = pick_subnet(_used_networks(), seed=self.names.pid * 7 + self.names.instance,
                                          pool=self.pool)
                ip("link", "add", self.bridge, "type", "bridge")
                ip("link", "set", self.bridge, "addrgenmode", "none")  # no IPv6 link-local: IPv4 only
                ip("addr", "add", f"{self.central_addr}/{self.subnet.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for index, node in enumerate(self.nodes):  # type: ignore[arg-type]  # names: __post_init__ made them
                self._add_node(index, node)
        except BaseException:
            self.close()
            raise
        return self

    def _add_node(self, index: int, node: str) -> None:
        assert self.subnet is not None
        ns = Namespace(node=node, name=self.names.namespace(node), addr=node_addr(self.subnet, index),
                       host_link=self.names.host_link(index))
        peer = self.names.node_link(index)  # its name until it is inside, renamed to eth0
        ip("netns", "add", ns.name)
        self.namespaces[node] = ns  # recorded at once, so close() removes it even if a step fails
        ip("link", "add", ns.host_link, "type", "veth", "peer", "name", peer, "netns", ns.name)
        ip("-n", ns.name, "link", "set", peer, "name", ns.ifname)
        ip("-n", ns.name, "link", "set", ns.ifname, "addrgenmode", "none")
        ip("link", "set", ns.host_link, "addrgenmode", "none")
        ip("-n", ns.name, "addr", "add", f"{ns.addr}/{self.subnet.prefixlen}", "dev", ns.ifname)
        ip("-n", ns.name, "link", "set", ns.ifname, "up")
        ip("-n", ns.name, "link", "set", "lo", "up")
        ip("link", "set", ns.host_link, "master", self.bridge)
        ip("link", "set", ns.host_link, "up")

    def close(self) -> None:
        """Kill what still runs inside, remove veths, bridge and namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        for ns in self.namespaces.values():
            _kill_inside(ns.name)
            ip("link", "del", ns.host_link, check=False)  # deleting one end removes the pair
        ip("link", "del", self.bridge, check=False)
        for ns in self.namespaces.values():
            ip("netns", "del", ns.name, check=False)

    def __enter__(self) -> "NodeNetwork":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running things inside ---------------------------------------------------------
    def popen(self, node: str, cmd: Sequence[str], **kwargs: Any) -> "subprocess.Popen[Any]":
        """Start ``cmd`` inside ``node``'s namespace; the returned pid is ``cmd``'s own."""
        return subprocess.Popen(self[node].wrap(cmd), **kwargs)

    def probe(self, src: str | None, host: str, port: int, timeout: float = 1.0) -> ProbeResult:
        """One TCP connect to ``host:port`` from ``src``'s namespace (None: the root one),
        bounded by ``timeout``; what a node would see if it tried now."""
        cmd = [sys.executable, "-c", _PROBE, host, str(port), str(timeout)]
        if src is not None:
            cmd = self[src].wrap(cmd)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30)
        if done.returncode != 0:
            raise NetnsError(f"probe from {src or 'root'} failed to run: {done.stderr.strip()}")
        result = json.loads(done.stdout)
        return ProbeResult(ok=not result["error"], error=result["error"], seconds=result["seconds"])

    # -- faults ------------------------------------------------------------------------
    def partition(self, node: str) -> None:
        """Full partition: ``node``'s link goes down; it reaches nothing, nothing reaches it."""
        ip("link", "set", self[node].host_link, "down")
        self._down.add(node)

    def cut_from_peers(self, node: str, peers: Sequence[str] | None = None) -> None:
        """``node`` loses ``peers`` (default: every other node) but still reaches central."""
        for peer in peers if peers is not None else [n for n in self.namespaces if n != node]:
            self._blackhole(node, self[peer].addr)

    def cut_from_central(self, node: str) -> None:
        """``node`` loses the root namespace (etcd, scrapers, the test) but keeps its peers."""
        self._blackhole(node, self.central_addr)

    def heal(self, node: str) -> None:
        """Undo every fault on ``node``: link up, blackhole routes gone."""
        for addr in sorted(self._holes.pop(node, set())):
            ip("-n", self[node].name, "route", "del", "blackhole", f"{addr}/32", check=False)
        if node in self._down:
            ip("link", "set", self[node].host_link, "up")
            self._down.discard(node)

    def heal_all(self) -> None:
        for node in list(self.namespaces):
            self.heal(node)

    def faults(self, node: str) -> list[str]:
        """What is cut on ``node`` now, e.g. ``["partition"]`` or ``["blackhole 10.233.5.1"]``."""
        return (["partition"] if node in self._down else []) + \
            [f"blackhole {addr}" for addr in sorted(self._holes.get(node, set()))]

    def _blackhole(self, node: str, addr: str) -> None:
        holes = self._holes.setdefault(node, set())
        if addr not in holes:
            ip("-n", self[node].name, "route", "add", "blackhole", f"{addr}/32")
            holes.add(addr)


# -- sweeping and availability ---------------------------------------------------------------
def _namespace_names() -> list[str]:
    done = ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    done = ip("-j", "link", "show", check=False)
    try:
        return [link["ifname"] for link in json.loads(done.stdout or "[]")]
    except (ValueError, KeyError):
        return []


def _kill_inside(namespace: str) -> None:
    """SIGKILL what still runs in one of our namespaces (its owner started it there)."""
    done = ip("netns", "pids", namespace, check=False)
    for pid in (int(p) for p in done.stdout.split() if p.isdigit()):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def sweep() -> list[str]:
    """Remove namespaces, veths and bridges whose owner pid is dead; return their names."""
    removed = []
    for name in _link_names():  # veths first (each takes its peer along), then bridges
        pid = owner_pid(name)
        if pid is not None and not pid_alive(pid) and not name.endswith("b"):
            if ip("link", "del", name, check=False).returncode == 0:
                removed.append(name)
    for name in _link_names():
        pid = owner_pid(name)
        if pid is not None and not pid_alive(pid):
            if ip("link", "del", name, check=False).returncode == 0:
                removed.append(name)
    for name in _namespace_names():
        pid = owner_pid(name)
        if pid is not None and not pid_alive(pid):
            _kill_inside(name)
            if ip("netns", "del", name, check=False).returncode == 0:
                removed.append(name)
    if removed:
        log.info("netns: swept %d leftovers of dead runs: %s", len(removed), " ".join(removed))
    return removed


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 route destination (all tables) and interface address on the machine."""
    used: list[ipaddress.IPv4Network] = []
    routes = json.loads(ip("-j", "-4", "route", "show", "table", "all").stdout or "[]")
    for route in routes:
        dst = route.get("dst", "")
        if dst and dst != "default":
            used.append(ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False))
    for link in json.loads(ip("-j", "-4", "addr", "show").stdout or "[]"):
        for info in link.get("addr_info", []):
            used.append(ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}", strict=False))
    return used


def _locked() -> "_FileLock":
    return _FileLock(_LOCK)


class _FileLock:
    """An exclusive ``flock`` on a file shared by every harness on the machine."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> "_FileLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + 30
        while True:  # bounded: another harness holds it for milliseconds
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise NetnsError(f"{self.path} stayed locked for 30 s; is another harness stuck?") from None
                time.sleep(0.01)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


_reason: list[str | None] = []  # cached unavailable_reason()


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here (None: they can). Tries it once, for real."""
    if _reason:
        return _reason[0]
    if os.geteuid() != 0:
        reason: str | None = f"network namespaces need root, and this process runs as uid {os.geteuid()}"
    elif shutil.which("ip") is None:
        reason = "iproute2's `ip` is not installed (apt-get install iproute2)"
    else:
        reason = None
        try:
            with NodeNetwork(["probe"], names=Names(os.getpid(), 0)):
                pass
        except (NetnsError, OSError, subprocess.SubprocessError) as exc:
            reason = f"cannot build a bridge, veth pair and namespace here: {exc}"
    _reason.append(reason)
    return reason


# -- cleanup on exit and on signals ----------------------------------------------------------
def close_all() -> None:
    for network in list(_live):
        try:
            network.close()
        except Exception as exc:  # noqa: BLE001 - cleanup must go on to the next one
            print(f"netns: cleanup of {network.names.tag} failed: {exc}", file=sys.stderr)


def _install_hooks() -> None:
    """Once per process: close every live network at exit, and on a SIGTERM or SIGINT that
    would otherwise end the process without unwinding.

    Only a signal left at ``SIG_DFL`` gets our handler (close, then die of the signal as
    before). Python's own SIGINT handler raises KeyboardInterrupt, which unwinds through
    the context manager and ends in ``atexit``; an application's own handler (``elastic
    local``'s Ctrl-C flag) is its way to shut down in order, so it is left alone.
    """
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(close_all)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still runs
    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _close_and_die)


def _close_and_die(signum: int, frame: FrameType | None) -> None:
    close_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
