"""A real etcd with TLS, client-certificate auth and RBAC, using deploy/certs."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from agent.etcd import EmbeddedEtcd, ServerTLS, find_etcd_binary

REPO = Path(__file__).resolve().parents[2]
MAKE_CERTS = REPO / "deploy" / "certs" / "make-certs.sh"
ROOT_PASSWORD = "root-pw-for-tests"
TRAINER_PASSWORD = "trainer-pw-for-tests"


def make_certs(out: Path, *clients: str) -> Path:
    args = [str(MAKE_CERTS), str(out), "127.0.0.1"]
    for client in clients or ("trainer",):
        args += ["--client", client]
    subprocess.run(args, check=True, capture_output=True)
    return out


@dataclass
class SecureEtcd:
    server: EmbeddedEtcd
    certs: Path

    def etcdctl(self, *args: str, user: str | None = f"root:{ROOT_PASSWORD}") -> str:
        cmd = [str(find_etcd_binary().with_name("etcdctl")), "--endpoints", self.server.url]
        if self.server.tls:
            cmd += [
                "--cacert", str(self.certs / "ca.pem"),
                "--cert", str(self.certs / "server.pem"),
                "--key", str(self.certs / "server-key.pem"),
            ]
        if user:
            cmd += ["--user", user]
        done = subprocess.run(cmd + list(args), check=True, capture_output=True, text=True, timeout=30)
        return done.stdout


def enable_rbac(etcd: SecureEtcd, prefix: str = "/elastic/") -> None:
    """root, plus a ``trainer`` user whose role may touch only ``prefix``."""
    etcd.etcdctl("user", "add", f"root:{ROOT_PASSWORD}", user=None)
    etcd.etcdctl("user", "grant-role", "root", "root", user=None)
    etcd.etcdctl("role", "add", "trainer", user=None)
    etcd.etcdctl("role", "grant-permission", "trainer", "--prefix=true", "readwrite", prefix, user=None)
    etcd.etcdctl("user", "add", f"trainer:{TRAINER_PASSWORD}", user=None)
    etcd.etcdctl("user", "grant-role", "trainer", "trainer", user=None)
    etcd.etcdctl("auth", "enable", user=None)


def start_secure_etcd(workdir: Path, tls: bool = True) -> SecureEtcd:
    certs = make_certs(workdir / "certs", "trainer", "intruder")
    server_tls = ServerTLS(certs / "ca.pem", certs / "server.pem", certs / "server-key.pem") if tls else None
    server = EmbeddedEtcd(data_dir=workdir / "etcd", tls=server_tls).start()
    etcd = SecureEtcd(server, certs)
    enable_rbac(etcd)
    return etcd
