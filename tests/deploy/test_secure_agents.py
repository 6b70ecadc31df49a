"""The deployed configuration end to end: agents over TLS with client certs, RBAC and a job key.

A real etcd with TLS, client-certificate auth and RBAC (certificates from
deploy/certs/make-certs.sh), two real ``elastic agent`` nodes as the deploy files run
them, a kill, a recovery; and a third agent holding the wrong HMAC key, which must
neither join nor disturb the job.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable


from agent.local.local_node import AUTO_METRICS_PORT
from tests.support.nodes import TorchrunNode as Node
from tests.support.secure_etcd import TRAINER_PASSWORD, SecureEtcd
from tests.support.waiting import wait_until

TINY = ["--step-time", "0.05", "--progress", "{progress}"]
# A kill is seen at once (the connection resets): the lease only has to outlast a loaded
# machine. At 2 s, beside two busy processes, agent a's keep-alives starved for 2 s while the
# intruder started, a's lease lapsed and the new round it made read as the intruder's doing.
LEASE_TTL = 5


def secure_node(nodes: Callable[..., Node], secure_etcd: SecureEtcd, run_id: str, name: str, key_file: Path) -> Node:
    certs = secure_etcd.certs
    conf = {"cacert": str(certs / "ca.pem"), "cert": str(certs / "trainer.pem"),
            "key": str(certs / "trainer-key.pem"), "user": "trainer"}
    return nodes(name=name, endpoint=secure_etcd.server.endpoint, run_id=run_id, module_args=TINY, rdzv_conf=conf,
                 metrics_port=AUTO_METRICS_PORT, agent_args=["--lease-ttl", str(LEASE_TTL)],
                 env={"ELASTIC_ETCD_PASSWORD": TRAINER_PASSWORD, "ELASTIC_RDZV_HMAC_KEY_FILE": str(key_file)})


def test_secure_agents_train_recover_and_shut_out_a_wrong_job_key(
    secure_etcd: SecureEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    key, wrong = tmp_path / "job.key", tmp_path / "wrong.key"
    key.write_text("the-job-key-for-this-test-0123456789")
    wrong.write_text("somebody-elses-key-9876543210-abcdef")
    a, b = (secure_node(nodes, secure_etcd, run_id, n, key) for n in ("a", "b"))
    wait_until(lambda: len(a.steps_at(2)) >= 5 and len(b.steps_at(2)) >= 5, 150,
               "two TLS agents to train in a world of 2", on_timeout=lambda: a.log_tail() + b.log_tail())

    intruder = secure_node(nodes, secure_etcd, run_id, "intruder", wrong)
    watched_from = time.time()
    wait_until(lambda: "forged" in intruder.log_path.read_text() or not intruder.alive(), 120,
               "the wrong-key agent to be refused", on_timeout=intruder.log_tail)
    wait_until(lambda: len(a.steps_at(2, after=watched_from + 5)) >= 10, 60,
               "the job to keep training in its world of 2 beside the intruder", on_timeout=a.log_tail)
    assert not intruder.progress(), "an agent with the wrong job key trained in the job"
    rounds = {r["round"] for n in (a, b) for r in n.steps_at(2, after=watched_from)}
    assert len(rounds) == 1, f"the intruder disturbed the job: rounds {rounds}"

    victim, survivor = (b, a) if a.steps_at(2)[-1]["rank"] == 0 else (a, b)
    killed_at = time.time()
    victim.kill()
    wait_until(lambda: len(survivor.steps_at(1, after=killed_at)) >= 5, 90,
               "the survivor to train alone over TLS", on_timeout=survivor.log_tail)
