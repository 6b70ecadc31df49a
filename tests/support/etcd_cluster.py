"""A real 3-member etcd cluster whose members live in network namespaces, for fault tests.

Each member is a real ``etcd`` process inside its own namespace of a
:class:`~agent.local.netns.NodeNetwork`, at its own address on the bridge (client port 2379,
peer port 2380, as on separate hosts). So every fault is real: :meth:`EtcdMember.kill` is
a SIGKILL, :meth:`EtcdCluster.isolate` blackholes one member's routes to the other two
(it still accepts clients, but has no quorum), and ``net.partition(member)`` takes its
link down altogether. Members keep their data directory across a kill, so a restarted
member rejoins the cluster as itself.

The leader is found by asking each member for its status; a test kills *that* process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from etcd3 import etcdrpc

from agent.local.netns import NodeNetwork
from agent.etcd import EtcdClient, EtcdError, EtcdSettings, find_etcd_binary

CLIENT_PORT, PEER_PORT = 2379, 2380
MEMBERS = ("e0", "e1", "e2")


@dataclass
class EtcdMember:
    name: str
    addr: str
    data_dir: Path
    cluster: str  # --initial-cluster, the same for every member
    net: NodeNetwork
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{CLIENT_PORT}"

    def command(self) -> list[str]:
        client, peer = f"http://{self.addr}:{CLIENT_PORT}", f"http://{self.addr}:{PEER_PORT}"
        return [str(find_etcd_binary()), "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", self.cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", "elastic-test", "--log-level", "warn",
                # the same timings as EmbeddedEtcd: a leader is elected within about a second
                "--heartbeat-interval", "50", "--election-timeout", "500"]

    def start(self) -> "EtcdMember":
        if self.alive():
            return self
        with open(self.data_dir.with_suffix(".log"), "ab") as log:
            self.process = self.net.popen(self.name, self.command(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as when its machine dies; the data directory stays for a restart."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self.process = None

    def client(self, timeout: float = 1.0) -> EtcdClient:
        host, port = self.addr, CLIENT_PORT
        return EtcdClient(EtcdSettings(endpoints=((host, port),), request_timeout=timeout), retry_deadline=timeout)


@dataclass
class EtcdCluster:
    """Members named ``names`` (namespaces of ``net``), started with :meth:`start`."""

    net: NodeNetwork
    root: Path
    names: Sequence[str] = MEMBERS
    members: dict[str, EtcdMember] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cluster = ",".join(f"{n}=http://{self.net[n].addr}:{PEER_PORT}" for n in self.names)
        for n in self.names:
            self.members[n] = EtcdMember(n, self.net[n].addr, self.root / f"etcd-{n}", cluster, self.net)

    @property
    def endpoints(self) -> str:
        """``host:port,...`` for ``--rdzv-endpoint``: every member, so clients fail over."""
        return ",".join(m.endpoint for m in self.members.values())

    def settings(self, timeout: float = 2.0) -> EtcdSettings:
        return EtcdSettings(endpoints=tuple((m.addr, CLIENT_PORT) for m in self.members.values()),
                            request_timeout=timeout)

    def start(self, timeout: float = 60.0) -> "EtcdCluster":
        for member in self.members.values():
            member.start()
        self.wait_for_leader(timeout)
        return self

    def leader(self, among: Sequence[str] | None = None) -> str | None:
        """The member of ``among`` (default: all) that every live member of ``among`` calls
        leader, if they agree; None during an election or while they still name a dead one."""
        among = list(among or self.members)
        seen = set()
        for name in among:
            member = self.members[name]
            if not member.alive():
                continue
            client = member.client()
            try:
                status = client.call(lambda c: c.status(), deadline=1.0)
                seen.add(status.leader.name if status.leader is not None else None)
            except (EtcdError, AttributeError):
                seen.add(None)
            finally:
                client.close()
        leader = seen.pop() if len(seen) == 1 else None
        return leader if leader in among and self.members[leader].alive() else None

    def wait_for_leader(self, timeout: float, among: Sequence[str] | None = None) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.leader(among)
            if leader:
                return leader
            time.sleep(0.1)
        raise AssertionError(f"the etcd cluster elected no leader within {timeout:.0f} s; see {self.root}/etcd-*.log")

    def move_leader(self, to: str, timeout: float = 30.0) -> None:
        """Hand the leadership to ``to`` (etcd's MoveLeader), so a test can choose who leads."""
        leader = self.wait_for_leader(timeout)
        if leader == to:
            return
        client = self.members[leader].client(timeout=5.0)
        try:
            target = next(m.id for m in client.call(lambda c: list(c.members)) if m.name == to)
            client.call(lambda c: c.maintenancestub.MoveLeader(etcdrpc.MoveLeaderRequest(targetID=target), 5.0,
                                                               metadata=c.metadata))
        finally:
            client.close()
        deadline = time.monotonic() + timeout
        while self.leader() != to:
            if time.monotonic() > deadline:
                raise AssertionError(f"etcd did not hand the leadership to {to} within {timeout:.0f} s")
            time.sleep(0.1)

    def isolate(self, name: str) -> None:
        """Cut ``name`` from the other members (clients still reach it, but it has no quorum)."""
        self.net.cut_from_peers(name, [n for n in self.members if n != name])

    def stop_all(self) -> None:
        for member in self.members.values():
            member.kill()

    def close(self) -> None:
        self.stop_all()
