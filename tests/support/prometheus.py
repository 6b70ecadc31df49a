"""A real Prometheus for the tests: the shipped deploy/prometheus configs with short intervals.

Shared by tests/deploy/test_prometheus.py (stand-in endpoints) and
tests/deploy/test_prometheus_real_run.py (real agents): ``prometheus``/``promtool`` from
Debian's package, ``elastic sd`` in-process on a free port, and a small PromQL client.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from agent.tools.etcd_args import EtcdTarget
from agent.tools.sd import SdServer
from agent.etcd import free_port
from tests.support.waiting import wait_until

PROM = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = PROM / "rules"
SHIPPED_SD_URL = "http://127.0.0.1:9470/targets"  # what prometheus.yml expects `elastic sd` at


def ensure_prometheus() -> str:
    """promtool's path; deploy/prometheus/ensure-prometheus.sh installs it if missing (as `make test` does)."""
    if shutil.which("promtool") is None or shutil.which("prometheus") is None:
        done = subprocess.run(["sh", str(PROM / "ensure-prometheus.sh")], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            pytest.fail(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no promtool")
    return shutil.which("promtool") or "promtool"


def shortened(config: str, **urls: str) -> str:
    """The shipped config with test-sized intervals; fails if the shipped text drifted."""
    swaps = {"scrape_interval: 10s": "scrape_interval: 1s", "scrape_timeout: 5s": "scrape_timeout: 1s",
             "evaluation_interval: 10s": "evaluation_interval: 1s", "refresh_interval: 15s": "refresh_interval: 1s",
             "refresh_interval: 30s": "refresh_interval: 1s", **urls}
    text = (PROM / config).read_text()
    for old, new in swaps.items():
        if old in text:
            text = text.replace(old, new)
        else:
            assert old.startswith("refresh_interval"), f"{config} no longer has {old!r}"
    return text


def start_sd(target: EtcdTarget) -> SdServer:
    """``elastic sd`` on a free loopback port, serving in a daemon thread; shutdown() and server_close() it."""
    sd = SdServer(target, "127.0.0.1", 0)
    threading.Thread(target=sd.serve_forever, daemon=True).start()
    return sd


def http_sd_config(sd: SdServer) -> str:
    """The shipped prometheus.yml (http_sd through ``elastic sd``), shortened, pointed at ``sd``."""
    return shortened("prometheus.yml", **{SHIPPED_SD_URL: f"http://127.0.0.1:{sd.port}/targets"})


class PrometheusServer:
    """``prometheus`` on a free loopback port over a copy of deploy/prometheus."""

    def __init__(self, workdir: Path, config_text: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(RULES, workdir / "rules")
        (workdir / "file_sd").mkdir()
        (workdir / "prometheus.yml").write_text(config_text)
        # picked ahead (a race left, issue 40): reading back the port a :0 listen address got is not done yet
        self.workdir, self.port = workdir, free_port()
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "PrometheusServer":
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={self.workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir)
        wait_until(lambda: self._get("/-/ready") is not None, 30, "prometheus to be ready",
                   on_timeout=self.tail)
        return self

    def _get(self, path: str) -> Any:
        assert self.proc is not None and self.proc.poll() is None, self.tail()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as reply:
                body = reply.read()
        except OSError:
            return None
        return json.loads(body) if body.startswith(b"{") else body

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query (at ``at``, a Unix time, if given); [] when Prometheus did not answer."""
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        reply = self._get("/api/v1/query?" + urllib.parse.urlencode(params))
        return reply["data"]["result"] if reply else []

    def api(self, path: str) -> Any:
        return self._get("/api/v1/" + path)["data"]

    def targets(self, job: str) -> list[tuple[str, str, str]]:
        """The active targets of scrape job ``job`` as sorted (node, run_id, health)."""
        reply = self._get("/api/v1/targets?state=active")
        rows = reply["data"]["activeTargets"] if reply else []
        return sorted((t["labels"].get("node", ""), t["labels"].get("run_id", ""), t["health"]) for t in rows
                      if t["labels"].get("job") == job)

    def rules(self) -> list[dict[str, Any]]:
        """Every recording and alerting rule with its health, lastError and, for records, name."""
        return [r for g in self.api("rules")["groups"] for r in g["rules"]]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def value_of(rows: list[dict[str, Any]]) -> dict[tuple[str, ...], float]:
    """A query's result as {(run_id, node, rank): value}, a missing label as ""."""
    return {tuple(r["metric"].get(k, "") for k in ("run_id", "node", "rank")): float(r["value"][1]) for r in rows}
