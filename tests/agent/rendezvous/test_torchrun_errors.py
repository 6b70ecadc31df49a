"""Bad input through real torchrun: one clear line, a non-zero exit, within the join timeout."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from agent.etcd import free_port
from tests.support.nodes import TORCHRUN
from tests.support.secure_etcd import TRAINER_PASSWORD, SecureEtcd, start_secure_etcd

# Long, so that "it failed before the join timeout" tells a quick refusal (7 s on an idle
# machine, the torch import included) from a wait for the timeout even on a loaded one: at
# 30 s a whole-suite run's refusal took 31 s, all of it start-up and the 3 s connect timeout.
JOIN_TIMEOUT = 120


def torchrun(endpoint: str, conf: dict[str, str], env: dict[str, str] | None = None) -> tuple[int, str, float]:
    conf = {"join_timeout": str(JOIN_TIMEOUT), "connect_timeout": "3", **conf}
    cmd = [
        TORCHRUN, "--nnodes", "1:2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint,
        "--rdzv-id", "bad-input", "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items()),
        "-m", "elastic.examples.tiny_ddp", "--steps", "1",
    ]
    started = time.monotonic()
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=JOIN_TIMEOUT + 60,
        env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
    )
    return done.returncode, done.stderr + done.stdout, time.monotonic() - started


def the_error_line(output: str) -> str:
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    return errors[0]


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    etcd = start_secure_etcd(tmp_path_factory.mktemp("auth"), tls=False)
    try:
        yield etcd
    finally:
        etcd.server.close()


@pytest.mark.slow  # starts processes
def test_unreachable_endpoint() -> None:
    # free_port: nothing must listen there, so no bind race to lose (issue 40)
    code, output, seconds = torchrun(f"127.0.0.1:{free_port()}", {})
    assert code != 0
    assert seconds < JOIN_TIMEOUT
    line = the_error_line(output)
    assert "did not answer" in line and "check that etcd is running" in line


@pytest.mark.slow  # starts processes
def test_bad_tls_path(tmp_path: Path) -> None:
    # free_port: nothing must listen there, so no bind race to lose (issue 40)
    code, output, seconds = torchrun(f"127.0.0.1:{free_port()}", {"cacert": str(tmp_path / "missing-ca.pem")})
    assert code != 0
    assert seconds < JOIN_TIMEOUT
    line = the_error_line(output)
    assert "missing-ca.pem" in line and "does not exist" in line


@pytest.mark.slow  # starts processes
def test_wrong_password(auth_etcd: SecureEtcd) -> None:
    code, output, seconds = torchrun(
        auth_etcd.server.endpoint, {"user": "trainer"}, env={"ELASTIC_ETCD_PASSWORD": "wrong"}
    )
    assert code != 0
    assert seconds < JOIN_TIMEOUT
    assert "wrong user or password" in the_error_line(output)


@pytest.mark.slow  # starts processes
def test_right_password_trains(auth_etcd: SecureEtcd) -> None:
    """The control for the test above: the same command with the right password works."""
    code, output, _ = torchrun(
        auth_etcd.server.endpoint, {"user": "trainer"}, env={"ELASTIC_ETCD_PASSWORD": TRAINER_PASSWORD}
    )
    assert code == 0, output
