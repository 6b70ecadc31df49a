"""The node's Prometheus endpoint: the agent's own metrics plus its workers', merged.

Workers write prometheus-client multiprocess files into a directory the agent owns
(``PROMETHEUS_MULTIPROC_DIR``); one scrape of the agent returns every local rank, and a
killed worker's gauges are dropped (``mark_process_dead``) while its counters stay, so
rates never go backwards across a restart. The agent also names each live rank's host and
GPU (``elastic_rank_info``) for workers that do not name themselves.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from elastic.metrics.multiprocess import collector_registry, mark_dead
from elastic.metrics.rank_info import RankInfo, agent_gpu_uuids, dcgm_hostname

log = logging.getLogger(__name__)

STATES = ("init", "healthy", "unhealthy", "stopped", "succeeded", "failed", "unknown")
RENDEZVOUS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 300, 600)


class AgentMetrics:
    def __init__(self, node: str, version: str, worker_dir: Path) -> None:
        self.node = node
        self.worker_dir = worker_dir
        self._workers: dict[int, RankInfo] = {}  # pid -> rank info; replaced whole, read by scrapes
        self._gpus: list[str] | None = None  # GPU uuid by local rank, asked of nvidia-smi once
        # the workers' files, merged at each scrape; rank info of workers that give none
        self.registry = collector_registry(worker_dir, stand_in=lambda: self._workers)
        r = self.registry
        self.rendezvous = Histogram("elastic_agent_rendezvous_duration_seconds",
                                    "Time from entering a rendezvous round to its close, by outcome",
                                    ["outcome"], buckets=RENDEZVOUS_BUCKETS, registry=r)
        self.restarts = Counter("elastic_agent_restarts", "Worker-group restarts on this node, by reason",
                                ["reason"], registry=r)
        self.remaining_restarts = Gauge("elastic_agent_remaining_restarts",
                                        "Restarts left before the job fails (--max-restarts)", registry=r)
        self.state = Gauge("elastic_agent_worker_group_state",
                           "1 for the worker group's current state", ["state"], registry=r)
        self.nodes_in_round = Gauge("elastic_agent_nodes_in_round", "Nodes in this node's current round",
                                    registry=r)
        self.round = Gauge("elastic_agent_round", "Number of this node's current rendezvous round", registry=r)
        self.etcd_errors = Counter("elastic_agent_etcd_errors",
                                   "etcd requests that failed for good (after retries), by kind of failure",
                                   ["op"], registry=r)
        self.reforms = Counter("elastic_agent_inplace_reforms",
                               "Rounds this node's in-place workers joined without a restart, by reason",
                               ["reason"], registry=r)
        self.worker_starts = Counter("elastic_agent_worker_starts",
                                     "Worker processes started: warm (forked from the node's pre-imported "
                                     "template, or a standby) or cold", ["mode"], registry=r)
        self.standbys_ready = Gauge("elastic_agent_standby_workers_ready",
                                    "Local ranks that can start warm now, from the template or a standby "
                                    "(0 with --no-warm-start)", registry=r)
        self.keepalive_age = Gauge("elastic_agent_etcd_keepalive_age_seconds",
                                   "Seconds since this node sent the last etcd keep-alive etcd confirmed "
                                   "(its workers stop at the lease TTL unless every peer confirms an etcd outage)",
                                   registry=r)
        self.etcd_outage = Gauge("elastic_agent_etcd_outage",
                                 "1 while this node trains through an etcd outage every member of its round confirms",
                                 registry=r)
        self.kept_out = Gauge("elastic_agent_kept_out",
                              "1 while this node is kept out of rounds because its peers cannot reach it", registry=r)
        self.keep_out_backoff = Gauge("elastic_agent_keep_out_backoff_seconds",
                                      "The current keep-out back-off (doubles each time the node is kept out again)",
                                      registry=r)
        self.kept_out_total = Counter("elastic_agent_keep_outs", "Times this node was kept out of a round because "
                                      "its peers could not reach it, or for a crash loop", registry=r)
        self.spare = Gauge("elastic_agent_spare",
                           "1 while this node waits as a spare: the world is full (--nnodes MAX) without it, and "
                           "it takes the place of the next member lost", registry=r)
        self.spare_workers_ready = Gauge("elastic_agent_spare_workers_ready",
                                         "A spare's workers started ahead with the script's start-up done, "
                                         "waiting at the loop's first batch for a place", registry=r)
        self.pace = Gauge("elastic_agent_pace_seconds",
                          "This node's pace as published for straggler detection: its slowest local rank's "
                          "median compute seconds per step (0: none yet)", registry=r)
        self.straggler = Gauge("elastic_agent_straggler",
                               "1 for a node this agent names a straggler: its pace is over 1.5x the other "
                               "members' median, 3 windows in a row", ["node"], registry=r)
        self.straggler.labels(node=node).set(0)  # a series from the start, so dashboards and alerts see 0, not nothing
        self.straggler_evictions = Counter("elastic_agent_straggler_evictions",
                                           "Times this node evicted itself as a straggler (kept out for the "
                                           "back-off, then back)", registry=r)
        self.health_failing = Gauge("elastic_agent_health_check_failing",
                                    "1 while this node fails the health check named by check (agent.node.health): it "
                                    "joins no round meanwhile", ["check"], registry=r)
        self.crash_loops = Counter("elastic_agent_crash_loops", "Times this node's workers failed right after each "
                                   "of 3 starts in a row, and the node was kept out (or the job failed)", registry=r)
        Gauge("elastic_agent_info", "This agent: node name and version", ["node", "version"],
              registry=r).labels(node=node, version=version).set(1)
        for op in ("unavailable", "denied", "refused"):
            self.etcd_errors.labels(op=op)
        for mode in ("warm", "cold"):
            self.worker_starts.labels(mode=mode)
        for reason in ("worker_failed", "peer_lost", "hang", "scale_up", "lease_lost"):
            self.restarts.labels(reason=reason)  # export zeros, so rate() works from the start
        for reason in ("peer_lost", "scale_up", "reform", "frozen"):
            self.reforms.labels(reason=reason)
        self.set_state("init")
        self.url: str | None = None

    def set_state(self, current: str) -> None:
        for state in STATES:
            self.state.labels(state=state).set(1 if state == current else 0)

    def serve(self, addr: str, port: int, advertise_host: str) -> str:
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        bound = server.server_address[1]
        self.url = f"http://{advertise_host}:{bound}/metrics"
        log.info("metrics at %s", self.url)
        return self.url

    def workers_started(self, worker_group: Any, pids: Mapping[int, int]) -> None:
        """``pids`` (local rank -> pid, what ``_start_workers`` returns) just started.

        The agent then exports ``elastic_rank_info`` for each of them until the worker
        exports its own (``ElasticRun`` does); scripts that do not use ``ElasticRun`` get
        theirs from here. The GPU is the one ``cuda:LOCAL_RANK`` names (torchrun's
        convention), found without CUDA: ``CUDA_VISIBLE_DEVICES`` and ``nvidia-smi``.
        """
        if self._gpus is None:  # the first start only: nvidia-smi takes a fraction of a second
            self._gpus = agent_gpu_uuids(worker_group.spec.local_world_size)
        hostname = dcgm_hostname()
        workers = {}
        for worker in worker_group.workers:
            pid = pids.get(worker.local_rank)
            if pid is not None:
                gpu = self._gpus[worker.local_rank] if worker.local_rank < len(self._gpus) else ""
                workers[int(pid)] = RankInfo(worker.global_rank, worker.local_rank, self.node, hostname, gpu)
        self._workers = {**self._workers, **workers}  # whole: scrapes read it

    def forget_pids(self, pids: list[int]) -> None:
        """Stopped workers: their live gauges go, their counters stay (see module doc)."""
        gone = {int(pid) for pid in pids}
        self._workers = {pid: info for pid, info in self._workers.items() if pid not in gone}  # whole: scrapes read it
        for pid in pids:
            try:
                mark_dead(int(pid), self.worker_dir)
            except (ValueError, OSError):
                pass
