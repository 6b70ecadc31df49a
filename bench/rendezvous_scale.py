"""N nodes forming a rendezvous round, and re-forming one after a SIGKILL: etcd-v3 beside c10d.

Each simulated node is a process of its own (forked after the imports, before any gRPC
channel: see ``forked_nodes.py``) holding one rendezvous handler and no workers. Node
processes read the same system-wide monotonic clock, so their timestamps compare.

**Formation** (``--nodes``): min = max = N, every node calls ``next_rendezvous`` at once.
The figure is the time from the first call to the last node holding the round, all in the
same round of N. Per node we also count etcd requests (every ``EtcdClient.call``, from
building the handler to closing it), how many of them were lease keep-alives (a fixed
rate per node, so they grow with the time taken, not with N), the watch events the node
received, and its CPU seconds from the call to holding the round.

**Loss** (``--kill``): ``--nnodes N-1:N``; once all N hold the first round, the last node's
process is SIGKILLed. Survivors run the agent's loop: every 0.1 s (torch's monitor
interval) ``restart_reason()``, and when it names one, mark the registry ``stopping`` and
call ``next_rendezvous``. The figure is, per survivor, the time from etcd expiring the
victim's lease to holding the new round of N-1. The expiry is when the bench's own watch
sees the victim's registry key deleted (a lease's keys go in the same revision as the
lease), a few milliseconds after etcd acts. The c10d anchor is timed from the kill: its
survivors are told of the death at the instant of the kill (a c10d agent learns it from
its workers' failure, ~0.6 s later in practice), then call ``next_rendezvous``.

c10d runs with the same settings as ours: keep-alives every TTL/3 s, 3 attempts (our lease
TTL, ``--lease-ttl``, 3 s by default), last call 1 s, node 0 hosting the TCPStore (never
the victim).

    .venv/bin/python bench/rendezvous_scale.py --nodes 8 16 32 64 --kill 16 32 64 64 64 --give-up 120
    .venv/bin/python bench/rendezvous_scale.py --nodes 128 256 --kill --backends etcd-v3 --lease-ttl 9

Every node and etcd share this machine's cores; the "cpu floor" printed beside each figure
says how much of it the machine alone explains (see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # no per-round TCPStore server
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"  # nothing gRPC crosses our forks (forked_nodes.py)
os.environ.setdefault("ELASTIC_RDZV_HMAC_KEY", secrets.token_hex(16))  # signed, as in production
sys.path.insert(0, str(Path(__file__).resolve().parent))

from etcd3 import events as etcd_events  # noqa: E402
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters  # noqa: E402
from torch.distributed.elastic.rendezvous import dynamic_rendezvous  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend as c10d_backend  # noqa: E402

from agent.etcd import EmbeddedEtcd, EtcdClient, free_port  # noqa: E402
from agent.etcd.keepalive import KeepAlive  # noqa: E402
from agent.etcd.mirror import PrefixMirror  # noqa: E402
from agent.rendezvous import EtcdV3RendezvousHandler, create_handler  # noqa: E402
from agent.rendezvous import registry  # noqa: E402
from rendezvous_handlers import held_round  # noqa: E402
from forked_nodes import (  # noqa: E402
    NodeLinks, Zygote, gather, kill_all, mem_available_gib, tree_cpu_seconds, tree_memory,
)

OURS, C10D = "etcd-v3", "c10d"
MONITOR_INTERVAL_S = 0.1  # torch's LaunchConfig default, and `elastic local`'s
SETTLE_S = 1.0  # after the first round, before the kill: every survivor is in its monitor loop
READY_TIMEOUT_S = 300.0
CORES = os.cpu_count() or 1


@dataclass(frozen=True)
class NodeSpec:
    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    follow: bool  # after the first round, watch for a lost peer and re-rendezvous
    lease_ttl: int = 3  # ours; c10d gets keep-alives of lease_ttl / 3 s x 3 attempts, the same deadline


# ----------------------------------------------------------------------------- node side


class _Counts:
    """This node process's etcd requests, keep-alives and watch events."""

    def __init__(self) -> None:
        self.requests = self.keepalives = self.events = self.looks = 0
        self._lock = threading.Lock()
        call, refresh, on_watch = EtcdClient.call, KeepAlive.refresh, PrefixMirror._on_watch
        entries = PrefixMirror.entries
        counts = self

        def counted_call(client, request, **kwargs):  # type: ignore[no-untyped-def]
            with counts._lock:
                counts.requests += 1
            return call(client, request, **kwargs)

        def counted_refresh(sender, lease_id, **kwargs):  # type: ignore[no-untyped-def]
            with counts._lock:
                counts.keepalives += 1
            return refresh(sender, lease_id, **kwargs)

        def counted_watch(mirror, response):  # type: ignore[no-untyped-def]
            if not isinstance(response, BaseException):
                with counts._lock:
                    counts.events += len(response.events)
            return on_watch(mirror, response)

        def counted_entries(mirror):  # type: ignore[no-untyped-def]
            counts.looks += 1  # the handler's reads of its mirror; only its own thread reads during a round
            return entries(mirror)

        EtcdClient.call = counted_call  # type: ignore[method-assign, assignment]
        KeepAlive.refresh = counted_refresh  # type: ignore[method-assign]
        PrefixMirror._on_watch = counted_watch  # type: ignore[method-assign]
        PrefixMirror.entries = counted_entries  # type: ignore[method-assign]


