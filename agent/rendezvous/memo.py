"""Verify and decode each etcd value once, not on every look at the mirror.

The handler reads every registry and join key each time it looks at the job: ten times
a second per node in the agent's monitor loop (``restart_reason``), and on every watch
event while a round forms. Checking an HMAC and parsing JSON for each of N keys made
each look O(N) in crypto: 6.7 ms at 256 nodes, so 256 idle nodes on one machine wanted
17 cores just to poll, and one real node spent 7 % of a core. Almost every look sees the
values the previous one saw; remembering results by ``(key, value)`` turns a look into N
dictionary lookups. A changed value is a new memo key and is verified afresh, so nothing
is trusted that was not checked, and the memo holds only what the last look saw.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterable, TypeVar

T = TypeVar("T")


class DecodeMemo(Generic[T]):
    """``decode(pairs)``: ``[(key, decoded)]`` for the pairs whose ``decode_one`` is not None.

    ``decode_one(key, value)`` runs once per distinct ``(key, value)`` in a row of looks;
    a value it refused (None) stays refused without being checked again.
    """

    def __init__(self, decode_one: Callable[[str, bytes], T | None]) -> None:
        self._decode_one = decode_one
        self._seen: dict[tuple[str, bytes], T | None] = {}

    def decode(self, pairs: Iterable[tuple[str, bytes]]) -> list[tuple[str, T]]:
        seen, fresh = self._seen, {}
        decoded: list[tuple[str, T]] = []
        for pair in pairs:
            result = seen[pair] if pair in seen else self._decode_one(*pair)
            fresh[pair] = result
            if result is not None:
                decoded.append((pair[0], result))
        self._seen = fresh  # one assignment: a concurrent look sees the old memo or the new one
        return decoded
