"""Case 1: one unsigned etcd write must neither end a signed job nor look like a node's death.

Real etcd, real handlers (each an agent's rendezvous, in this process), a real attacker's
write through etcd's own client. What a user would check: the members keep their round
(no restart reason), the forged value is replaced by a good one, and an agent that cannot
verify the job's state refuses to join with one line instead of calling the job finished.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from agent.etcd import EmbeddedEtcd
from agent.rendezvous import create_handler
from agent.rendezvous.handler import EtcdV3RendezvousHandler, RendezvousStateError
from tests.support.waiting import wait_until

TTL = 5  # 2 s starved in a whole-suite run: a late keep-alive read as a peer's death, not the forgery


def key_file(tmp_path: Path, name: str, key: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(key)
    return str(path)


@pytest.fixture
def job_key(tmp_path: Path) -> str:
    return key_file(tmp_path, "job.key", b"j" * 32)


def handler(etcd: EmbeddedEtcd, run_id: str, name: str, key: str) -> EtcdV3RendezvousHandler:
    return create_handler(RendezvousParameters("etcd-v3", etcd.endpoint, run_id, 2, 2, node_name=name,
                                               lease_ttl=str(TTL), hmac_key_file=key))


@pytest.fixture
def pair(etcd_server: EmbeddedEtcd, run_id: str, job_key: str) -> Iterator[tuple[EtcdV3RendezvousHandler, ...]]:
    """Two signed members in a closed round 0."""
    a, b = handler(etcd_server, run_id, "a", job_key), handler(etcd_server, run_id, "b", job_key)
    joined: dict[str, int] = {}
    try:
        thread = threading.Thread(target=lambda: joined.update(a=a.next_rendezvous().world_size), daemon=True)
        thread.start()
        joined["b"] = b.next_rendezvous().world_size
        thread.join(timeout=30)
        assert joined == {"a": 2, "b": 2}
        yield a, b
    finally:
        a.close()
        b.close()


def forge(h: EtcdV3RendezvousHandler, key: str, value: bytes = b"x") -> None:
    h.client.call(lambda c: c.put(key, value))


def verifies(h: EtcdV3RendezvousHandler, key: str) -> bool:
    value = h.client.call(lambda c: c.get(key))[0]
    if value is None:
        return False
    try:
        h.signer.open(key.encode(), value)
        return True
    except ValueError:
        return False


def watch_reasons(group: tuple[EtcdV3RendezvousHandler, ...], seconds: float) -> set[str | None]:
    """Every restart reason the members' monitor loops would have seen, polled for ``seconds``."""
    seen: set[str | None] = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen.update(h.restart_reason() for h in group)
        time.sleep(0.05)
    return seen


def test_a_forged_round_record_is_put_back_and_the_members_keep_their_round(
    pair: tuple[EtcdV3RendezvousHandler, ...]
) -> None:
    a, b = pair
    round_key = a._round_key
    forge(a, round_key)
    assert watch_reasons(pair, 1.5) == {None}, "a forged round record must not stop or restart anyone"
    wait_until(lambda: verifies(a, round_key), 5, "a member to put the round record back")
    assert a._decode_round(a.mirror.entries()[0]) == a.round  # the record put back is the members' own round


def test_a_forged_registry_record_is_not_a_death_and_its_owner_rewrites_it(
    pair: tuple[EtcdV3RendezvousHandler, ...]
) -> None:
    a, b = pair
    forge(a, b.lease.key)  # an unsigned value over a live node's own record
    assert watch_reasons(pair, 1.5) == {None}, "a forgery over b's record was read as b's death"
    wait_until(lambda: verifies(a, b.lease.key), 5, "b to rewrite its own record")
    assert "b" in a.node_records()


def test_a_record_still_forged_after_a_lease_ttl_counts_as_gone(
    pair: tuple[EtcdV3RendezvousHandler, ...]
) -> None:
    """A dead node cannot repair its key: the forgery then ends like a lease would."""
    a, b = pair
    b.lease._stop.set()  # b stops renewing and rewriting, as a frozen agent would ...
    b.mirror.close()  # ... and no longer watches its key
    forge(a, b.lease.key, b"still forged")
    wait_until(lambda: "b" not in a.node_records(), TTL + 5, "a to count b as gone")


def test_an_agent_with_another_key_refuses_to_join_with_one_line(
    pair: tuple[EtcdV3RendezvousHandler, ...], etcd_server: EmbeddedEtcd, run_id: str, tmp_path: Path
) -> None:
    stranger = handler(etcd_server, run_id, "c", key_file(tmp_path, "other.key", b"o" * 32))
    try:
        with pytest.raises(RendezvousStateError, match="does not verify with this agent's job key") as info:
            stranger.next_rendezvous()
        assert "\n" not in str(info.value)
    finally:
        stranger.close()
    assert watch_reasons(pair, 0.5) == {None}
