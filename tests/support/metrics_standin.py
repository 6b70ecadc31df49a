"""A STAND-IN for a node's metrics endpoint: real prometheus_client, fake training.

It serves the catalogue's metric names (worker and agent) over real HTTP from a real
``CollectorRegistry``, so Prometheus, ``elastic sd``/``top`` and the rules see genuine
text exposition. The numbers are made up: each :meth:`StandinNode.step` stands for one
training step on each local rank, with a fixed step time per rank and fixed all-reduce
bytes and time, so tests know exactly what rates, quantiles and bandwidths to expect.
The real worker metrics are tested on real runs elsewhere.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from agent.node.goodput import GoodputMetrics
from elastic.goodput import Account, Interval, extend

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH = 32  # samples per rank per step
XID = {1: 79}  # the stand-in DCGM's GPU 1 last reported XID 79 ("GPU has fallen off the bus")


def gpu_uuid(host: str, index: int) -> str:
    """A made-up GPU uuid in NVML's format, the same for a host's stand-in node and stand-in DCGM."""
    return f"GPU-{sum(host.encode()):08x}-0000-4000-8000-{index:012x}"


class WholeStepsRegistry(CollectorRegistry):
    """A registry whose scrapes never fall inside a :meth:`StandinNode.step`: one that read a
    step's bytes without its time (or a histogram's sum without its count) would skew the
    exact rates the tests expect, and did on a loaded CI machine."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def collect(self):
        with self.lock:
            families = list(super().collect())
        yield from families


