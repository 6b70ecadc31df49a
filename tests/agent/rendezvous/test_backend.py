"""The RendezvousBackend contract from torch's docstrings, against a real etcd."""

from __future__ import annotations

import pickle

import pytest
from torch.distributed.elastic.rendezvous import RendezvousStateError

from agent.etcd import EtcdClient
from agent.rendezvous import EtcdV3RendezvousBackend, StateSigner, state_key

KEY = b"k" * 32


@pytest.fixture
def backend(etcd_client: EtcdClient, run_id: str) -> EtcdV3RendezvousBackend:
    return EtcdV3RendezvousBackend(etcd_client, run_id, StateSigner(KEY), key_prefix="/test")


def test_get_on_empty_returns_none(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.get_state() is None


def test_name_is_etcd_v3(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.name == "etcd-v3"


def test_set_when_absent_with_none_token(backend: EtcdV3RendezvousBackend) -> None:
    state, token, ok = backend.set_state(b"first")
    assert (state, ok) == (b"first", True)
    assert backend.get_state() == (b"first", token)


def test_token_is_the_keys_mod_revision(backend: EtcdV3RendezvousBackend, etcd_client: EtcdClient) -> None:
    _, token, _ = backend.set_state(b"first")
    _, meta = etcd_client.call(lambda c: c.get(backend.key))
    assert token == meta.mod_revision


def test_set_with_current_token_replaces(backend: EtcdV3RendezvousBackend) -> None:
    _, token, _ = backend.set_state(b"first")
    state, new_token, ok = backend.set_state(b"second", token)
    assert (state, ok) == (b"second", True)
    assert new_token != token
    assert backend.get_state() == (b"second", new_token)


def test_none_token_does_not_overwrite_existing_state(backend: EtcdV3RendezvousBackend) -> None:
    _, token, _ = backend.set_state(b"first")
    assert backend.set_state(b"intruder") == (b"first", token, False)
    assert backend.get_state() == (b"first", token)


def test_stale_token_returns_current_state_unchanged(backend: EtcdV3RendezvousBackend) -> None:
    _, old, _ = backend.set_state(b"first")
    _, current, _ = backend.set_state(b"second", old)
    assert backend.set_state(b"late", old) == (b"second", current, False)
    assert backend.get_state() == (b"second", current)


@pytest.mark.parametrize("token", ["not-a-number", -3, 0, object(), True])
def test_invalid_token_returns_current_state_unchanged(backend: EtcdV3RendezvousBackend, token: object) -> None:
    _, current, _ = backend.set_state(b"first")
    assert backend.set_state(b"bad", token) == (b"first", current, False)
    assert backend.get_state() == (b"first", current)


def test_invalid_token_on_empty_backend_returns_none(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.set_state(b"bad", "garbage") is None
    assert backend.get_state() is None


def test_concurrent_writers_exactly_one_wins(backend: EtcdV3RendezvousBackend, etcd_client: EtcdClient, run_id: str) -> None:
    _, token, _ = backend.set_state(b"base")
    rival = EtcdV3RendezvousBackend(etcd_client, run_id, StateSigner(KEY), key_prefix="/test")
    first = backend.set_state(b"mine", token)
    second = rival.set_state(b"theirs", token)
    assert first is not None and second is not None
    assert first[2] is True and second[2] is False
    assert second[0] == b"mine"  # the loser learns the winner's state in the same reply


def test_corrupt_value_raises_state_error(backend: EtcdV3RendezvousBackend, etcd_client: EtcdClient) -> None:
    etcd_client.call(lambda c: c.put(backend.key, b"\x00garbage"))
    with pytest.raises(RendezvousStateError):
        backend.get_state()


class _Exploit:
    def __reduce__(self):
        return (pytest.fail, ("a forged rendezvous state reached pickle.loads",))


def test_forged_unsigned_state_is_rejected(backend: EtcdV3RendezvousBackend, etcd_client: EtcdClient) -> None:
    """Someone with etcd write access but no job key writes a malicious pickle."""
    forged = StateSigner(None).seal(backend.key.encode(), pickle.dumps(_Exploit()))
    etcd_client.call(lambda c: c.put(backend.key, forged))
    with pytest.raises(RendezvousStateError, match="not HMAC-signed"):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"x")  # the failed write's reply carries the forged state


def test_state_signed_with_another_key_is_rejected(etcd_client: EtcdClient, run_id: str) -> None:
    intruder = EtcdV3RendezvousBackend(etcd_client, run_id, StateSigner(b"x" * 32), key_prefix="/test")
    intruder.set_state(pickle.dumps(_Exploit()))
    ours = EtcdV3RendezvousBackend(etcd_client, run_id, StateSigner(KEY), key_prefix="/test")
    with pytest.raises(RendezvousStateError, match="does not match the job key"):
        ours.get_state()


def test_signed_value_replayed_under_another_key_is_rejected(
    backend: EtcdV3RendezvousBackend, etcd_client: EtcdClient, run_id: str
) -> None:
    backend.set_state(b"genuine")
    value, _ = etcd_client.call(lambda c: c.get(backend.key))
    other_key = state_key("/test", run_id + "-other")
    etcd_client.call(lambda c: c.put(other_key, value))
    other = EtcdV3RendezvousBackend(etcd_client, run_id + "-other", StateSigner(KEY), key_prefix="/test")
    with pytest.raises(RendezvousStateError):
        other.get_state()


def test_state_key_carries_a_ttl(backend: EtcdV3RendezvousBackend, etcd_client: EtcdClient) -> None:
    backend.set_state(b"first")
    _, meta = etcd_client.call(lambda c: c.get(backend.key))
    assert meta.lease_id != 0
    info = etcd_client.call(lambda c: c.get_lease_info(meta.lease_id))
    assert 0 < info.TTL <= 7200
