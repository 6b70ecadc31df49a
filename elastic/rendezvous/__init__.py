"""etcd v3 rendezvous for torchrun: ``torchrun --rdzv-backend etcd-v3 ...``.

Public API: the backend, the store and the handler for users who wire their own agent;
torchrun itself finds :func:`handler_factory` through the ``torchrun.handlers`` entry point.
"""

from .backend import EtcdV3RendezvousBackend, state_key
from .entrypoint import handler_factory
from .handler import EtcdV3RendezvousHandler, create_handler
from .options import KNOWN_KEYS, TUNED_DEFAULTS, RendezvousOptions
from .signing import HMAC_KEY_ENV, HMAC_KEY_FILE_ENV, HmacKeyError, SignatureError, StateSigner, load_hmac_key
from .store import EtcdV3Store

__all__ = [
    "HMAC_KEY_ENV",
    "HMAC_KEY_FILE_ENV",
    "KNOWN_KEYS",
    "TUNED_DEFAULTS",
    "EtcdV3RendezvousBackend",
    "EtcdV3RendezvousHandler",
    "EtcdV3Store",
    "HmacKeyError",
    "RendezvousOptions",
    "SignatureError",
    "StateSigner",
    "create_handler",
    "handler_factory",
    "load_hmac_key",
    "state_key",
]