def _make_handler(spec: NodeSpec, index: int) -> RendezvousHandler:
    if spec.backend == OURS:
        return create_handler(RendezvousParameters(
            OURS, spec.endpoint, spec.run_id, spec.min_nodes, spec.max_nodes, join_timeout=600,
            node_name=f"node{index}", lease_ttl=spec.lease_ttl,
        ))
    params = RendezvousParameters(
        C10D, spec.endpoint, spec.run_id, spec.min_nodes, spec.max_nodes, join_timeout=600,
        last_call_timeout=1, keep_alive_interval=spec.lease_ttl // 3, keep_alive_max_attempt=3,
        is_host=index == 0,
    )
    backend, store = c10d_backend(params)
    return dynamic_rendezvous.create_handler(store, backend, params)


def _stop(handler: RendezvousHandler) -> None:
    if isinstance(handler, EtcdV3RendezvousHandler):
        handler.close()
    else:
        handler._stop_heartbeats()  # type: ignore[attr-defined]


def _rendezvous(handler: RendezvousHandler, link: Connection, started: float) -> None:
    cpu = time.process_time()
    handler.next_rendezvous()
    held = time.monotonic()
    link.send(("round", *held_round(handler), started, held, time.process_time() - cpu))


def _follow(handler: RendezvousHandler, link: Connection) -> None:
    """The agent's monitor loop without workers, until the bench says quiet.

    The bench quiets every node before any closes its handler: a closing node revokes
    its lease, which a node still following would take for a lost peer, and it would
    wait in a rendezvous that can no longer fill.

    etcd-v3: ``restart_reason()`` each monitor interval, as ``agent/node/node_agent.py`` does,
    then "stopping" in the registry and ``next_rendezvous``. c10d has no such signal
    without workers; the bench sends ``peer_died`` instead.
    """
    ours = handler if isinstance(handler, EtcdV3RendezvousHandler) else None
    while True:
        told = None
        if link.poll(MONITOR_INTERVAL_S):
            told = link.recv()
            if told == "quiet":
                return
        if ours is not None:
            if ours.restart_reason() is None:
                continue
            noticed = time.monotonic()
            ours.lease.update(state="stopping")
        elif told == "peer_died":
            noticed = time.monotonic()
        else:
            continue
        _rendezvous(handler, link, noticed)


def node_main(link: Connection, index: int, spec: NodeSpec) -> None:
    counts = _Counts()
    handler = _make_handler(spec, index)
    link.send(("ready",))
    if link.recv() != "go":
        return
    _rendezvous(handler, link, time.monotonic())
    if spec.follow:
        _follow(handler, link)
        link.send(("quiet",))
    link.recv()  # "stop"
    _stop(handler)
    link.send(("counts", counts.requests, counts.keepalives, counts.events, counts.looks))


