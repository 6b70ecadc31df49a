"""The ``elastic`` command as users type it: kill (direct and through etcd), etcd, bad input."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd, EtcdClient, EtcdSettings, free_port
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

ELASTIC = [sys.executable, "-m", "agent.cli"]
TINY = ["--step-time", "0.05", "--progress", "{progress}"]


def elastic(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ELASTIC, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("via_etcd", [False, True], ids=["direct", "through-etcd"])
def test_elastic_kill_takes_down_a_whole_node_found_in_the_registry(
    via_etcd: bool, etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node]
) -> None:
    a, b = (nodes(name=n, endpoint=etcd_server.endpoint, run_id=run_id, module_args=TINY,
                  agent_args=["--lease-ttl", "2"]) for n in ("a", "b"))
    wait_until(lambda: len(a.steps_at(2)) >= 3 and len(b.steps_at(2)) >= 3, 120, "two nodes training",
               on_timeout=lambda: a.log_tail() + b.log_tail())
    killed_at = time.time()
    done = elastic("kill", "b", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id,
                   *(["--via-etcd"] if via_etcd else []))
    assert done.returncode == 0, done.stderr
    assert ("through etcd" in done.stdout) == via_etcd, done.stdout
    wait_until(lambda: not b.alive(), 30, "node b's agent to die", on_timeout=b.log_tail)
    assert b.process is not None and b.process.returncode == -signal.SIGKILL
    wait_until(lambda: len(a.steps_at(1, after=killed_at)) >= 3, 60, "a to train alone", on_timeout=a.log_tail)


def test_elastic_kill_names_the_live_nodes_when_the_target_is_unknown(etcd_server: EmbeddedEtcd, run_id: str) -> None:
    done = elastic("kill", "nope", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no live nodes" in errors[0], done.stderr


@pytest.mark.slow  # starts processes
def test_elastic_etcd_serves_in_the_foreground_until_sigterm(tmp_path: Path) -> None:
    # etcd cannot bind port 0 from its command line, so the port is picked ahead; a lost race
    # (it exits at once) is tried again on another, and a loaded machine gets 90 s to start it
    for _attempt in range(3):
        port = free_port()
        proc = subprocess.Popen([*ELASTIC, "etcd", "--data-dir", str(tmp_path / "data"), "--client-port", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        client = EtcdClient(EtcdSettings(endpoints=(("127.0.0.1", port),), request_timeout=1.0), retry_deadline=1.0)
        if wait_until(lambda: _answers(client) or proc.poll() is not None, 90, "elastic etcd to serve or exit") \
                and proc.poll() is None:
            break
        proc.wait()
    try:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        client.call(lambda c: c.put("/probe", "1"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert (tmp_path / "data").is_dir()  # the data stays for a restart
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _answers(client: EtcdClient) -> bool:
    try:
        client.call(lambda c: c.status(), deadline=1.0)
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


@pytest.mark.slow  # starts processes
def test_a_bad_agent_flag_gets_one_line_and_exit_2_from_the_real_command() -> None:
    """The installed command's whole path (its stderr holds nothing but the one line); each
    flag's own refusal is checked in process, in tests/agent/test_launch_bad_input.py."""
    done = elastic("agent", "--lease-ttl", "1", "--rdzv-id", "x", "-m", "elastic.examples.tiny_ddp")
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "below etcd's minimum lease TTL" in errors[0], done.stderr


@pytest.mark.slow  # starts processes
def test_unknown_command_is_one_line() -> None:
    done = elastic("frobnicate")
    assert done.returncode == 2 and "unknown command 'frobnicate'" in done.stderr
