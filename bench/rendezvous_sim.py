"""Up to 1,024 rendezvous participants on one small machine: the real handler, many per process.

``bench/rendezvous_scale.py`` runs one process per node (9 MiB each plus a zygote, and
CPU-bound past 64 on 2 cores). Here a few **host** processes each hold many participants:
every participant is a real :class:`EtcdV3RendezvousHandler` with its own lease, its own
registry key, join keys and watches, its own witness; an etcd connection (a client, its gRPC
channel and watch stream) is shared, by ``--per-connection`` participants of a host, and the
host keeps all its leases alive on a few ``LeaseKeepAlive`` streams instead of a thread per
lease (:mod:`sim_keepalive`: a thread each starved at 1,024 on 2 cores). The **victim** (the last node) is a process of its own, holding one
participant, so that its loss is a SIGKILL: its lease stops being kept alive, its witness
and keep-alives die with it.

Counts come from the client layer, per participant (:class:`CountingClient`): every
``EtcdClient.call`` (a request), every keep-alive sent, every watch event delivered to
one of its watches and the bytes of the event's key and value, and the bytes of every
range read's keys and values. Per phase:

* **form**: min = max = N; every participant, already up (its lease held, its watch
  established, as an agent that has been running), calls ``next_rendezvous`` at once. The
  time is from "go" to the last participant holding the round (all in the same round of N).
* **loss**: ``--nnodes N-1:N`` (a second run); once all hold the first round, each host
  runs the agent's monitor loop over its participants (``restart_reason()`` every 0.1 s,
  then "stopping" and ``next_rendezvous``), the victim is SIGKILLed, and the figure is
  from etcd expiring its lease (the bench's own watch sees its registry key go) to the
  last survivor holding the new round of N-1; "kill->hold" includes the lease TTL.

c10d (torch's ``DynamicRendezvousHandler`` over its TCPStore, node 0 its host) runs in
the same harness at the sizes ``--c10d-max`` allows, its survivors told of the death at the
kill (a c10d agent learns it from its workers' failure). It has no etcd: time only.

    .venv/bin/python bench/rendezvous_sim.py --nodes 8 64 256 1024 --c10d-max 256
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import signal
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
os.environ.setdefault("ELASTIC_RDZV_HMAC_KEY", secrets.token_hex(16))  # signed, as in production
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
from etcd3 import events as etcd_events  # noqa: E402
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters  # noqa: E402

from agent.etcd import EmbeddedEtcd, EtcdClient, EtcdSettings, free_port  # noqa: E402
from agent.rendezvous import EtcdV3RendezvousHandler, registry  # noqa: E402
from agent.rendezvous.options import RendezvousOptions  # noqa: E402
from agent.rendezvous.signing import StateSigner  # noqa: E402
from forked_nodes import tree_cpu_seconds  # noqa: E402
from rendezvous_handlers import held_round  # noqa: E402
import sim_keepalive  # noqa: E402
from sim_keepalive import HostKeepAlive  # noqa: E402

OURS, C10D = "etcd-v3", "c10d"
MONITOR_INTERVAL_S = 0.1  # torch's monitor interval
SETTLE_S = 1.0
CORES = os.cpu_count() or 1


# ----------------------------------------------------------------------------- counting client


@dataclass
class Counter:
    """One participant's etcd traffic (only its own threads' requests and its own watches)."""

    requests: int = 0
    keepalives: int = 0
    events: int = 0
    event_bytes: int = 0
    read_bytes: int = 0
    callers: dict[str, int] = field(default_factory=dict)  # requests by the product function that made them
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **amounts: int) -> None:
        with self.lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def request(self, caller: str) -> None:
        with self.lock:
            self.requests += 1
            self.callers[caller] = self.callers.get(caller, 0) + 1

    def caller_counts(self) -> dict[str, int]:
        with self.lock:
            return dict(self.callers)

    def snapshot(self) -> tuple[int, int, int, int, int]:
        with self.lock:
            return self.requests, self.keepalives, self.events, self.event_bytes, self.read_bytes


def _kv_bytes(reply: Any) -> int:
    """Key and value bytes of a range answer in any of etcd3's shapes."""
    if reply is None:
        return 0
    kvs = getattr(reply, "kvs", None)
    if kvs is not None:
        return sum(len(kv.key) + len(kv.value) for kv in kvs)
    if isinstance(reply, tuple) and len(reply) == 2:  # (value, metadata) of c.get
        value, meta = reply
        return (len(value) if value else 0) + (len(meta.key) if meta is not None else 0)
    if isinstance(reply, list):
        return sum(_kv_bytes(item) for item in reply)
    return 0


