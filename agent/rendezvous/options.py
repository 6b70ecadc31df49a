"""``--rdzv-conf`` for the etcd-v3 backend: parsing, validation and tuned defaults.

torch's defaults (30 s last call, 5 s x 3 keep-alives) favour large jobs that trickle in
over minutes; they make every node loss cost tens of seconds. Ours favour fast recovery:

* ``last_call_timeout=1``: once ``min_nodes`` are in, wait one more second for stragglers
  (torch reads whole seconds, so 1 is the floor). Larger values let slow-starting nodes
  join the same round instead of triggering a scale-up restart later.
* ``keep_alive_interval=1``, ``keep_alive_max_attempt=3``: a dead node is dropped from the
  rendezvous after about 3 s. The cost is one compare-and-set on the state key per node
  per second, and a node paused for more than ~3 s (swap, a debugger) is evicted.
  Fewer than 3 attempts is refused: torch only heartbeats once the last beat is older
  than one interval, and its timer ticks land just short of that, so with 2 attempts a
  healthy node's second tick finds its own beat two intervals old and evicts itself.
* ``close_timeout=10``, ``join_timeout=600``.

Users override any of them with ``--rdzv-conf key=value``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic import contract
from agent.etcd import EtcdClient, EtcdConfigError, EtcdSettings, settings_from_options

from agent.rendezvous.registry import DEFAULT_LEASE_TTL
from agent.rendezvous.signing import StateSigner, load_hmac_key

# How long the rendezvous state outlives its last write (the backend's default TTL, seconds).
DEFAULT_STATE_TTL = 7200

log = logging.getLogger(__name__)

TUNED_DEFAULTS: dict[str, int] = {
    "join_timeout": 600,
    "last_call_timeout": 1,
    "close_timeout": 10,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 3,
}
_ETCD_KEYS = {"cacert", "cert", "key", "user", "password", "password_file", "request_timeout"}
_OWN_KEYS = {
    "key_prefix", "state_ttl", "hmac_key_file", "connect_timeout", "etcd_retry_timeout",
    "lease_ttl", "rejoin_timeout", "node_name", "stewards",
}
DEFAULT_REJOIN_TIMEOUT = 0.5
_TORCH_KEYS = set(TUNED_DEFAULTS) | {"heartbeat_timeout", "timeout", "rank", "is_host", "local_addr"}
KNOWN_KEYS = frozenset(_ETCD_KEYS | _OWN_KEYS | _TORCH_KEYS)


@dataclass(frozen=True)
class RendezvousOptions:
    etcd: EtcdSettings
    key_prefix: str
    state_ttl: int
    hmac_key: bytes | None
    connect_timeout: float
    etcd_retry_timeout: float
    timings: dict[str, int]
    lease_ttl: int = DEFAULT_LEASE_TTL
    last_call: float = 1.0
    rejoin_timeout: float = DEFAULT_REJOIN_TIMEOUT
    node_name: str | None = None
    stewards: int = 3  # steward slots: nodes that hear every peer and close rounds (agent.rendezvous.steward)

    @classmethod
    def from_params(cls, params: RendezvousParameters, env: Mapping[str, str] | None = None) -> "RendezvousOptions":
        config = {k: str(v) for k, v in params.config.items() if v is not None}
        unknown = sorted(set(config) - KNOWN_KEYS)
        if unknown:
            log.warning(
                "ignoring unknown --rdzv-conf keys %s (known: %s)", unknown, ", ".join(sorted(KNOWN_KEYS))
            )
        last_call = _positive_float(config, "last_call_timeout", float(TUNED_DEFAULTS["last_call_timeout"]))
        config["last_call_timeout"] = str(max(1, round(last_call)))  # torch's own handler: whole seconds
        timings = {name: _positive_int(config, name, default) for name, default in TUNED_DEFAULTS.items()}
        if timings["keep_alive_max_attempt"] < 3:
            raise EtcdConfigError(
                "keep_alive_max_attempt must be at least 3: with fewer, torch's rendezvous "
                "evicts healthy nodes between two of their own heartbeats"
            )
        key_prefix = config.get("key_prefix", "/elastic")
        if not key_prefix.startswith("/"):
            raise EtcdConfigError(f"key_prefix={key_prefix!r} must start with '/', e.g. /elastic")
        return cls(
            etcd=settings_from_options(params.endpoint, config, env),
            key_prefix=key_prefix.rstrip("/") or "/elastic",
            state_ttl=_positive_int(config, "state_ttl", DEFAULT_STATE_TTL, minimum=2),
            hmac_key=load_hmac_key(config.get("hmac_key_file"), env),
            connect_timeout=min(
                _positive_float(config, "connect_timeout", 10.0), float(timings["join_timeout"])
            ),
            etcd_retry_timeout=_positive_float(config, "etcd_retry_timeout", 30.0),
            timings=timings,
            lease_ttl=_positive_int(config, "lease_ttl", int(env_or_default(env, contract.LEASE_TTL_ENV, DEFAULT_LEASE_TTL)),
                                    minimum=2),
            last_call=last_call,
            rejoin_timeout=_positive_float(config, "rejoin_timeout", DEFAULT_REJOIN_TIMEOUT),
            node_name=config.get("node_name") or None,
            stewards=_positive_int(config, "stewards", 3),
        )


def connect(params: RendezvousParameters) -> tuple[RendezvousOptions, StateSigner, EtcdClient]:
    """Options, signer, and a client that has just read one of the run's keys.

    Both handlers call this so that a wrong endpoint, certificate, password or role fails
    now with one line (EtcdConfigError, HmacKeyError, EtcdError) rather than deep inside
    the first rendezvous.
    """
    options = RendezvousOptions.from_params(params)
    signer = StateSigner(options.hmac_key)
    client = EtcdClient(options.etcd, retry_deadline=options.etcd_retry_timeout)
    probe = f"{options.key_prefix}/{params.run_id}/rdzv/round"
    client.call(lambda c: c.get(probe), deadline=options.connect_timeout)
    return options, signer, client


def env_or_default(env: Mapping[str, str] | None, name: str, default: object) -> str:
    return (os.environ if env is None else env).get(name) or str(default)


def _positive_int(config: Mapping[str, str], name: str, default: int, minimum: int = 1) -> int:
    text = config.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise EtcdConfigError(f"--rdzv-conf {name}={text!r} is not a whole number of seconds") from None
    if value < minimum:
        raise EtcdConfigError(f"--rdzv-conf {name}={value} must be at least {minimum}")
    return value


def _positive_float(config: Mapping[str, str], name: str, default: float) -> float:
    text = config.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise EtcdConfigError(f"--rdzv-conf {name}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise EtcdConfigError(f"--rdzv-conf {name} must be positive")
    return value
