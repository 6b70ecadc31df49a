"""The guard of agent/etcd/grpc_untyped.py: gRPC still words these answers as that module reads them.

Real gRPC, no etcd: a call on a closed channel, and a TLS client at a plaintext server. If one
of these fails, gRPC changed its words (or typed the answer): fix the module, or drop it."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from agent.etcd.grpc_untyped import channel_closed, credentials_refused, lease_not_found, tls_refused, token_expired


def test_a_call_on_a_closed_channel_reads_as_closed() -> None:
    channel = grpc.insecure_channel("127.0.0.1:1")
    call = channel.unary_unary("/elastic.Test/Nothing")
    channel.close()
    with pytest.raises(ValueError) as refused:
        call(b"", timeout=1)
    assert channel_closed(str(refused.value)), f"gRPC words a closed channel otherwise now: {refused.value}"
    assert not channel_closed("StatusCode.CANCELLED: Locally cancelled by application!")


def test_a_tls_handshake_with_a_plaintext_server_reads_as_tls() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials())
        with pytest.raises(grpc.RpcError) as failed:
            channel.unary_unary("/elastic.Test/Nothing")(b"", timeout=10)
        channel.close()
    finally:
        server.stop(None)
    rpc = failed.value
    assert rpc.code() == grpc.StatusCode.UNAVAILABLE, rpc  # a call's error is a grpc.Call
    assert tls_refused(rpc.details() or ""), f"gRPC words a failed handshake otherwise now: {rpc.details()}"
    assert not tls_refused("failed to connect to all addresses; last error: UNAVAILABLE: Connection refused")


def test_etcds_own_words_for_a_token_credentials_and_a_lease() -> None:
    """etcd's words (its auth and lease stores), which gRPC carries as the details; a real etcd
    with auth and TLS says them in tests/agent/rendezvous/test_secure.py (wrong password, failed handshakes)."""
    assert token_expired("etcdserver: invalid auth token")
    assert not token_expired("etcdserver: authentication failed, invalid user ID or password")
    assert lease_not_found("etcdserver: requested lease not found")
    assert credentials_refused("etcdserver: authentication failed, invalid user ID or password")
    assert not credentials_refused("etcdserver: invalid auth token")
