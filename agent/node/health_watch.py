"""Runs :mod:`agent.node.health`'s checks for the node agent, and keeps a sick node out of rounds.

Before each round it joins (at start, after a restart or a keep-out), the agent asks
:meth:`HealthWatch.gate`: a node that fails a check does not join
(:func:`agent.node.policy.before_joining` decides, the gate carries it out). It holds a keep-out key
with the failed check as its cause (``elastic top`` shows it; the registry's state says
``kept_out``), logs one line naming the check and the fix, and looks again after the
back-off of its strike, counted with every keep-out of the node (:mod:`agent.node.keep_outs`): it joins as
soon as every check passes. While it trains, :meth:`HealthWatch.look` runs the checks every
:data:`agent.node.health.INTERVAL_S`; ``agent.node.policy`` decides what a failure then means.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from agent.rendezvous.keepout import KeepOut

from elastic import contract
from agent.node import health
from agent.node.health import Check, HealthReport, Limits
from agent.node.events import EventLog, HealthyAgain, NoEvents, NotJoining
from agent.node.keep_outs import KeepOuts
from agent.node.nulls import NoGauge
from agent.node.policy import before_joining

log = logging.getLogger("elastic.agent")


_PROBE_TIMEOUT_S = 2.0  # the bucket's HEAD: a look must not hold the agent up


def _snapshot_tiers(snapshot_dir: Path | str | None) -> tuple[Path | None, str | None]:
    """What of this node's snapshot location to check, as ``(directory, s3_url)``: the location
    itself (a directory, or a bucket), or both tiers of ``DIR,s3://...`` (never one directory
    named ``DIR,s3:``, which does not exist and kept every node out)."""
    from checkpoints.location import is_remote, split_tiers

    if snapshot_dir is None:
        return None, None
    tiers = split_tiers(snapshot_dir)
    if tiers is not None:
        return Path(tiers[0]), tiers[1]
    if is_remote(snapshot_dir):
        return None, str(snapshot_dir)
    return Path(snapshot_dir), None


def _bucket_probe(url: str) -> Callable[[], None]:
    """One HEAD of ``url``'s bucket, a short timeout and no long retries; its client is made
    at the first look (boto3 only for a node that uses an object store) and kept."""
    client: list[Any] = []

    def probe() -> None:
        if not client:
            from checkpoints.location import parse_s3
            from checkpoints.s3client import S3Objects

            client.append(S3Objects(parse_s3(url), retry_for_s=0.0, timeout_s=_PROBE_TIMEOUT_S))
        client[0].probe()

    return probe


class HealthWatch:
    """The checks of one node. ``etcd``: its :class:`~agent.etcd.settings.EtcdSettings`
    (the clock is compared with etcd's), None without etcd; ``gauge``: a Prometheus gauge
    labelled ``check``, set to 1 while that check fails."""

    def __init__(self, node: str, snapshot_dir: Path | str | None, work_dir: Path, worker_env: Mapping[str, str],
                 etcd: Any = None, gauge: Any = None, limits: Limits | None = None,
                 events: EventLog | NoEvents | None = None) -> None:
        self.node = node
        self.events = events if events is not None else NoEvents()  # what it did, for tools (agent.node.events)
        self.dirs = {"agent_dir": Path(work_dir)}
        disk, self.bucket = _snapshot_tiers(snapshot_dir)
        if disk is not None:
            self.dirs = {"snapshot_dir": disk, **self.dirs}
        self._probe = _bucket_probe(self.bucket) if self.bucket else None
        self.chosen_by: dict[str, str] = {}
        chosen = {"GLOO_SOCKET_IFNAME": worker_env.get("GLOO_SOCKET_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME", ""),
                  contract.HEAL_IFNAME_ENV: worker_env.get(contract.HEAL_IFNAME_ENV)
                  or os.environ.get(contract.HEAL_IFNAME_ENV, "")}
        for variable, names in chosen.items():
            for name in (n.strip() for n in names.split(",")):
                if name:
                    self.chosen_by.setdefault(name, variable)
        self.interfaces = tuple(self.chosen_by)
        self.etcd = etcd
        self.gauge = gauge if gauge is not None else NoGauge()  # NoGauge: no metrics to export
        self.limits = limits or Limits.from_env(os.environ)
        self.interval = self.limits.interval_s
        self.report: HealthReport | None = None
        self._said = ""

    def checks(self) -> HealthReport:
        """Every check now (a few ms, one etcd request, one HEAD of the snapshot bucket and one
        ``nvidia-smi`` where there are those)."""
        found: list[Check] = []
        for role, path in self.dirs.items():
            found.append(health.disk_space(role, path, self.limits.min_free_bytes))
            found.append(health.writable(role, path))
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            meminfo = ""
        found.append(health.memory(self.limits.min_mem_bytes, meminfo))
        if self.bucket and self._probe is not None:
            found.append(health.reachable("snapshot_bucket", self.bucket, self._probe))
        if self.etcd is not None:
            s = self.etcd
            skew, uncertainty, source = health.etcd_skew(
                s.endpoints, str(s.cacert) if s.cacert else None, str(s.cert) if s.cert else None,
                str(s.key) if s.key else None)
            found.append(health.clock(skew, uncertainty, self.limits.max_skew_s, source))
        found.append(health.interface(self.interfaces, health.net_flags, self.chosen_by))
        found.append(health.gpus(*health.gpu_query()))
        return HealthReport(tuple(found), at=time.time())

    def look(self, force: bool = False, quiet: bool = False) -> str:
        """:func:`agent.node.health.verdict` of a fresh report (at most every ``interval`` unless
        ``force``): '' for a healthy node. Sets the gauge; a new failure is logged once
        (``quiet``: the caller says it)."""
        if not self.limits.enabled:
            return ""
        if force or self.report is None or time.time() - self.report.at >= self.interval:
            self.report = self.checks()
            for check in self.report.checks:
                self.gauge.labels(check=check.name).set(0 if check.ok else 1)
        line = health.verdict(self.report)
        if line and line != self._said and not quiet:
            log.warning("[%s] %s", self.node, line)
        self._said = line
        return line

    def gate(self, round_number: int, keep_outs: KeepOuts, publish: Callable[[KeepOut | None], None]) -> bool:
        """Before a round: return at once for a healthy node; else stay out (``publish`` the
        keep-out key, with the failed checks as its cause, its strikes counted with every other
        keep-out of this node: :mod:`agent.node.keep_outs`) until every check passes. False if
        the job ended meanwhile."""
        decision = before_joining(self.look(force=True, quiet=True))  # its own line says it, with the keep-out
        if decision is None:
            return True
        since = time.monotonic()
        while decision is not None:
            line = decision.detail
            out = keep_outs.strike(line, round_number)
            log.error("[%s] not joining the job: %s; kept out %.0f s (strike %d), then checked again",
                      self.node, line, out.backoff, out.strikes)
            self.events.emit(NotJoining(line, out.backoff, out.strikes))
            publish(out)
            if not keep_outs.stay_out(out):
                publish(None)
                return False
            decision = before_joining(self.look(force=True, quiet=True))
        publish(None)
        log.info("[%s] health checks pass again after %.0f s kept out; joining the job", self.node,
                 time.monotonic() - since)
        self.events.emit(HealthyAgain(time.monotonic() - since))
        return True
