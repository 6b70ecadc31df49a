"""A ``torch.distributed.Store`` on etcd v3, so torch's rendezvous handler runs unchanged.

Blocking reads watch from the revision of the read that found the key missing, so a
waiter wakes the moment the key is written and can never miss a write that races its
read. Counters (``add``) and ``compare_set`` are transactions on the mod revision.
Values are sealed like the rendezvous state: a forged ``MASTER_ADDR`` is refused.

torch's C++ side (``PrefixStore``, process groups) reaches a Python store through a
trampoline that looks some methods up by their C++ names (``getNumKeys``, ``deleteKey``),
so those are defined here too. Queues are not supported and say so (NotImplementedError).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist
from etcd3 import transactions as tx

from agent.etcd import EtcdClient
from agent.etcd.kv import ExpiringLease, transact

from agent.rendezvous.signing import SignatureError, StateSigner

# Each watch is re-armed at least this often, so a watch stream broken by an etcd
# restart costs at most this long; a healthy one wakes immediately on the write.
_WATCH_SLICE_S = 2.0


def _as_bytes(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdV3Store(dist.Store):
    """Keys live under ``prefix``; each value is sealed with the job's signer."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        signer: StateSigner,
        ttl: int = 7200,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__()  # required by the pybind trampoline
        self._client = client
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._signer = signer
        self._ttl = ttl
        self._lease = ExpiringLease(client, ttl)
        # Clones handed to C++ (PrefixStore.clone, process-group split/shrink) hold no Python
        # reference of their own: pybind11 would drop their Python half, and every later call
        # would hit a pure virtual. The family keeps them alive as long as any of its stores.
        self._family: list[EtcdV3Store] = []
        if timeout is not None:
            self.set_timeout(timeout)

    # -- helpers ----------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return self._prefix + key

    def _open(self, full_key: str, value: bytes) -> bytes:
        try:
            return self._signer.open(full_key.encode(), value)
        except SignatureError as exc:
            raise dist.DistStoreError(f"refusing store value at {full_key}: {exc}") from exc

    def _counter(self, full_key: str, value: bytes) -> int:
        """A counter's value (``add``): sealed, and a whole number, else DistStoreError."""
        opened = self._open(full_key, value)
        try:
            return int(opened)
        except ValueError:  # not a number (or past int()'s digit limit)
            raise dist.DistStoreError(
                f"refusing store value at {full_key}: {opened[:40]!r} is not a counter") from None

    def _seal(self, full_key: str, value: str | bytes) -> bytes:
        return self._signer.seal(full_key.encode(), _as_bytes(value))

    def _put(self, full_key: str, value: str | bytes) -> None:
        sealed = self._seal(full_key, value)
        self._lease.write(lambda lease: self._client.call(lambda c: c.put(full_key, sealed, lease=lease)))

    def _read(self, full_keys: Sequence[str]) -> tuple[dict[str, bytes], int]:
        """Values of the keys that exist, and the revision the read saw."""
        result = transact(self._client, [], success=[tx.Get(k) for k in full_keys])
        found: dict[str, bytes] = {}
        for key, rows in zip(full_keys, result.responses):
            if rows:
                found[key] = self._open(key, rows[0][0])
        return found, result.revision

    def _wait_for(self, full_keys: Sequence[str], timeout: timedelta) -> dict[str, bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            found, revision = self._read(full_keys)
            missing = [k for k in full_keys if k not in found]
            if not missing:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout_error(missing, timeout)
            self._client.wait_for_event(
                missing[0], min(remaining, _WATCH_SLICE_S), start_revision=revision + 1
            )

    def _timeout_error(self, missing: Sequence[str], timeout: timedelta) -> dist.DistStoreError:
        """torch's type and wording ("wait timeout after N ms, keys: ..."): callers and
        torch's own tests match on them; the keys are the caller's, without our prefix."""
        keys = [k[len(self._prefix):] for k in missing]
        millis = int(timeout.total_seconds() * 1000)
        return dist.DistStoreError(
            f"wait timeout after {millis} ms, keys: {keys} (under etcd prefix {self._prefix})"
        )

    # -- the Store interface ----------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._put(self._key(key), value)

    def get(self, key: str) -> bytes:
        full = self._key(key)
        return self._wait_for([full], self.timeout)[full]

    def peek(self, keys: Sequence[str]) -> list[bytes] | None:
        """The keys' values in one read if every one exists, else None: never waits, never
        watches (:mod:`.bootstrap` reads this way before it falls back to a blocking ``get``)."""
        full = [self._key(k) for k in keys]
        found, _ = self._read(full)
        return [found[k] for k in full] if len(found) == len(full) else None

    def multi_get(self, keys: list[str]) -> list[bytes]:
        full = [self._key(k) for k in keys]
        found = self._wait_for(full, self.timeout)
        return [found[k] for k in full]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        sealed = [(k, self._seal(k, v)) for k, v in zip((self._key(k) for k in keys), values)]
        self._lease.write(
            lambda lease: transact(self._client, [], success=[tx.Put(k, v, lease=lease) for k, v in sealed])
        )

    def _rows(self, full: str) -> list:
        return transact(self._client, [], success=[tx.Get(full)]).responses[0]

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        while True:
            rows = self._rows(full)
            if rows:
                value, meta = rows[0]
                new_value = self._counter(full, value) + amount
                guard = tx.Mod(full) == meta.mod_revision
            else:
                new_value, guard = amount, tx.Version(full) == 0
            if self._swap(full, guard, str(new_value).encode()):
                return new_value

    def _swap(self, full: str, guard: object, new_value: bytes) -> bool:
        sealed = self._seal(full, new_value)
        return self._lease.write(
            lambda lease: transact(self._client, [guard], success=[tx.Put(full, sealed, lease=lease)]).succeeded
        )

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """TCPStore's semantics: set if the value equals ``expected`` (or is absent and
        ``expected`` is empty); return the value now stored, or ``expected`` if absent."""
        full = self._key(key)
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        while True:
            rows = self._rows(full)
            if not rows:
                if expected:
                    return expected
                guard = tx.Version(full) == 0
            else:
                value, meta = rows[0]
                current = self._open(full, value)
                if current != expected:
                    return current
                guard = tx.Mod(full) == meta.mod_revision
            if self._swap(full, guard, desired):
                return desired

    def append(self, key: str, value: str | bytes) -> None:
        full = self._key(key)
        while True:
            rows = self._rows(full)
            if rows:
                current, meta = rows[0]
                combined = self._open(full, current) + _as_bytes(value)
                guard = tx.Mod(full) == meta.mod_revision
            else:
                combined, guard = _as_bytes(value), tx.Version(full) == 0
            if self._swap(full, guard, combined):
                return

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for([self._key(k) for k in keys], self.timeout if timeout is None else timeout)

    def check(self, keys: list[str]) -> bool:
        full = [self._key(k) for k in keys]
        found, _ = self._read(full)
        return len(found) == len(full)

    def delete_key(self, key: str) -> bool:
        return bool(self._client.call(lambda c: c.delete(self._key(key))))

    def num_keys(self) -> int:
        """Keys under this store's prefix (through a PrefixStore too: torch counts the
        underlying store's keys, not the wrapper's)."""
        response = self._client.call(
            lambda c: c.get_prefix_response(self._prefix, keys_only=True, count_only=True)
        )
        return int(response.count)

    def list_keys(self) -> list[str]:
        """The keys under this store's prefix, sorted. torch's PrefixStore does not pass
        this call on to a Python store, so only a direct call reaches it."""
        response = self._client.call(lambda c: c.get_prefix_response(self._prefix, keys_only=True))
        return sorted(kv.key.decode()[len(self._prefix):] for kv in response.kvs)

    def has_extended_api(self) -> bool:
        """True: ``append``, ``multi_get``, ``multi_set`` and ``compare_set`` are native
        here (transactions), not torch's non-atomic fallbacks over get/set."""
        return True

    def clone(self) -> EtcdV3Store:
        """A second handle on the same keys, for torch's process-group split and shrink.

        It shares the thread-safe etcd client (one gRPC channel multiplexes concurrent
        requests, so a clone used by another thread does not queue behind this one) and the
        lease; it starts with this store's timeout and keeps its own from then on.
        """
        twin = EtcdV3Store(self._client, self._prefix, self._signer, ttl=self._ttl, timeout=self.timeout)
        twin._lease = self._lease
        twin._family = self._family
        self._family.append(twin)
        return twin

    # -- the names torch's C++ trampoline looks up (PrefixStore, process groups) -------
    def getNumKeys(self) -> int:  # noqa: N802 - the C++ name PrefixStore.num_keys() calls
        return self.num_keys()

    def deleteKey(self, key: str) -> bool:  # noqa: N802 - the C++ name PrefixStore.delete_key() calls
        return self.delete_key(key)

    # -- not supported -----------------------------------------------------------------
    def queue_push(self, key: str, value: str | bytes) -> None:
        raise _unsupported("queue_push")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        raise _unsupported("queue_pop")

    def queue_len(self, key: str) -> int:
        raise _unsupported("queue_len")


def _unsupported(operation: str) -> NotImplementedError:
    """Queues would need an ordered, blocking pop, and no torch component that runs on
    this store (rendezvous, gloo, the elastic agent) uses them: refuse plainly."""
    return NotImplementedError(
        f"EtcdV3Store does not support {operation}: queues are not implemented on etcd; "
        "use a TCPStore for queue_push/queue_pop/queue_len"
    )
