"""etcd v3 plumbing shared by the rendezvous, the agent and the tools."""

import os

# gRPC logs every failed TLS handshake at INFO to stderr; our errors already say it in
# one line. Must be set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from agent.etcd.client import EtcdAccessError, EtcdClient, EtcdError, EtcdUnavailableError  # noqa: E402
from agent.etcd.server import EmbeddedEtcd, EtcdNotFoundError, ServerTLS, find_etcd_binary, free_port  # noqa: E402
from agent.etcd.settings import EtcdConfigError, EtcdSettings, parse_endpoints, settings_from_options  # noqa: E402

__all__ = [
    "EmbeddedEtcd",
    "EtcdAccessError",
    "EtcdClient",
    "EtcdConfigError",
    "EtcdError",
    "EtcdNotFoundError",
    "EtcdSettings",
    "EtcdUnavailableError",
    "ServerTLS",
    "find_etcd_binary",
    "free_port",
    "parse_endpoints",
    "settings_from_options",
]
