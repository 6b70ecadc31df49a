"""Which network interface the workers' collectives should bind: ``GLOO_SOCKET_IFNAME``.

Without ``GLOO_SOCKET_IFNAME``, torch's gloo binds the first address the *hostname*
resolves to. On stock Debian and Ubuntu hosts (``127.0.1.1`` in ``/etc/hosts``), in many
containers, and on this project's development machine, that is loopback: every node then
advertises ``127.0.0.1`` and a job that spans nodes fails in its first collective with
``Gloo connectFullMesh failed ... remote=[127.0.0.1]``. The agent knows better: it reaches
etcd from some address, and the interface holding that address is the one its peers can
reach. :func:`socket_ifname_env` is the decision (pure); the rest are the look-ups it needs,
all without sending a packet and without new dependencies.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct
from pathlib import Path
from typing import Iterable, Mapping

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"
IFNAME_VARS = (GLOO_IFNAME, NCCL_IFNAME)

SIOCGIFCONF = 0x8912
IFREQ_SIZE = 40  # sizeof(struct ifreq) on 64-bit Linux: 16-byte name + 24-byte union
MAX_IFREQS = 4096


# -- the decision ---------------------------------------------------------------------------
def socket_ifname_env(
    env: Mapping[str, str],
    local_addr: str | None,
    spans_nodes: bool,
    *,
    hostname_loopback: bool,
    ifname: str | None,
) -> tuple[dict[str, str], str | None]:
    """The ``*_SOCKET_IFNAME`` variables to add to the workers' environment, and one line to log.

    ``local_addr`` is the address this node's peers reach it at (``--local-addr``, or the
    one it reaches etcd from); ``ifname`` the interface holding it. Nothing changes when the
    job stays on one node, when the hostname already resolves to a routable address (gloo's
    own choice is then right), or when ``local_addr`` is loopback (all nodes on one machine,
    where loopback is right). A variable the user set is never overridden.
    """
    if not spans_nodes or not hostname_loopback:
        return {}, None
    user = {name: env[name] for name in IFNAME_VARS if env.get(name)}
    missing = [name for name in IFNAME_VARS if name not in user]
    if not missing:
        return {}, None
    if local_addr is None:
        return {}, ("this host's name resolves to loopback and the node's address is unknown, so gloo "
                    f"would advertise 127.0.0.1 to its peers; pass --local-addr or set {GLOO_IFNAME}")
    if ipaddress.ip_address(local_addr).is_loopback:
        return {}, None
    if ifname is None:
        return {}, (f"this host's name resolves to loopback and no interface holds {local_addr}; "
                    f"set {GLOO_IFNAME} to the interface peers reach this node on")
    kept = "".join(f"; keeping the user's {name}={value}" for name, value in user.items())
    line = (f"workers' collectives use {ifname} ({local_addr}): this host's name resolves to loopback, "
            f"which peers on other nodes cannot reach; set {' and '.join(f'{n}={ifname}' for n in missing)}{kept}")
    return {name: ifname for name in missing}, line


def spans_nodes(nnodes: str) -> bool:
    """Whether torchrun's ``--nnodes`` (``N`` or ``MIN:MAX``) allows more than one node."""
    try:
        return int(str(nnodes).split(":")[-1]) > 1
    except ValueError:
        return True  # torchrun rejects it later; assume the general case meanwhile