# ----------------------------------------------------------------------------- bench side


@dataclass
class Formation:
    seconds: float
    requests: float  # per node, keep-alives included
    keepalives: float  # per node
    events: float  # watch events per node
    looks: float  # the handler's reads of its mirror per node (each one an O(N) scan)
    cpu_s: float  # median CPU seconds per node, call to round
    floor_s: float  # CPU of all nodes and etcd, first call to last round, over this machine's cores
    pss_gib: float  # the node processes and the zygote, while all hold the round
    rss_gib: float  # the same, counting each shared page once per process
    available_gib: float


@dataclass
class Loss:
    idle_cores: float  # CPU the N following nodes used per second, before the kill
    expiry_s: float  # kill -> lease expiry seen (etcd-v3); nan for c10d
    from_expiry: list[float]  # per survivor: expiry -> holds the new round
    noticed: list[float]  # per survivor: expiry -> restart_reason() said why
    from_kill: list[float]  # per survivor: kill -> holds the new round
    cpu_s: float  # median survivor's CPU seconds, notice to holding the new round
    floor_s: float  # CPU of all nodes and etcd, expiry to the last survivor holding, over the cores
    extra_rounds: int  # further re-rendezvous after every survivor held the new round (churn)


def _stop_all(links: dict[int, Connection]) -> dict[int, Any]:
    """Stop every node and collect its counts; node 0 last, since under c10d it hosts the
    TCPStore the others' heartbeat threads still talk to."""
    first = {i: c for i, c in links.items() if i != 0}
    for conn in first.values():
        conn.send("stop")
    counts = gather(first, lambda i, m: m[0] == "counts", 60, "nodes closing")
    if 0 in links:
        links[0].send("stop")
        counts.update(gather({0: links[0]}, lambda i, m: m[0] == "counts", 60, "node 0 closing"))
    return counts


