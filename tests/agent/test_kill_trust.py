"""``elastic kill`` trusts nothing it cannot check: not a registry it cannot verify, not a pid
it has not matched to the node's agent (command line, start time and record together)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from agent.etcd import EmbeddedEtcd, EtcdClient
from agent.rendezvous.registry import NodeRecord, nodes_prefix
from agent.rendezvous.signing import StateSigner
from agent.node.proc_identity import judge
from tests.agent.test_cli import elastic

HOST = "h1"
AGENT = ["/usr/bin/python3", "-c", "boot", "agent", "--node-name", "b", "--rdzv-id", "run7", "train.py"]


def _record(started_at: float = 1000.0, host: str = HOST) -> NodeRecord:
    return NodeRecord("b", host, 4242, started_at=started_at)


def test_the_agent_of_the_run_started_before_its_record_is_verified() -> None:
    assert judge(AGENT, 990.0, _record(), "run7", HOST) is None
    torchrun = ["/venv/bin/torchrun", "--rdzv-backend", "etcd-v3", "--rdzv-id=run7", "train.py"]
    assert judge(torchrun, 1000.5, _record(), "run7", HOST) is None, "within the clock's slack"


def test_anything_else_is_not_signalled() -> None:
    assert "host" in (judge(AGENT, 990.0, _record(host="h2"), "run7", HOST) or "")
    assert "no process" in (judge([], 990.0, _record(), "run7", HOST) or "")
    assert "not an elastic or torchrun" in (judge(["sleep", "300"], 990.0, _record(), "run7", HOST) or "")
    assert "run 'run8'" in (judge(AGENT, 990.0, _record(), "run8", HOST) or ""), "another run's agent"
    assert "reused" in (judge(AGENT, 1010.0, _record(), "run7", HOST) or ""), "a pid recycled after the record"
    assert "before the record" in (judge(AGENT, 1.0, _record(), "run7", HOST) or "")
    assert "start time" in (judge(AGENT, None, _record(), "run7", HOST) or "")


def test_a_forged_record_naming_a_bystander_gets_no_signal(
    etcd_server: EmbeddedEtcd, etcd_client: EtcdClient, run_id: str, tmp_path: Path
) -> None:
    """A signed job (a signed record of a), a forged unsigned ``nodes/ghost`` naming a live
    process of this host that has nothing to do with the job: without the key the tool refuses
    (one line, exit 2); with it, the ghost is no node; in an unsigned job, the pid is not an
    agent's, so it is not signalled. The bystander survives all three."""
    key = tmp_path / "job.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    signer, prefix = StateSigner(b"k" * 32), nodes_prefix("/elastic", run_id)
    # "elastic" in its command line, as any process run from a checkout of this project has:
    # the old check (that word, or "torchrun") took it for an agent and SIGKILLed it
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "elastic-bystander"],
                                 start_new_session=True)
    try:
        lease = etcd_client.call(lambda c: c.lease(60))
        real = NodeRecord("a", socket.gethostname(), 1, started_at=time.time())
        etcd_client.call(lambda c: c.put(prefix + "a", signer.seal((prefix + "a").encode(), real.to_json()),
                                          lease=lease.id))
        ghost = NodeRecord("ghost", socket.gethostname(), bystander.pid, started_at=time.time())
        etcd_client.call(lambda c: c.put(prefix + "ghost", StateSigner(None).seal(b"", ghost.to_json()), lease=lease.id))
        target = ["--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id]

        without_key = elastic("kill", "ghost", *target)
        assert without_key.returncode == 2, without_key.stdout + without_key.stderr
        errors = [line for line in without_key.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "give it the key" in errors[0], without_key.stderr
        flip = elastic("inject-sdc", "a", *target)  # the other tool that acts: the same rule
        assert flip.returncode == 2 and "give it the key" in flip.stderr, flip.stdout + flip.stderr
        assert "asked node" not in flip.stdout
        check = elastic("check", "a", *target)  # asks the job to act: the same rule
        assert check.returncode == 2 and "give it the key" in check.stderr, check.stdout + check.stderr
        assert "asked the job" not in check.stdout
        with_key = elastic("kill", "ghost", *target, "--rdzv-conf", f"hmac_key_file={key}")
        assert with_key.returncode == 2 and "no live node 'ghost'" in with_key.stderr, with_key.stderr

        etcd_client.call(lambda c: c.delete(prefix + "a"))  # now an unsigned job
        unsigned = elastic("kill", "ghost", *target)
        assert "not signalling pid" in unsigned.stderr and f"not an agent of run {run_id!r}" in unsigned.stderr, \
            unsigned.stderr
        assert "killed" not in unsigned.stdout
        assert bystander.poll() is None, "the tool signalled a process that is not the node's agent"
    finally:
        bystander.kill()  # by its pid, through its Popen
        bystander.wait()
