"""TLS with client certificates, and etcd auth with RBAC, on a real etcd."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from agent.etcd import EtcdAccessError, EtcdConfigError
from agent.rendezvous import create_handler
from tests.support.secure_etcd import TRAINER_PASSWORD, SecureEtcd


def params(secure_etcd: SecureEtcd, run_id: str, client: str | None = "trainer", **extra: str) -> RendezvousParameters:
    config: dict[str, str] = {"cacert": str(secure_etcd.certs / "ca.pem"), "connect_timeout": "5", **extra}
    if client:
        config.update(cert=str(secure_etcd.certs / f"{client}.pem"), key=str(secure_etcd.certs / f"{client}-key.pem"))
    return RendezvousParameters("etcd-v3", secure_etcd.server.endpoint, run_id, 1, 1, **config)


def test_handler_joins_over_tls_with_client_cert_and_password(
    secure_etcd: SecureEtcd, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_ETCD_PASSWORD", TRAINER_PASSWORD)
    handler = create_handler(params(secure_etcd, run_id, user="trainer"))
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
    finally:
        handler.shutdown()
    keys = secure_etcd.etcdctl("get", "--prefix", "--keys-only", f"/elastic/{run_id}/")
    assert f"/elastic/{run_id}/rdzv/round" in keys


def test_wrong_password_is_one_clear_line(secure_etcd: SecureEtcd, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_ETCD_PASSWORD", "not-the-password")
    with pytest.raises(EtcdAccessError, match="wrong user or password") as info:
        create_handler(params(secure_etcd, run_id, user="trainer"))
    assert "\n" not in str(info.value)


def test_role_without_the_prefix_is_denied(secure_etcd: SecureEtcd, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_ETCD_PASSWORD", TRAINER_PASSWORD)
    with pytest.raises(EtcdAccessError, match="denied user 'trainer'"):
        create_handler(params(secure_etcd, run_id, user="trainer", key_prefix="/other-team"))


def test_missing_client_cert_fails_the_handshake(secure_etcd: SecureEtcd, run_id: str) -> None:
    with pytest.raises(EtcdAccessError, match="TLS handshake"):
        create_handler(params(secure_etcd, run_id, client=None))


def test_cert_from_another_ca_fails_the_handshake(secure_etcd: SecureEtcd, run_id: str, tmp_path: Path) -> None:
    from tests.support.secure_etcd import make_certs

    other = make_certs(tmp_path / "other-ca", "trainer")
    config = params(secure_etcd, run_id)
    config.config.update(cert=str(other / "trainer.pem"), key=str(other / "trainer-key.pem"))
    with pytest.raises(EtcdAccessError, match="TLS handshake"):
        create_handler(config)


def test_password_on_the_command_line_is_refused(secure_etcd: SecureEtcd, run_id: str) -> None:
    with pytest.raises(EtcdConfigError, match="refusing an etcd password on the command line"):
        create_handler(params(secure_etcd, run_id, user="trainer", password="oops"))