class Bench:
    def __init__(self, zygote: Zygote, etcd: EmbeddedEtcd, lease_ttl: int) -> None:
        self.zygote, self.etcd, self.lease_ttl = zygote, etcd, lease_ttl
        self.links = NodeLinks()
        self.client = EtcdClient(etcd.settings())  # the bench's own, for the loss watch
        self.largest: tuple[int, float] = (0, 0.0)  # (nodes, tree PSS GiB) of the largest formation so far

    def close(self) -> None:
        self.client.close()
        self.links.close()

    def _endpoint(self, backend: str) -> str:
        # torchrun's own backend: its node 0 hosts the store there, so it cannot be port 0 (every node
        # needs the endpoint first); a lost race shows as that run failing to form (a by-hand bench)
        return self.etcd.endpoint if backend == OURS else f"127.0.0.1:{free_port()}"

    def _start(self, spec: NodeSpec, n: int) -> tuple[list[int], dict[int, Connection]]:
        process = self.etcd.process
        if spec.backend == OURS and (process is None or process.poll() is not None):
            raise RuntimeError(f"etcd is gone (exit status {process.poll() if process else None}); "
                               f"see {self.etcd.log_path}")
        measured_n, measured_gib = self.largest
        needed = 1.5 * measured_gib * max(n / measured_n, 1.0) + 1.0 if measured_n else 0.0
        if mem_available_gib() < needed:
            raise MemoryError(f"{n} nodes need about {needed:.1f} GiB (1.5 x {measured_gib:.2f} GiB measured at "
                              f"{measured_n} nodes, scaled, + 1 GiB); {mem_available_gib():.1f} GiB available")
        pids = self.zygote.spawn(node_main, self.links.address, [spec] * n)
        try:
            links = self.links.accept(n, READY_TIMEOUT_S)
            gather(links, lambda i, m: m[0] == "ready", READY_TIMEOUT_S, "nodes ready")
        except BaseException:
            kill_all(pids)
            raise
        return pids, links

    def _cpu(self, pids: list[int]) -> float:
        """CPU seconds used so far by these nodes and by etcd."""
        return tree_cpu_seconds([*pids, self.etcd.pid or 0])

    def _first_round(self, pids: list[int], links: dict[int, Connection], n: int,
                     timeout: float) -> tuple[dict[int, Any], float]:
        """Every node's first round, and the CPU the nodes and etcd used meanwhile."""
        cpu = self._cpu(pids)
        for conn in links.values():
            conn.send("go")
        rounds = gather(links, lambda i, m: m[0] == "round", timeout, f"first round of {n}")
        cpu = self._cpu(pids) - cpu
        held = {(m[1], m[2]) for m in rounds.values()}
        if len(held) != 1 or next(iter(held))[1] != n:
            raise RuntimeError(f"nodes hold different rounds or worlds (round, world): {sorted(held)}")
        return rounds, cpu

    def formation(self, backend: str, n: int, run: int, timeout: float) -> Formation:
        spec = NodeSpec(backend, self._endpoint(backend), f"form{n}-{run}-{time.time_ns()}", n, n, False,
                        self.lease_ttl)
        pids, links = self._start(spec, n)
        try:
            rounds, cpu = self._first_round(pids, links, n, timeout)
            pss, rss = tree_memory([*pids, self.zygote.pid])
            available = mem_available_gib()
            self.largest = max(self.largest, (n, pss))
            counts = _stop_all(links)
        finally:
            kill_all(pids)
            for conn in links.values():
                conn.close()
        return Formation(
            seconds=max(m[4] for m in rounds.values()) - min(m[3] for m in rounds.values()),
            requests=sum(m[1] for m in counts.values()) / n,
            keepalives=sum(m[2] for m in counts.values()) / n,
            events=sum(m[3] for m in counts.values()) / n,
            looks=sum(m[4] for m in counts.values()) / n,
            cpu_s=statistics.median(m[5] for m in rounds.values()),
            floor_s=cpu / CORES,
            pss_gib=pss, rss_gib=rss, available_gib=available,
        )

    def loss(self, backend: str, n: int, timeout: float) -> Loss:
        run_id = f"loss{n}-{time.time_ns()}"
        spec = NodeSpec(backend, self._endpoint(backend), run_id, n - 1, n, True, self.lease_ttl)
        victim = n - 1
        victim_key = f"{registry.nodes_prefix('/elastic', run_id)}node{victim}".encode()
        deleted: dict[bytes, tuple[float, float]] = {}  # key -> (when, CPU of nodes and etcd then)
        pids: list[int] = []

        def on_event(response: Any) -> None:
            if isinstance(response, BaseException):
                return
            now = time.monotonic()
            for event in response.events:
                if isinstance(event, etcd_events.DeleteEvent) and event.key not in deleted:
                    deleted[event.key] = (now, self._cpu(pids))

        watch = None
        if backend == OURS:
            prefix = registry.nodes_prefix("/elastic", run_id)
            watch = self.client.call(lambda c: c.add_watch_prefix_callback(prefix, on_event))
        started, links = self._start(spec, n)
        pids.extend(started)
        try:
            self._first_round(pids, links, n, timeout)
            cpu = tree_cpu_seconds(pids)
            time.sleep(SETTLE_S)
            idle_cores = (tree_cpu_seconds(pids) - cpu) / SETTLE_S
            killed = time.monotonic()
            os.kill(pids[victim], signal.SIGKILL)
            survivors = {i: c for i, c in links.items() if i != victim}
            if backend == C10D:
                for conn in survivors.values():
                    conn.send("peer_died")
            rounds = gather(survivors, lambda i, m: m[0] == "round", timeout, f"new round of {n - 1}")
            cpu_end = self._cpu(pids)
            held = {(m[1], m[2]) for m in rounds.values()}
            if len(held) != 1 or next(iter(held))[1] != n - 1:
                raise RuntimeError(f"survivors hold different rounds or worlds (round, world): {sorted(held)}")
            extra: list[int] = []  # survivors that restarted again after holding the new round

            def quiet(index: int, message: Any) -> bool:
                if message[0] == "round":
                    extra.append(index)
                return message[0] == "quiet"

            for conn in survivors.values():
                conn.send("quiet")
            gather(survivors, quiet, 60, "survivors leaving their monitor loop")
            _stop_all(survivors)
        finally:
            kill_all(pids)
            for conn in links.values():
                conn.close()
            if watch is not None:
                self.client.call(lambda c: c.cancel_watch(watch))
        expired, cpu_at_expiry = deleted.get(victim_key, (float("nan"), float("nan")))
        return Loss(
            idle_cores=idle_cores,
            expiry_s=expired - killed,
            from_expiry=[m[4] - expired for m in rounds.values()],
            noticed=[m[3] - expired for m in rounds.values()],
            from_kill=[m[4] - killed for m in rounds.values()],
            cpu_s=statistics.median(m[5] for m in rounds.values()),
            floor_s=(cpu_end - cpu_at_expiry) / CORES,
            extra_rounds=len(extra),
        )


