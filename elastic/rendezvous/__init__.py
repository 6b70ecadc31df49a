"""etcd v3 rendezvous for torchrun: ``torchrun --rdzv-backend etcd-v3 ...``.

Public API: the backend, the store and the handler for users who wire their own agent;
torchrun itself finds :func:`handler_factory` through the ``torchrun.handlers`` entry point.
"""

from .backend import EtcdV3RendezvousBackend, state_key
from .dynamic import EtcdV3DynamicHandler, create_dynamic_handler
from .entrypoint import dynamic_handler_factory, handler_factory
from .handler import EtcdV3RendezvousHandler, create_handler
from .registry import NodeLease, NodeRecord, list_nodes
from .options import KNOWN_KEYS, TUNED_DEFAULTS, RendezvousOptions
from .signing import HMAC_KEY_ENV, HMAC_KEY_FILE_ENV, HmacKeyError, SignatureError, StateSigner, load_hmac_key
from .store import EtcdV3Store

__all__ = [
    "HMAC_KEY_ENV",
    "HMAC_KEY_FILE_ENV",
    "KNOWN_KEYS",
    "TUNED_DEFAULTS",
    "EtcdV3DynamicHandler",
    "EtcdV3RendezvousBackend",
    "EtcdV3RendezvousHandler",
    "EtcdV3Store",
    "HmacKeyError",
    "RendezvousOptions",
    "SignatureError",
    "StateSigner",
    "NodeLease",
    "NodeRecord",
    "create_dynamic_handler",
    "create_handler",
    "dynamic_handler_factory",
    "handler_factory",
    "list_nodes",
    "load_hmac_key",
    "state_key",
]