class _RawProxy:
    """The process's one etcd3 client, seen by one participant: its watch callbacks and range
    reads are counted against that participant; everything else is the shared client's."""

    def __init__(self, raw: Any, counter: Counter) -> None:
        self._raw, self._counter = raw, counter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def _counted(self, callback: Callable[[Any], None]) -> Callable[[Any], None]:
        counter = self._counter

        def on_event(response: Any) -> None:
            if not isinstance(response, BaseException):
                events = getattr(response, "events", [])
                counter.add(events=len(events), event_bytes=sum(len(e.key) + len(e.value or b"") for e in events))
            callback(response)

        return on_event

    @property
    def watcher(self) -> "_CountedWatcher":
        """The shared client's watcher, counting this participant's watches' events (a mirror's
        watch is made on a watcher itself: :class:`agent.etcd.watches.OwnWatch`)."""
        return _CountedWatcher(self._raw.watcher, self._counted)

    @watcher.setter
    def watcher(self, value: Any) -> None:
        self._raw.watcher = value.raw if isinstance(value, _CountedWatcher) else value

    def add_watch_callback(self, key: Any, callback: Callable[[Any], None], **kwargs: Any) -> Any:
        return self._raw.add_watch_callback(key, self._counted(callback), **kwargs)

    def add_watch_prefix_callback(self, prefix: Any, callback: Callable[[Any], None], **kwargs: Any) -> Any:
        return self._raw.add_watch_prefix_callback(prefix, self._counted(callback), **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        reply = self._raw.get(*args, **kwargs)
        self._counter.add(read_bytes=_kv_bytes(reply))
        return reply

    def get_prefix(self, *args: Any, **kwargs: Any) -> Any:
        reply = list(self._raw.get_prefix(*args, **kwargs))
        self._counter.add(read_bytes=sum(_kv_bytes((v, m)) for v, m in reply))
        return iter(reply)

    def get_prefix_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = self._raw.get_prefix_response(*args, **kwargs)
        self._counter.add(read_bytes=_kv_bytes(reply))
        return reply

    def get_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = self._raw.get_response(*args, **kwargs)
        self._counter.add(read_bytes=_kv_bytes(reply))
        return reply


class _CountedWatcher:
    """A watcher whose new watches' events are counted; equal to another view of the same one."""

    def __init__(self, raw: Any, counted: Callable[[Callable[[Any], None]], Callable[[Any], None]]) -> None:
        self.raw, self._counted = raw, counted

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    def __eq__(self, other: object) -> bool:
        return self.raw is (other.raw if isinstance(other, _CountedWatcher) else other)

    def __hash__(self) -> int:
        return id(self.raw)

    def add_callback(self, key: Any, callback: Callable[[Any], None], **kwargs: Any) -> Any:
        return self.raw.add_callback(key, self._counted(callback), **kwargs)


class _SharedChannel:
    """A keep-alive channel shared by a process's participants: a participant's ``close``
    (its KeepAlive replacing a failed channel, or closing) must not end everybody's."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)

    def close(self) -> None:
        pass


class Connection_:
    """A host process's one etcd connection (a real :class:`EtcdClient`) and keep-alive channel."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.client = EtcdClient(settings, retry_deadline=30.0)
        self._channels: dict[tuple[str, int], _SharedChannel] = {}
        self._lock = threading.Lock()

    def channel(self, host: str, port: int) -> _SharedChannel:
        with self._lock:
            if (host, port) not in self._channels:
                self._channels[(host, port)] = _SharedChannel(self.client.member_channel(host, port))
            return self._channels[(host, port)]


_CLIENT_LAYER = (os.sep + os.path.join("agent", "etcd") + os.sep, __file__)


def _caller() -> str:
    """The first function outside the etcd client layer and this bench that made a request
    (``--callers``): which of a member's requests grew is then known, not guessed."""
    frame = sys._getframe(2)
    while frame is not None and any(part in frame.f_code.co_filename for part in _CLIENT_LAYER):
        frame = frame.f_back  # type: ignore[assignment]
    return frame.f_code.co_qualname if frame is not None else "?"


class CountingClient(EtcdClient):
    """One participant's :class:`EtcdClient`, over its host's shared connection, counted."""

    def __init__(self, shared: Connection_, counter: Counter) -> None:
        super().__init__(shared.client.settings, shared.client.retry_deadline)
        self.shared, self.counter = shared, counter
        self._version_checked = True  # the shared client checks once

    def _raw(self) -> Any:
        raw = self.shared.client._raw()
        for endpoint in raw.endpoints.values():
            # python3-etcd3 marks an endpoint failed after one request's timeout, and every other
            # request on the client then fails at once ("No endpoint available") until it is
            # retried: on one machine each agent's client is its own, here one participant's late
            # answer failed 31 others' requests for 30 s at 1,024 (as for ``_reset`` below)
            endpoint.time_retry = 0
        return _RawProxy(raw, self.counter)

    def _reset(self, failed: Any = None, error: BaseException | None = None) -> None:
        """Not the shared channel: on their own machines one node's timed-out request rebuilds
        its own channel only; here it would close hundreds of participants' channel under their
        requests, each of whose retries closes it again (256 participants failed so for 30 s).
        gRPC reconnects a channel to the one etcd by itself."""

    def member_channel(self, host: str, port: int) -> grpc.Channel:
        return self.shared.channel(host, port)  # type: ignore[return-value]

    def call(self, request: Callable[[Any], Any], *, deadline: float | None = None) -> Any:
        self.counter.request(_caller())
        return super().call(request, deadline=deadline)

    def request_metadata(self, deadline: float) -> Any:
        self.counter.add(keepalives=1)  # KeepAlive.refresh asks this once per keep-alive it sends
        return EtcdClient.call(self, lambda c: (tuple(c.metadata or ()), c.call_credentials), deadline=deadline)


# ----------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class Spec:
    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    lease_ttl: int
    c10d_port: int = 0
    monitor_interval: float = MONITOR_INTERVAL_S
    join_spread: float = 0.0
    request_timeout: float = 5.0


class Participant:
    def __init__(self, index: int, spec: Spec, shared: Connection_ | None) -> None:
        self.index, self.counter = index, Counter()
        self.handler = _make_handler(index, spec, shared, self.counter)
        self.busy = False


def _make_handler(index: int, spec: Spec, shared: Connection_ | None, counter: Counter) -> RendezvousHandler:
    name = f"node{index}"
    if spec.backend == OURS:
        assert shared is not None
        params = RendezvousParameters(OURS, spec.endpoint, spec.run_id, spec.min_nodes, spec.max_nodes,
                                      join_timeout=900, node_name=name, lease_ttl=spec.lease_ttl)
        options = RendezvousOptions.from_params(params)
        return EtcdV3RendezvousHandler(spec.run_id, options, CountingClient(shared, counter),
                                       StateSigner(options.hmac_key), spec.min_nodes, spec.max_nodes, None, name)
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend as c10d_backend
    params = RendezvousParameters(
        C10D, f"127.0.0.1:{spec.c10d_port}", spec.run_id, spec.min_nodes, spec.max_nodes, join_timeout=900,
        last_call_timeout=1, keep_alive_interval=max(1, spec.lease_ttl // 3), keep_alive_max_attempt=3,
        is_host=index == 0, read_timeout=900,
    )
    backend, store = c10d_backend(params)
    return dynamic_rendezvous.create_handler(store, backend, params)


class Host:
    """A process's participants and the agent's loop over them."""

    def __init__(self, link: Connection, spec: Spec, indices: list[int], per_connection: int) -> None:
        self.link, self.spec = link, spec
        host, port = spec.endpoint.split(":")
        # one connection per ``per_connection`` participants: hundreds of keep-alive streams and
        # watch creations on one HTTP/2 connection and one python3-etcd3 watcher (which creates
        # watches one at a time) stalled 256 participants' start for minutes
        self.connections = [Connection_(EtcdSettings(endpoints=((host, int(port)),),
                                                     request_timeout=spec.request_timeout))
                            for _ in range(max(1, -(-len(indices) // per_connection)))]
        self.keepalive: HostKeepAlive | None = None
        if spec.backend == OURS:
            for shared in self.connections:
                shared.client.call(lambda c: c.get("/"))  # each connection, checked once
            # every participant's lease on one keep-alive stream of this process (bench/sim_keepalive.py)
            first = self.connections[0]
            metadata, credentials = first.client.request_metadata(deadline=10.0)
            self.keepalive = HostKeepAlive(first.channel(host, int(port)), metadata, credentials, spec.lease_ttl,
                                           streams=max(1, -(-len(indices) // 8)))  # 8 leases a stream
            sim_keepalive.install(self.keepalive)
        self.participants = [Participant(i, spec, self.connections[k % len(self.connections)])
                             for k, i in enumerate(indices)]
        if spec.backend == OURS:  # up before "go", as agents that have been running are: lease, watch
            with ThreadPoolExecutor(max_workers=8) as pool:  # a few at a time: the start is not measured
                list(pool.map(lambda p: p.handler._start(), self.participants))  # type: ignore[attr-defined]
        self._send_lock = threading.Lock()
        self._following = threading.Event()
        self._quiet = threading.Event()

    def send(self, *message: Any) -> None:
        with self._send_lock:
            self.link.send(message)

    def _rendezvous(self, p: Participant, noticed: float) -> None:
        try:
            p.handler.next_rendezvous()
            held = time.monotonic()
            self.send("round", p.index, *held_round(p.handler), noticed, held)
        except BaseException as exc:  # noqa: BLE001 - told to the bench, which fails the size
            traceback.print_exc()
            self.send("error", p.index, f"{type(exc).__name__}: {exc}")
        finally:
            p.busy = False

    def start_round(self, p: Participant, noticed: float) -> None:
        p.busy = True
        threading.Thread(target=self._rendezvous, args=(p, noticed), daemon=True, name=f"rdzv-{p.index}").start()

    def _follow(self) -> None:
        """The agent's monitor loop (agent/node/node_agent.py) over every participant: each
        interval, ``restart_reason()``; when it names one, "stopping" and a new rendezvous."""
        while not self._quiet.is_set():
            tick = time.monotonic()
            for p in self.participants:
                if p.busy or not isinstance(p.handler, EtcdV3RendezvousHandler):
                    continue
                if p.handler.restart_reason() is not None:
                    noticed = time.monotonic()
                    p.handler.lease.update(state="stopping")
                    self.start_round(p, noticed)
            self._quiet.wait(max(0.0, self.spec.monitor_interval - (time.monotonic() - tick)))

    def serve(self) -> None:
        self.send("ready", os.getpid())
        while True:
            command = self.link.recv()
            if command == "go":
                now = time.monotonic()
                gap = self.spec.join_spread / max(1, len(self.participants))
                for k, p in enumerate(self.participants):  # staggered over --join-spread (0: at once)
                    if gap:
                        time.sleep(max(0.0, now + k * gap - time.monotonic()))
                    self.start_round(p, now)
            elif command == "follow":
                self._quiet.clear()
                threading.Thread(target=self._follow, daemon=True, name="monitor").start()
            elif command == "peer_died":  # c10d: what its agent learns from its workers
                now = time.monotonic()
                for p in self.participants:
                    self.start_round(p, now)
            elif command == "quiet":
                self._quiet.set()
                self.send("quiet")
            elif command == "counts":
                self.send("counts", {p.index: p.counter.snapshot() for p in self.participants})
            elif command == "callers":
                total: dict[str, int] = {}
                for p in self.participants:
                    for caller, count in p.counter.caller_counts().items():
                        total[caller] = total.get(caller, 0) + count
                self.send("callers", total)
            elif command == "stop":
                for p in self.participants:
                    _stop(p.handler)
                if self.keepalive is not None:
                    self.keepalive.close()
                self.send("stopped")
                return


def _stop(handler: RendezvousHandler) -> None:
    try:
        if isinstance(handler, EtcdV3RendezvousHandler):
            handler.close()
        else:
            handler._stop_heartbeats()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - the bench is ending anyway
        pass


def host_main(link: Connection, spec: Spec, indices: list[int], per_connection: int, bench_pid: int) -> None:
    """A host's process: dies with the bench (a SIGKILLed bench left eight hosts of 128
    participants running at a load of 100 until killed by hand)."""
    import logging

    from agent.worker.worker_boot import die_with_agent
    die_with_agent(bench_pid)
    logging.basicConfig(level=os.environ.get("SIM_LOG", "ERROR"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    try:
        Host(link, spec, indices, per_connection).serve()
    except (EOFError, BrokenPipeError):
        pass
    os._exit(0)  # daemon threads (watches, keep-alives) do not hold the process


# ----------------------------------------------------------------------------- bench side


class Hosts:
    """The host processes of one trial; index of host -> (process, link)."""

    def __init__(self, spec: Spec, n: int, hosts: int, timeout: float, per_connection: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        others = list(range(n - 1))
        groups = [others[h::hosts] for h in range(hosts)] + [[n - 1]]  # the victim alone, last
        self.procs, self.links = [], {}
        for h, indices in enumerate(groups):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=host_main, args=(theirs, spec, indices, per_connection, os.getpid()), daemon=True)
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.links[h] = ours
        self.victim = len(groups) - 1
        self.n = n
        ready = self.gather(lambda m: m[0] == "ready", timeout, "hosts ready")
        self.pids = [ready[h][1] for h in sorted(ready)]

    def send(self, message: str, to: list[int] | None = None) -> None:
        for h, link in self.links.items():
            if to is None or h in to:
                link.send(message)

    def gather(self, want: Callable[[Any], bool], timeout: float, what: str,
               links: dict[int, Connection] | None = None) -> dict[int, Any]:
        links = self.links if links is None else links
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        by_conn = {c: h for h, c in links.items()}
        while len(got) < len(links):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: {len(got)} of {len(links)} hosts within {timeout:.0f} s")
            for ready in wait([c for c, h in by_conn.items() if h not in got], timeout=left):
                h = by_conn[ready]  # type: ignore[index]
                try:
                    message = ready.recv()  # type: ignore[union-attr]
                except EOFError:
                    raise RuntimeError(f"{what}: host {h} exited (see its traceback above)") from None
                if want(message):
                    got[h] = message
        return got

    def rounds(self, expect: int, timeout: float, what: str, links: dict[int, Connection] | None = None,
               extra: list[Any] | None = None) -> dict[int, Any]:
        """``round`` messages until ``expect`` participants reported one; errors fail the trial."""
        links = self.links if links is None else links
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < expect:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: {len(got)} of {expect} participants within {timeout:.0f} s")
            for ready in wait(list(links.values()), timeout=min(left, 1.0)):
                message = ready.recv()  # type: ignore[union-attr]
                if message[0] == "round":
                    if message[1] in got and extra is not None:
                        extra.append(message)
                    got[message[1]] = message
                elif message[0] == "error":
                    raise RuntimeError(f"{what}: participant {message[1]}: {message[2]}")
        return got

    def counts(self, links: dict[int, Connection] | None = None) -> dict[int, tuple[int, ...]]:
        links = self.links if links is None else links
        for link in links.values():
            link.send("counts")
        merged: dict[int, tuple[int, ...]] = {}
        for message in self.gather(lambda m: m[0] == "counts", 120, "counts", links).values():
            merged.update(message[1])
        return merged

    def callers(self, links: dict[int, Connection] | None = None) -> dict[str, int]:
        """Requests by caller, summed over every participant of ``links``' hosts."""
        links = self.links if links is None else links
        for link in links.values():
            link.send("callers")
        total: dict[str, int] = {}
        for message in self.gather(lambda m: m[0] == "callers", 120, "callers", links).values():
            for caller, count in message[1].items():
                total[caller] = total.get(caller, 0) + count
        return total

    def close(self, links: dict[int, Connection] | None = None) -> None:
        links = self.links if links is None else links
        try:
            for link in links.values():
                link.send("stop")
            self.gather(lambda m: m[0] == "stopped", 60, "hosts stopping", links)
        except Exception:  # noqa: BLE001 - killed below either way
            pass
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


@dataclass
class Traffic:
    """Per-participant etcd traffic over one phase (a difference of two snapshots)."""

    requests: list[int]
    keepalives: list[int]
    events: list[int]
    event_bytes: list[int]
    read_bytes: list[int]

    @classmethod
    def between(cls, before: dict[int, tuple[int, ...]], after: dict[int, tuple[int, ...]],
                only: list[int]) -> "Traffic":
        zero = (0, 0, 0, 0, 0)
        rows = [tuple(a - b for a, b in zip(after[i], before.get(i, zero))) for i in only if i in after]
        return cls(*[list(col) for col in zip(*rows)])

    def per_node(self, name: str) -> float:
        return statistics.mean(getattr(self, name))

    def median(self, name: str) -> float:
        return float(statistics.median(getattr(self, name)))

    def top(self, name: str) -> int:
        return max(getattr(self, name))

    def total(self, name: str) -> int:
        return sum(getattr(self, name))


@dataclass
class Trial:
    backend: str
    n: int
    form_s: float = float("nan")
    form: Traffic | None = None
    form_cpu: float = float("nan")
    form_etcd_cpu: float = float("nan")
    expiry_s: float = float("nan")  # kill -> lease expiry seen
    reform_s: float = float("nan")  # expiry (c10d: kill) -> last survivor holds
    kill_s: float = float("nan")  # kill -> last survivor holds
    loss: Traffic | None = None
    loss_cpu: float = float("nan")
    loss_etcd_cpu: float = float("nan")
    extra_rounds: int = 0
    failed: str = ""
    form_callers: dict[str, int] = field(default_factory=dict)  # --callers: requests by caller, summed
    loss_callers: dict[str, int] = field(default_factory=dict)


def _minus(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _zero(h: Hosts) -> dict[int, tuple[int, ...]]:
    return h.counts()


def run_trial(backend: str, n: int, args: argparse.Namespace, etcd: EmbeddedEtcd, kill: bool) -> Trial:
    """One formation (min = max = N) or, with ``kill``, one loss (N-1:N) of the victim."""
    trial = Trial(backend, n)
    run_id = f"sim{'loss' if kill else 'form'}{n}-{time.time_ns()}"
    spec = Spec(backend, etcd.endpoint, run_id, n - 1 if kill else n, n, args.lease_ttl,
                free_port() if backend == C10D else 0, args.monitor_interval, args.join_spread,
                args.request_timeout)
    hosts = Hosts(spec, n, args.hosts, args.give_up, args.per_connection)
    watch_client: EtcdClient | None = None
    watch = None
    try:
        before = hosts.counts()
        callers0 = hosts.callers() if args.callers else {}
        cpu0 = tree_cpu_seconds([*hosts.pids, etcd.pid or 0])
        etcd0 = tree_cpu_seconds([etcd.pid or 0])
        go = time.monotonic()
        hosts.send("go")
        rounds = hosts.rounds(n, args.give_up, f"{backend} first round of {n}")
        cpu1 = tree_cpu_seconds([*hosts.pids, etcd.pid or 0])
        held = {(m[2], m[3]) for m in rounds.values()}
        if len(held) != 1 or next(iter(held))[1] != n:
            raise RuntimeError(f"participants hold different rounds or worlds (round, world): {sorted(held)}")
        trial.form_s = max(m[5] for m in rounds.values()) - go
        trial.form_cpu = cpu1 - cpu0
        trial.form_etcd_cpu = tree_cpu_seconds([etcd.pid or 0]) - etcd0
        after = hosts.counts()
        trial.form = Traffic.between(before, after, list(range(n)))
        if args.callers:
            trial.form_callers = _minus(hosts.callers(), callers0)
        if not kill:
            return trial
        deleted: dict[bytes, float] = {}
        if backend == OURS:
            watch_client = EtcdClient(etcd.settings())
            prefix = registry.nodes_prefix("/elastic", run_id)

            def on_event(response: Any) -> None:
                if not isinstance(response, BaseException):
                    for event in response.events:
                        if isinstance(event, etcd_events.DeleteEvent):
                            deleted.setdefault(event.key, time.monotonic())

            watch = watch_client.call(lambda c: c.add_watch_prefix_callback(prefix, on_event))
        survivors = {h: link for h, link in hosts.links.items() if h != hosts.victim}
        if backend == OURS:
            for link in survivors.values():
                link.send("follow")
        time.sleep(SETTLE_S)
        before = hosts.counts(survivors)
        callers0 = hosts.callers(survivors) if args.callers else {}
        cpu0 = tree_cpu_seconds([*hosts.pids, etcd.pid or 0])
        etcd0 = tree_cpu_seconds([etcd.pid or 0])
        killed = time.monotonic()
        os.kill(hosts.pids[hosts.victim], signal.SIGKILL)
        if backend == C10D:
            for link in survivors.values():
                link.send("peer_died")
        extra: list[Any] = []
        rounds = hosts.rounds(n - 1, args.give_up, f"{backend} new round of {n - 1}", survivors, extra)
        cpu1 = tree_cpu_seconds([*hosts.pids, etcd.pid or 0])
        held = {(m[2], m[3]) for m in rounds.values()}
        if len(held) != 1 or next(iter(held))[1] != n - 1:
            raise RuntimeError(f"survivors hold different rounds or worlds (round, world): {sorted(held)}")
        last = max(m[5] for m in rounds.values())
        expired = deleted.get(f"{registry.nodes_prefix('/elastic', run_id)}node{n - 1}".encode(), killed)
        trial.expiry_s = expired - killed if backend == OURS else float("nan")
        trial.reform_s = last - expired
        trial.kill_s = last - killed
        trial.loss_cpu = cpu1 - cpu0
        trial.loss_etcd_cpu = tree_cpu_seconds([etcd.pid or 0]) - etcd0
        after = hosts.counts(survivors)
        if args.callers:
            trial.loss_callers = _minus(hosts.callers(survivors), callers0)
        for link in survivors.values():
            link.send("quiet")
        hosts.gather(lambda m: m[0] == "quiet", 60, "quiet", survivors)
        trial.extra_rounds = len(extra)
        trial.loss = Traffic.between(before, after, list(range(n - 1)))
        return trial
    finally:
        if watch is not None and watch_client is not None:
            try:
                watch_client.call(lambda c: c.cancel_watch(watch))
            except Exception:  # noqa: BLE001
                pass
        if watch_client is not None:
            watch_client.close()
        hosts.close({h: link for h, link in hosts.links.items() if h != hosts.victim} if kill else None)


def _attempt(what: str, action: Callable[[], Trial]) -> Trial | None:
    try:
        return action()
    except Exception as exc:  # noqa: BLE001 - a size that fails is a finding: say so, go on
        print(f"  {what}: FAILED: {type(exc).__name__}: {exc}", flush=True)
        return None


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _row(t: Trial, c10d: Trial | None, phase: str) -> str:
    traffic = t.form if phase == "form" else t.loss
    seconds = t.form_s if phase == "form" else t.reform_s
    theirs = (c10d.form_s if phase == "form" else c10d.kill_s) if c10d else float("nan")
    ours_vs = seconds if phase == "form" else t.kill_s
    assert traffic is not None
    cpu = t.form_cpu if phase == "form" else t.loss_cpu
    etcd_cpu = t.form_etcd_cpu if phase == "form" else t.loss_etcd_cpu
    extra = "" if phase == "form" else f"  kill->expiry {t.expiry_s:5.2f}  kill->hold {t.kill_s:6.2f}  " \
                                       f"extra rounds {t.extra_rounds}"
    callers = t.form_callers if phase == "form" else t.loss_callers
    members = t.n if phase == "form" else t.n - 1
    if callers:  # --callers: each product function's requests per node, the most first
        extra += "\n       requests/node by caller: " + ", ".join(
            f"{name} {count / members:.2f}" for name, count in sorted(callers.items(), key=lambda kv: -kv[1])[:8])
    return (f"{t.n:>5}  {phase:>4}  {seconds:>7.2f}  {theirs:>6.2f}  {ours_vs / theirs:>5.2f}  "
            f"{traffic.per_node('requests'):>8.1f} {traffic.median('requests'):>5.0f} {traffic.top('requests'):>6}  "
            f"{traffic.per_node('keepalives'):>6.1f}  "
            f"{traffic.per_node('events'):>8.1f} {traffic.median('events'):>5.0f} {traffic.top('events'):>6}  "
            f"{traffic.per_node('event_bytes') / 1024:>8.1f} {traffic.per_node('read_bytes') / 1024:>8.1f}  "
            f"{traffic.total('requests'):>8} {traffic.total('events'):>9} "
            f"{(traffic.total('event_bytes') + traffic.total('read_bytes')) / 2**20:>8.1f}  "
            f"{cpu:>7.1f} {etcd_cpu:>6.2f}  {_load()}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--hosts", type=int, default=4, help="processes holding the participants (+1: the victim)")
    parser.add_argument("--per-connection", type=int, default=32,
                        help="participants sharing one etcd connection (client, channel, watch stream) in a host")
    parser.add_argument("--lease-ttl", type=int, default=15,
                        help="lease TTL, s (default 15: a thousand leases' keep-alives on 2 loaded cores)")
    parser.add_argument("--monitor-interval", type=float, default=MONITOR_INTERVAL_S,
                        help="the agent's monitor loop interval per host, s (default torch's 0.1)")
    parser.add_argument("--join-spread", type=float, default=0.0,
                        help="a host starts its participants' first rendezvous over this many seconds (0: at once)")
    parser.add_argument("--request-timeout", type=float, default=5.0,
                        help="etcd request timeout, s (the endpoint option request_timeout; default 5)")
    parser.add_argument("--c10d-max", type=int, default=256, help="run c10d up to this many nodes")
    parser.add_argument("--give-up", type=float, default=300.0, help="seconds before a phase counts as failed")
    parser.add_argument("--callers", action="store_true",
                        help="also print each phase's requests per node by the product function that made them")
    parser.add_argument("--no-kill", action="store_true", help="formation only")
    parser.add_argument("--no-form", action="store_true", help="the loss trial only (it forms a round first)")
    parser.add_argument("--etcd-log", type=Path)
    parser.add_argument("--etcd-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="where etcd keeps its data (default: /dev/shm, in memory)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"rendezvous_sim: {args.hosts} host processes + the victim's, {args.per_connection} participants per etcd "
          f"connection, lease TTL {args.lease_ttl} s, request timeout {args.request_timeout} s, "
          f"monitor every {args.monitor_interval} s, joins spread over {args.join_spread} s, "
          f"a host's leases on keep-alive streams of 8, {CORES} cores, load {_load()}", flush=True)
    header = (f"{'nodes':>5}  {'':>4}  {'ours s':>7}  {'c10d s':>6}  {'ratio':>5}  {'req/node':>8} {'med':>5} {'max':>6}  "
              f"{'k-a/n':>6}  {'ev/node':>8} {'med':>5} {'max':>6}  {'evKiB/n':>8} {'rdKiB/n':>8}  "
              f"{'req tot':>8} {'ev tot':>9} {'MiB tot':>8}  {'cpu s':>7} {'etcd':>6}  load")
    # etcd's data in memory: on this shared machine its fdatasync took seconds under other
    # engineers' disk load, and a thousand registrations crawled (1 a second) with etcd idle
    data_dir = tempfile.mkdtemp(prefix="etcd-sim-", dir=args.etcd_dir)
    with EmbeddedEtcd(data_dir=data_dir, log_path=args.etcd_log) as etcd:
        print(header, flush=True)
        for n in args.nodes:
            form = None if args.no_form else _attempt(f"{OURS} form {n}", lambda: run_trial(OURS, n, args, etcd, False))
            c10d_form = _attempt(f"{C10D} form {n}", lambda: run_trial(C10D, n, args, etcd, kill=False)) \
                if n <= args.c10d_max and not args.no_form else None
            if form is not None:
                print(_row(form, c10d_form, "form"), flush=True)
            if args.no_kill:
                continue
            loss = _attempt(f"{OURS} loss {n}", lambda: run_trial(OURS, n, args, etcd, kill=True))
            c10d_loss = _attempt(f"{C10D} loss {n}", lambda: run_trial(C10D, n, args, etcd, kill=True)) \
                if n <= args.c10d_max else None
            if loss is not None:
                if form is None:  # --no-form: the loss trial's own first round (N of N-1:N) is a formation too
                    print(_row(loss, None, "form"), flush=True)
                print(_row(loss, c10d_loss, "loss"), flush=True)
    shutil.rmtree(data_dir, ignore_errors=True)
    print("(form: go -> all hold; loss: lease expiry -> all survivors hold (c10d: kill -> all hold, and the ratio\n"
          " compares kill -> hold); req: etcd requests, keep-alives apart (k-a); ev: watch events; /node: the mean\n"
          " (the stewards' share included), med: the median participant (a member), max: the busiest (a steward);\n"
          " KiB/n: watch-event and range-read bytes per node; cpu: hosts + etcd, and etcd's\n"
          " alone (the etcd CPU also counts every participant's keep-alives in the phase))")


if __name__ == "__main__":
    main()