def _attempt(what: str, action: Callable[[], Any]) -> Any:
    try:
        return action()
    except Exception as exc:  # noqa: BLE001 - a failed size is a finding; report it and go on
        print(f"  {what}: FAILED: {type(exc).__name__}: {exc}", flush=True)
        if not isinstance(exc, (TimeoutError, MemoryError)):
            traceback.print_exc()
        return None


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _formations(bench: Bench, backend: str, n: int, args: argparse.Namespace) -> list[Formation]:
    trials = (_attempt(f"{backend} {n}", lambda: bench.formation(backend, n, run, args.give_up))
              for run in range(args.repeats))
    return [t for t in trials if t is not None]


def _loss(bench: Bench, backend: str, n: int, args: argparse.Namespace) -> Loss | None:
    return _attempt(f"{backend} loss {n}", lambda: bench.loss(backend, n, args.give_up))  # type: ignore[no-any-return]


def run_formation(bench: Bench, args: argparse.Namespace) -> None:
    print(f"\nformation: N nodes, one process each, min = max = N, lease TTL {args.lease_ttl} s; "
          f"medians of {args.repeats}")
    print(f"{'nodes':>5}  {'etcd-v3 s':>9}  {'c10d s':>6}  {'ratio':>5}  {'req/node':>8}  {'keep-alive':>10}  "
          f"{'events/node':>11}  {'looks/node':>10}  {'cpu s/node':>10}  {'cpu floor s':>11}  "
          f"{'tree PSS/RSS GiB':>16}  {'avail GiB':>9}  load 1/5/15")
    for n in args.nodes:
        ours = _formations(bench, OURS, n, args)
        theirs = _formations(bench, C10D, n, args) if C10D in args.backends and n <= args.c10d_max else []
        if not ours:
            print(f"{n:>5}  etcd-v3 did not form (see above)", flush=True)
            continue
        med = lambda attr, trials=ours: statistics.median(getattr(t, attr) for t in trials)  # noqa: E731
        c10d_s = med("seconds", theirs) if theirs else float("nan")
        memory = f"{max(t.pss_gib for t in ours):.2f}/{max(t.rss_gib for t in ours):.1f}"
        print(f"{n:>5}  {med('seconds'):>9.2f}  {c10d_s:>6.2f}  {med('seconds') / c10d_s:>5.2f}  "
              f"{med('requests'):>8.1f}  {med('keepalives'):>10.1f}  {med('events'):>11.0f}  "
              f"{med('looks'):>10.0f}  {med('cpu_s'):>10.3f}  {med('floor_s'):>11.2f}  {memory:>16}  "
              f"{min(t.available_gib for t in ours):>9.1f}  {_load()}", flush=True)
    print("(ratio = etcd-v3 / c10d; req/node includes the keep-alives; cpu floor = CPU of all nodes and etcd\n"
          f" from the first call to the last round, over this machine's {CORES} cores: the least time the figure\n"
          " could take here; goals: 64 nodes <= 3 s and <= c10d, 256 nodes <= 10 s, requests per node flat within 20 %)")


