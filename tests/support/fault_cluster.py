"""A training job on nodes with their own network, for fault tests and ``bench/chaos_soak.py --netns``.

Each node is a real ``elastic agent`` process tree inside its own namespace of a
:class:`~agent.local.netns.NodeNetwork` (its own address for the agent, the round store, the
witness, the metrics and every gloo pair), running ``elastic.train`` with a ledger and
snapshots in one shared directory. etcd is whatever the caller started: one member on
the bridge, or a 3-member :class:`~tests.support.etcd_cluster.EtcdCluster`.

What a test reads is what a user would: each node's progress lines (step, world, round,
worker pid), its ``/metrics``, the node registry in etcd, the ledger and the snapshots.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from agent.local.local_node import LocalNode
from agent.local.netns import NodeNetwork
from checkpoints.pids import pid_alive  # noqa: F401  (tests and bench/netns_soak import it from here)
from elastic import contract
from agent.etcd import EtcdClient, EtcdError, parse_endpoints
from agent.etcd.settings import EtcdSettings
from elastic.ledger import read_ledger
from agent.rendezvous.registry import NodeRecord, list_nodes, nodes_prefix, run_prefix
from agent.rendezvous.rounds import RoundRecord
from agent.rendezvous.signing import StateSigner
from tests.elastic.metrics.scrape import fetch
from agent.local.local_node import AUTO_METRICS_PORT
from tests.support.metrics_url import metrics_url

DATASET = 512  # 16 steps per epoch at the default global batch of 32


def job_args(workdir: Path, collective_timeout: float, step_sleep: float = 0.05, seed: int = 0) -> list[str]:
    return ["--job", "mlp", "--epochs", "100000", "--dataset-size", str(DATASET), "--seed", str(seed),
            "--snapshot-dir", str(workdir / "snapshots"), "--snapshot-every-steps", "10",
            "--ledger", str(workdir / "ledger.jsonl"), "--progress", "{progress}",
            "--step-sleep", str(step_sleep), "--collective-timeout", str(collective_timeout)]


@dataclass
class FaultCluster:
    net: NodeNetwork
    endpoint: str  # etcd, as --rdzv-endpoint takes it (one or several host:port)
    workdir: Path
    names: Sequence[str]
    run_id: str = "faults"
    lease_ttl: int = 2
    collective_timeout: float = 4.0
    step_sleep: float = 0.05
    seed: int = 0
    hmac_key: bytes | None = None  # sign the rendezvous state, as production does
    nodes: dict[str, LocalNode] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Network and etcd faults are these clusters' subject. A node in a namespace on a loaded
        # 2-core machine can run 1.4x slower than its peers for a while, and the straggler rule
        # then evicted it in the middle of a cut (a run under two busy loops): stragglers are
        # named here but never evicted (tests/agent/test_straggler_eviction.py evicts them).
        env = {"OMP_NUM_THREADS": "1", contract.STRAGGLER_EVICT_ENV: "0"}
        if self.hmac_key is not None:
            key_file = self.workdir / "job.key"
            key_file.write_bytes(self.hmac_key)
            key_file.chmod(0o600)
            env[contract.HMAC_KEY_FILE_ENV] = str(key_file)
        for name in self.names:
            self.nodes[name] = LocalNode(
                name=name, endpoint=self.endpoint, run_id=self.run_id, workdir=self.workdir, module="elastic.train",
                module_args=job_args(self.workdir, self.collective_timeout, self.step_sleep, self.seed),
                nnodes=f"1:{len(self.names)}", max_restarts=1000, metrics_port=AUTO_METRICS_PORT,
                agent_args=["--lease-ttl", str(self.lease_ttl)], netns=self.net[name], env=dict(env))
        self.signer = StateSigner(self.hmac_key)
        self.client = EtcdClient(EtcdSettings(endpoints=parse_endpoints(self.endpoint), request_timeout=2.0),
                                 retry_deadline=3.0)

    def __getitem__(self, name: str) -> LocalNode:
        return self.nodes[name]

    def start(self, names: Iterable[str] | None = None) -> "FaultCluster":
        for name in names if names is not None else self.names:
            self.nodes[name].start()
        return self

    def close(self) -> None:
        for node in self.nodes.values():
            node.cleanup()
        self.client.close()

    # ------------------------------------------------------------------ progress

    def rows(self, name: str, world: int | None = None, after: float = 0.0) -> list[dict[str, Any]]:
        return [r for r in self.nodes[name].progress()
                if r["time"] > after and (world is None or r["world_size"] == world)]

    def train_together(self, names: Iterable[str], world: int, steps: int = 5, after: float = 0.0) -> bool:
        return all(len(self.rows(n, world, after)) >= steps for n in names)

    def worker_pid(self, name: str) -> int:
        return int(self.rows(name)[-1]["pid"])

    def logs(self, *names: str, lines: int = 50) -> str:
        return "\n".join(self.nodes[n].log_tail(lines) for n in (names or self.names))

    # ------------------------------------------------------------------ what users look at

    def metric(self, name: str, metric: str, **labels: str) -> float | None:
        node = self.nodes[name]
        series = fetch(metrics_url(node), timeout=3)
        if series is None:
            return None
        return sum(v for (n, ls), v in series.items() if n == metric and labels.items() <= dict(ls).items())

    def registry(self) -> dict[str, NodeRecord]:
        """The node registry as ``elastic top`` reads it (with the job's key, if it has one)."""
        return {r.node: r for r in list_nodes(self.client, self.run_id, self.signer)}

    def round_record(self) -> RoundRecord | None:
        """The current round, verified with the job's key."""
        key = f"{run_prefix('/elastic', self.run_id)}/rdzv/round"
        value = self.client.call(lambda c: c.get(key))[0]
        return None if value is None else RoundRecord.from_json(self.signer.open(key.encode(), value))

    def ledger(self) -> list[dict[str, Any]]:
        path = self.workdir / "ledger.jsonl"
        return read_ledger(path) if path.exists() else []


class KeyWatch:
    """When did etcd drop a node's registry key (its lease expired)? Seen by real watches.

    One watch per etcd member, each through a client of its own: a watch breaks with the
    member it streams from (the soak kills the leader while a node is cut off), and
    python3-etcd3 does not resume it. With a watch on every member, a member's death
    leaves the others' watches running, and the first delete any of them sees is the time.
    """

    def __init__(self, cluster: FaultCluster, node: str) -> None:
        self.key = nodes_prefix("/elastic", cluster.run_id) + node
        self.gone_at: float | None = None
        self._lock = threading.Lock()
        self._watches: list[tuple[EtcdClient, int]] = []
        for endpoint in parse_endpoints(cluster.endpoint):
            client = EtcdClient(EtcdSettings(endpoints=[endpoint], request_timeout=2.0), retry_deadline=3.0)
            try:
                self._watches.append((client, client.call(lambda c: c.add_watch_callback(self.key, self._event))))
            except EtcdError:
                client.close()  # a member down right now: the others watch
        if not self._watches:
            raise EtcdError(f"no etcd member of {cluster.endpoint} accepted a watch on {self.key}")

    def _event(self, response: Any) -> None:
        if isinstance(response, BaseException):
            return  # this member's stream ended; the other members' watches go on
        for event in response.events:
            if type(event).__name__ == "DeleteEvent":
                with self._lock:
                    self.gone_at = self.gone_at or time.time()

    def close(self) -> None:
        for client, watch_id in self._watches:
            try:
                client.call(lambda c, w=watch_id: c.cancel_watch(w), deadline=1.0)
            except EtcdError:
                pass
            client.close()