@dataclass
class StandinNode:
    """One node with ``step_seconds[rank]`` per local rank, in a world of ``world_size``."""

    step_seconds: dict[int, float]
    world_size: int
    host: str = "standin"  # hostname; local rank i has this host's GPU i (see dcgm_registry)
    allreduce_bytes: int = 4_000_000  # per rank per step
    allreduce_seconds: float = 0.01  # per rank per step
    registry: WholeStepsRegistry = field(default_factory=WholeStepsRegistry)

    def __post_init__(self) -> None:
        r, rank, coll = self.registry, ("rank",), ("op", "backend")
        self.steps = Counter("elastic_steps_total", "steps", rank, registry=r)
        self.samples = Counter("elastic_samples_total", "samples", rank, registry=r)
        self.step_duration = Histogram("elastic_step_duration_seconds", "step time", rank,
                                       buckets=STEP_BUCKETS, registry=r)
        self.data_wait = Histogram("elastic_data_wait_seconds", "data wait", rank, registry=r)
        self.last_step = Gauge("elastic_last_step_timestamp_seconds", "last step", rank, registry=r)
        self.rank = Gauge("elastic_rank", "rank", rank, registry=r)
        self.world = Gauge("elastic_world_size", "world", registry=r)
        self.coll_time = Histogram("elastic_collective_duration_seconds", "collective time", coll, registry=r)
        self.coll_bytes = Counter("elastic_collective_bytes_total", "collective bytes", coll, registry=r)
        self.durable = Gauge("elastic_snapshot_last_durable_timestamp_seconds", "durable", registry=r)
        self.restarts = Counter("elastic_agent_restarts_total", "restarts", ("reason",), registry=r)
        self.loss = Gauge("elastic_loss", "loss", rank, registry=r)
        self.tokens = Counter("elastic_tokens_total", "tokens", rank, registry=r)
        self.errors = Counter("elastic_collective_errors_total", "collective errors", coll, registry=r)
        self._once(r)
        self.world.set(self.world_size)
        info = Gauge("elastic_rank_info", "rank info", ("rank", "local_rank", "node", "hostname", "gpu_uuid"),
                     registry=r)
        for local, rk in enumerate(self.step_seconds):
            self.rank.labels(str(rk)).set(rk)
            info.labels(str(rk), str(local), self.host, self.host, gpu_uuid(self.host, local)).set(1)
        self.restarts.labels("worker_failed").inc(0)
        self.errors.labels("allreduce", "gloo").inc(0)
        self._server: object | None = None
        self._stop = threading.Event()

    def _once(self, r: CollectorRegistry) -> None:
        """The rest of the catalogue, set once: what a node shows after one rendezvous and snapshot."""
        Gauge("elastic_build_info", "build", ("version", "torch_version", "backend", "device"),
              registry=r).labels("0.1.0", "2.14.1", "gloo", "cpu").set(1)
        Gauge("elastic_worker_restarts", "worker restarts", registry=r).set(0)
        Gauge("elastic_restore_seconds", "restore", registry=r).set(0.5)
        Gauge("elastic_time_to_first_step_seconds", "first step", registry=r).set(2.0)
        Histogram("elastic_snapshot_stall_seconds", "stall", registry=r).observe(0.02)
        Histogram("elastic_snapshot_write_seconds", "write", registry=r).observe(0.3)
        Counter("elastic_snapshot_bytes_total", "snapshot bytes", registry=r).inc(1_000_000)
        Histogram("elastic_agent_rendezvous_duration_seconds", "rendezvous", ("outcome",),
                  registry=r).labels("ok").observe(2.1)
        Gauge("elastic_agent_remaining_restarts", "remaining", registry=r).set(100)
        state = Gauge("elastic_agent_worker_group_state", "state", ("state",), registry=r)
        for name in ("init", "healthy", "unhealthy", "stopped", "succeeded", "failed"):
            state.labels(name).set(1 if name == "healthy" else 0)
        Gauge("elastic_agent_nodes_in_round", "nodes", registry=r).set(2)
        Gauge("elastic_agent_round", "round", registry=r).set(1)
        Gauge("elastic_agent_spare", "spare", registry=r).set(0)
        Gauge("elastic_agent_info", "agent", ("node", "version"), registry=r).labels("standin", "0.1.0").set(1)
        Counter("elastic_agent_etcd_errors_total", "etcd errors", ("op",), registry=r).labels("put").inc(0)
        # Goodput as the agents export it (the real families): one fault so far, and every
        # step below adds its seconds, nearly all productive.
        self.goodput = GoodputMetrics(r)
        self.goodput.mirror(extend(Account(), [
            Interval(start=0.0, end=100.0, cause="productive", step=50),
            Interval(end=101.5, cause="detection", reason="peer_lost", nodes=("b",)),
            Interval(start=101.5, end=102.0, cause="rendezvous"), Interval(start=102.0, end=102.2, cause="restore"),
            Interval(start=102.2, end=110.0, cause="productive", step=60)]))

    def step(self, n: int = 1) -> None:
        with self.registry.lock:
            self._step(n)

    def _step(self, n: int) -> None:
        for _ in range(n):
            for rk, seconds in self.step_seconds.items():
                label = str(rk)
                self.steps.labels(label).inc()
                self.samples.labels(label).inc(BATCH)
                self.tokens.labels(label).inc(BATCH * 128)
                self.loss.labels(label).set(1.0)
                self.step_duration.labels(label).observe(seconds)
                self.data_wait.labels(label).observe(seconds / 10)
                self.last_step.labels(label).set(time.time())
                self.coll_time.labels("allreduce", "gloo").observe(self.allreduce_seconds)
                self.coll_bytes.labels("allreduce", "gloo").inc(self.allreduce_bytes)
            slowest = max(self.step_seconds.values(), default=0.0)
            self.goodput.productive.inc(0.9 * slowest)
            self.goodput.lost.labels(cause="snapshot").inc(0.1 * slowest)

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()

    # -- serving ---------------------------------------------------------------------------
    def serve(self, steps_per_second: float = 0.0) -> str:
        """Serve ``/metrics`` on a free loopback port (and step in the background); its URL."""
        server, _ = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self._server = server
        if steps_per_second > 0:
            threading.Thread(target=self._ticker, args=(1.0 / steps_per_second,), daemon=True).start()
        return f"http://127.0.0.1:{server.server_port}/metrics"

    def _ticker(self, period: float) -> None:
        while not self._stop.wait(period):
            self.step()

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def dcgm_registry(gpus: int = 2, host: str = "standin") -> CollectorRegistry:
    """A STAND-IN for NVIDIA's DCGM exporter (which needs GPUs and cannot run here): its metric
    and label names as released dcgm-exporter 4.x writes them (``Hostname`` capitalised), the
    ``UUID`` in NVML's format, fixed values. GPU ``i`` temperature ``60 + i`` C."""
    r = CollectorRegistry()
    labels = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname")
    for name, value in (("DCGM_FI_DEV_GPU_UTIL", 87), ("DCGM_FI_DEV_FB_USED", 30_000),
                        ("DCGM_FI_DEV_POWER_USAGE", 350.5), ("DCGM_FI_DEV_GPU_TEMP", 60),
                        ("DCGM_FI_DEV_SM_CLOCK", 1980)):
        gauge = Gauge(name, name, labels, registry=r)
        for gpu in range(gpus):
            gauge.labels(*_gpu_labels(host, gpu)).set(value + (gpu if name == "DCGM_FI_DEV_GPU_TEMP" else 0))
    xid = Gauge("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.",
                labels + ("err_code", "err_msg"), registry=r)
    for gpu in range(gpus):
        code = XID.get(gpu, 0)
        xid.labels(*_gpu_labels(host, gpu), str(code),
                   "GPU has fallen off the bus" if code else "No Error").set(code)
    return r


def _gpu_labels(host: str, gpu: int) -> tuple[str, ...]:
    return (str(gpu), gpu_uuid(host, gpu), f"00000000:{0x18 + gpu:02X}:00.0", f"nvidia{gpu}",
            "NVIDIA H100 80GB HBM3", host)