def run_loss(bench: Bench, args: argparse.Namespace) -> None:
    print(f"\nloss: N nodes (--nnodes N-1:N), the last one SIGKILLed after the first round; {args.repeats} trial(s)")
    print(f"{'nodes':>5}  {'kill->expiry s':>14}  {'expiry->notice s':>16}  {'expiry->all hold s':>18}  "
          f"{'kill->all hold s':>16}  {'c10d kill->all hold s':>21}  {'ratio':>5}  {'cpu s/node':>10}  "
          f"{'cpu floor s':>11}  {'extra rounds':>12}  {'idle cores':>10}  "
          f"{'c10d':>5}  load 1/5/15")
    for n in args.kill:
        for _ in range(args.repeats):
            ours = _loss(bench, OURS, n, args)
            theirs = _loss(bench, C10D, n, args) if C10D in args.backends and n <= args.c10d_max else None
            if ours is None:
                continue
            c10d_s = max(theirs.from_kill) if theirs else float("nan")
            print(f"{n:>5}  {ours.expiry_s:>14.2f}  {max(ours.noticed):>16.2f}  "
                  f"{max(ours.from_expiry):>8.2f} (med {statistics.median(ours.from_expiry):.2f})  "
                  f"{max(ours.from_kill):>16.2f}  {c10d_s:>21.2f}  {max(ours.from_kill) / c10d_s:>5.2f}  "
                  f"{ours.cpu_s:>10.3f}  {ours.floor_s:>11.2f}  {ours.extra_rounds:>12}  "
                  f"{ours.idle_cores:>10.2f}  {theirs.idle_cores if theirs else float('nan'):>5.2f}  {_load()}",
                  flush=True)
    print("(every figure is the slowest survivor's, med = median survivor; ratio = etcd-v3 / c10d, both from the\n"
          " kill; cpu s/node: median survivor, notice to new round; cpu floor: CPU of all nodes and etcd from the\n"
          f" expiry to the last survivor holding, over {CORES} cores; idle cores: CPU the N nodes used per second\n"
          " while following a healthy round; extra rounds: re-rendezvous after all held the new one (churn);\n"
          " goal: expiry->all hold <= 1 s at 64 nodes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="*", default=[8, 16, 32, 64], help="formation sizes")
    parser.add_argument("--kill", type=int, nargs="*", default=[64], help="loss trial sizes (at least 3)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--backends", nargs="+", default=[OURS, C10D], choices=[OURS, C10D])
    parser.add_argument("--c10d-max", type=int, default=1 << 30, help="skip c10d above this many nodes")
    parser.add_argument("--give-up", type=float, default=300.0, help="seconds before a round counts as failed")
    parser.add_argument("--lease-ttl", type=int, default=3,
                        help="our lease TTL; c10d keeps alive every TTL/3 s, 3 attempts (default 3, a multiple of 3)")
    parser.add_argument("--etcd-log", type=Path, help="keep etcd's log here (default: removed with etcd)")
    args = parser.parse_args()
    if args.lease_ttl < 3 or args.lease_ttl % 3:
        parser.error("--lease-ttl must be a multiple of 3 (c10d's keep-alive interval is whole seconds)")
    if any(n < 3 for n in args.kill):
        parser.error("--kill sizes must be at least 3 (a loss leaves N-1 >= 2 nodes)")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up etcd and the nodes when stopped
    zygote = Zygote()  # before anything below opens a gRPC channel
    try:
        with EmbeddedEtcd(log_path=args.etcd_log) as etcd:
            bench = Bench(zygote, etcd, args.lease_ttl)
            try:
                if args.nodes:
                    run_formation(bench, args)
                if args.kill:
                    run_loss(bench, args)
            finally:
                bench.close()
    finally:
        zygote.close()


if __name__ == "__main__":
    main()
