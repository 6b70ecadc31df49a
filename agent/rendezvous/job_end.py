"""The job's end: the ``{run}/rdzv/closed`` key, how the job ended, and who reads it.

One node marks the job over (:meth:`JobEnd.set_closed`, with a ``succeeded``/``failed``
outcome and its cause); every agent then exits as the job did. Readers look in the
watch-fed mirror first and ask etcd (2 s deadline) only when the mirror has no answer; a
value that fails verification is never acted on (the job is not over for it).
"""

from __future__ import annotations

import json
from typing import Callable

from agent.etcd import EtcdClient, EtcdError

from agent.rendezvous.ended import JobEnded
from agent.rendezvous.signing import SignatureError, StateSigner


class JobEnd:
    """``entries()`` is the mirror's entries ({} before the mirror started); ``signed(key, value)``
    verifies a value (the handler's :class:`.mirror_view.MirrorView`, which warns once per key)."""

    def __init__(self, node: str, client: EtcdClient, signer: StateSigner, key: str,
                 entries: Callable[[], dict],
                 signed: Callable[[str, bytes], bool]) -> None:
        self.node, self.client, self.signer, self.key = node, client, signer, key
        self._entries, self._signed = entries, signed

    def is_closed(self) -> bool:
        entry = self._entries().get(self.key)
        if entry is not None and self._signed(self.key, entry.value):
            return True
        try:
            value = self.client.call(lambda c: c.get(self.key), deadline=2.0)[0]
        except EtcdError:
            return False
        return value is not None and self._signed(self.key, value)

    def set_closed(self, outcome: str = "", cause: str = "") -> None:
        """Mark the job over; ``outcome`` (``succeeded``/``failed``) and ``cause`` travel with it."""
        ended = {"by": self.node, **({"outcome": outcome} if outcome else {}), **({"cause": cause} if cause else {})}
        value = self.signer.seal(self.key.encode(), json.dumps(ended).encode())
        self.client.call(lambda c: c.put(self.key, value))

    def seen(self) -> JobEnded | None:
        """How the job ended, from the watch-fed mirror only (no request: the agent's loop asks at
        every look); None while it shows no end, or one that fails verification."""
        entry = self._entries().get(self.key)
        return self._opened(entry.value) if entry is not None else None

    def outcome(self) -> JobEnded | None:
        """How the job ended, as the node that closed its rendezvous said (None: not closed,
        or a value that fails verification, which is never acted on)."""
        entry = self._entries().get(self.key)
        value = entry.value if entry is not None else None
        if value is None:
            try:
                value = self.client.call(lambda c: c.get(self.key), deadline=2.0)[0]
            except EtcdError:
                return None
        return self._opened(value) if value is not None else None

    def _opened(self, value: bytes) -> JobEnded | None:
        try:
            data = json.loads(self.signer.open(self.key.encode(), value))
        except (SignatureError, ValueError):
            return None
        return JobEnded.from_dict(data) if isinstance(data, dict) else None
