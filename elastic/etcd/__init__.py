"""etcd v3 plumbing shared by the rendezvous, the agent and the tools."""

from .client import EtcdAccessError, EtcdClient, EtcdError, EtcdUnavailableError
from .server import EmbeddedEtcd, EtcdNotFoundError, ServerTLS, find_etcd_binary, free_port
from .settings import EtcdConfigError, EtcdSettings, parse_endpoints, settings_from_options

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
