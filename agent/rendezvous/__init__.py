"""etcd v3 rendezvous for torchrun: ``torchrun --rdzv-backend etcd-v3 ...``.

Public API: the handler, the node registry, the backend and the store for users who wire
their own agent; torchrun itself finds :func:`handler_factory` through the
``torchrun.handlers`` entry point. Exports load lazily: the tools (``elastic top``,
``elastic sd``, ``elastic kill``) read the registry without paying for ``import torch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic._lazy import lazy_exports

_EXPORTS = {
    "EtcdV3RendezvousBackend": ".backend", "state_key": ".backend",
    "EtcdV3DynamicHandler": ".dynamic", "create_dynamic_handler": ".dynamic",
    "dynamic_handler_factory": ".entrypoint", "handler_factory": ".entrypoint",
    "EtcdV3RendezvousHandler": ".handler", "create_handler": ".handler",
    "KNOWN_KEYS": ".options", "TUNED_DEFAULTS": ".options", "RendezvousOptions": ".options",
    "NodeLease": ".registry", "NodeRecord": ".registry", "list_nodes": ".registry",
    "HMAC_KEY_ENV": "elastic.contract", "HMAC_KEY_FILE_ENV": "elastic.contract", "HmacKeyError": ".signing",
    "SignatureError": ".signing", "StateSigner": ".signing", "load_hmac_key": ".signing",
    "EtcdV3Store": ".store",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from agent.rendezvous.backend import EtcdV3RendezvousBackend, state_key
    from agent.rendezvous.dynamic import EtcdV3DynamicHandler, create_dynamic_handler
    from agent.rendezvous.entrypoint import dynamic_handler_factory, handler_factory
    from agent.rendezvous.handler import EtcdV3RendezvousHandler, create_handler
    from agent.rendezvous.options import KNOWN_KEYS, TUNED_DEFAULTS, RendezvousOptions
    from agent.rendezvous.registry import NodeLease, NodeRecord, list_nodes
    from elastic.contract import HMAC_KEY_ENV, HMAC_KEY_FILE_ENV
    from agent.rendezvous.signing import HmacKeyError, SignatureError, StateSigner, load_hmac_key
    from agent.rendezvous.store import EtcdV3Store


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
