"""gRPC's untyped answers, read in this module alone.

gRPC gives a status code and a line of details, and for a few answers the code alone does not
say what happened: a TLS handshake that failed is ``UNAVAILABLE`` like a member that is down
(but asking again cannot fix a certificate), a call on a channel another thread closed is a
plain ``ValueError`` or ``CANCELLED`` (asking again on the new channel can), and an expired
auth token is ``UNAUTHENTICATED`` like a wrong password (re-authenticating fixes the first
only), and etcd's lost lease is told by its words. This module is the only place in ``agent`` that reads gRPC's words to tell them apart,
as :mod:`elastic.torch_untyped` is for torch's; :mod:`agent.etcd.client` asks it, by the code
first. ``tests/agent/test_grpc_untyped.py`` fails loudly once gRPC words them otherwise.
"""

from __future__ import annotations

_TLS_WORDS = ("ssl", "tls", "handshake", "certificate")
_CLOSED_CHANNEL_WORDS = ("closed channel", "channel closed")  # "Cannot invoke RPC on closed channel!", "Channel closed!"


def tls_refused(details: str) -> bool:
    """An ``UNAVAILABLE``'s details name a TLS handshake or certificate failure."""
    lowered = details.lower()
    return any(word in lowered for word in _TLS_WORDS)


def channel_closed(text: str) -> bool:
    """A ``ValueError``'s message or a ``CANCELLED``'s details say the channel was closed under the call."""
    lowered = text.lower()
    return any(word in lowered for word in _CLOSED_CHANNEL_WORDS)


def lease_not_found(details: str) -> bool:
    """etcd's answer to a put under a lease it no longer has (``requested lease not found``)."""
    return "lease not found" in details


def credentials_refused(details: str) -> bool:
    """etcd's answer to a wrong user or password (``authentication failed, invalid user ID or password``)."""
    return "authentication failed" in details


def token_expired(details: str) -> bool:
    """An ``UNAUTHENTICATED``'s details name the auth token (expired or revoked), not the credentials."""
    return "token" in details.lower()


__all__ = ["channel_closed", "credentials_refused", "lease_not_found", "tls_refused", "token_expired"]