# -- look-ups (I/O) -------------------------------------------------------------------------
def route_source(host: str, port: int) -> str:
    """The local address this node would use to reach ``host:port``.

    A routing lookup: ``connect`` on a UDP socket picks the route and the source address
    but sends nothing. Raises OSError when there is no route (e.g. ENETUNREACH).
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr)
        return str(sock.getsockname()[0])


def local_address(endpoints: Iterable[tuple[str, int]]) -> str | None:
    """The address this node reaches the first routable endpoint (etcd) from, else None."""
    for host, port in endpoints:
        try:
            return route_source(host, port)
        except OSError:
            continue
    return None


def interface_of(addr: str) -> str | None:
    """The interface holding ``addr`` in this network namespace, or None."""
    wanted = ipaddress.ip_address(addr)
    if wanted.version == 4:
        pairs = ipv4_addresses()
    else:
        try:
            pairs = parse_if_inet6(Path("/proc/net/if_inet6").read_text())
        except OSError:
            return None
    for name, found in pairs:
        if ipaddress.ip_address(found) == wanted:
            return name
    return None


def hostname_is_loopback(hostname: str | None = None) -> bool:
    """Whether gloo, left to itself, ends up on loopback.

    torch binds the first address the hostname resolves to that can be bound here, and
    falls back to loopback when none can (a name that does not resolve, or one that names
    another namespace's or container's address). Binding port 0 sends nothing.
    """
    name = hostname or socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return True
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((sockaddr[0], 0, *sockaddr[2:]))
        except OSError:
            continue
        return ipaddress.ip_address(str(sockaddr[0]).split("%")[0]).is_loopback
    return True


def worker_socket_env(env: Mapping[str, str], local_addr: str | None, nnodes: str,
                      hostname: str | None = None) -> tuple[dict[str, str], str | None]:
    """:func:`socket_ifname_env` with its facts looked up on this node."""
    many = spans_nodes(nnodes)
    loopback = many and hostname_is_loopback(hostname)
    ifname = interface_of(local_addr) if loopback and local_addr else None
    return socket_ifname_env(env, local_addr, many, hostname_loopback=loopback, ifname=ifname)


def worker_env_for(rdzv_endpoint: str, local_addr: str | None, nnodes: str,
                   env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """What the agent applies at start: the node's address is ``--local-addr``, else the
    one it reaches the first routable rendezvous endpoint from."""
    from agent.etcd.settings import EtcdConfigError, parse_endpoints  # lazy: keeps this module light

    try:
        endpoints: Iterable[tuple[str, int]] = parse_endpoints(rdzv_endpoint)
    except EtcdConfigError:
        endpoints = ()  # the rendezvous reports a bad endpoint in its own words
    return worker_socket_env(env, local_addr or local_address(endpoints), nnodes)


def ipv4_addresses() -> list[tuple[str, str]]:
    """``(interface, address)`` for every IPv4 address here, via ``SIOCGIFCONF``."""
    count = 64
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        while True:  # bounded: doubles up to MAX_IFREQS
            buf = array.array("B", bytes(count * IFREQ_SIZE))
            request = struct.pack("iL", len(buf), buf.buffer_info()[0])
            length = struct.unpack("iL", fcntl.ioctl(sock.fileno(), SIOCGIFCONF, request))[0]
            if length < len(buf) or count >= MAX_IFREQS:
                return parse_ifconf(buf.tobytes()[:length])
            count *= 2


def parse_ifconf(data: bytes) -> list[tuple[str, str]]:
    """Parse ``SIOCGIFCONF``'s array of ``struct ifreq``; alias labels (``eth0:1``) become
    the device name, which is what ``*_SOCKET_IFNAME`` wants."""
    pairs = []
    for offset in range(0, len(data) - IFREQ_SIZE + 1, IFREQ_SIZE):
        record = data[offset:offset + IFREQ_SIZE]
        name = record[:16].split(b"\0", 1)[0].decode(errors="replace").split(":", 1)[0]
        family = struct.unpack_from("H", record, 16)[0]
        if family == socket.AF_INET:
            pairs.append((name, socket.inet_ntoa(record[20:24])))
    return pairs


def parse_if_inet6(text: str) -> list[tuple[str, str]]:
    """Parse ``/proc/net/if_inet6``: ``address ifindex prefixlen scope flags name`` per line."""
    pairs = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 6 and len(fields[0]) == 32:
            pairs.append((fields[5], str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))))
    return pairs
