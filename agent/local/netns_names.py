"""Names, addresses and subnet choice for :mod:`agent.local.netns`: pure logic, no I/O.

Every object the harness creates carries its owner's pid in its name, so a later run can
tell its own live objects from the leftovers of a run that was SIGKILLed (whose cleanup
never ran) and sweep only the latter. Interface names are limited to 15 bytes by the
kernel (``IFNAMSIZ``), which is what bounds the pid, instance and node-index digits.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Iterable

PREFIX = "et"  # elastic-trainer
IFNAMSIZ = 15
DEFAULT_POOL = ipaddress.IPv4Network("10.233.0.0/16")
CENTRAL_HOST = 1  # the bridge's address: etcd and anything else "central" listen there
FIRST_NODE_HOST = 11  # node i gets .11+i, leaving .2-.10 for more central services later
MAX_NODES = 254 - FIRST_NODE_HOST
NODE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")  # `ip netns` names are file names
_OWNED = re.compile(rf"^{PREFIX}(\d+)x(\d+)(?:b|[vp]\d+|-[A-Za-z0-9_.-]+)$")


class NetnsNameError(ValueError):
    """A node name or count the harness cannot turn into interface names."""


@dataclass(frozen=True)
class Names:
    """The names of one harness instance: ``et<pid>x<instance>`` plus a suffix."""

    pid: int
    instance: int

    @property
    def tag(self) -> str:
        return f"{PREFIX}{self.pid}x{self.instance}"

    @property
    def bridge(self) -> str:
        return _ifname(f"{self.tag}b")

    def host_link(self, index: int) -> str:
        """The veth end on the bridge, in the root namespace."""
        return _ifname(f"{self.tag}v{index}")

    def node_link(self, index: int) -> str:
        """The other veth end's name while it is created in the root namespace."""
        return _ifname(f"{self.tag}p{index}")

    def namespace(self, node: str) -> str:
        if not NODE_NAME.match(node):
            raise NetnsNameError(f"node name {node!r} must be 1-32 letters, digits, '_', '-' or '.'")
        return f"{self.tag}-{node}"


def _ifname(name: str) -> str:
    if len(name) > IFNAMSIZ:
        raise NetnsNameError(f"interface name {name!r} exceeds the kernel's {IFNAMSIZ} bytes; "
                             "use fewer nodes or fewer harness instances per process")
    return name


def owner_pid(name: str) -> int | None:
    """The pid in a name this harness made (bridge, veth or namespace), else None."""
    match = _OWNED.match(name)
    return int(match.group(1)) if match else None


def pick_subnet(used: Iterable[ipaddress.IPv4Network], seed: int,
                pool: ipaddress.IPv4Network = DEFAULT_POOL) -> ipaddress.IPv4Network:
    """A /24 of ``pool`` that overlaps none of ``used`` (routes and addresses already there).

    Starting at a ``seed``-dependent offset spreads concurrent harnesses over the pool;
    the caller still serialises pick-and-claim with a lock.
    """
    taken = [net for net in used if net.prefixlen > 0]  # the default route overlaps all
    candidates = list(pool.subnets(new_prefix=24)) if pool.prefixlen <= 24 else [pool]
    for offset in range(len(candidates)):
        net = candidates[(seed + offset) % len(candidates)]
        if not any(net.overlaps(other) for other in taken):
            return net
    raise NetnsNameError(f"no /24 in {pool} is free of existing routes; pass another pool")


def central_addr(subnet: ipaddress.IPv4Network) -> str:
    return str(subnet.network_address + CENTRAL_HOST)


def node_addr(subnet: ipaddress.IPv4Network, index: int) -> str:
    if not 0 <= index < MAX_NODES:
        raise NetnsNameError(f"a /24 holds at most {MAX_NODES} nodes, not {index + 1}")
    return str(subnet.network_address + FIRST_NODE_HOST + index)
