"""DecodeMemo: each registry or join value is verified once, never trusted unverified."""

from __future__ import annotations

from typing import Callable

from agent.rendezvous.memo import DecodeMemo
from agent.rendezvous.registry import NodeRecord, decode_node
from agent.rendezvous.signing import StateSigner

JOB, OTHER = StateSigner(b"j" * 32), StateSigner(b"o" * 32)


def _counting(calls: list[str]) -> Callable[[str, bytes], NodeRecord | None]:
    """The handler's registry decoder, noting each key it is asked to check."""

    def decode(key: str, value: bytes) -> NodeRecord | None:
        calls.append(key)
        return decode_node(JOB, key, value)

    return decode


def _registry(signer: StateSigner, *names: str, state: str = "running") -> list[tuple[str, bytes]]:
    pairs = []
    for name in names:
        key = f"/elastic/run/nodes/{name}"
        pairs.append((key, signer.seal(key.encode(), NodeRecord(node=name, host="h", pid=1, state=state, started_at=0.0).to_json())))
    return pairs


def test_each_value_is_decoded_once_across_looks() -> None:
    calls: list[str] = []
    memo = DecodeMemo(_counting(calls))
    pairs = _registry(JOB, "a", "b", "c")
    for _ in range(10):  # ten monitor-loop looks at an unchanged registry
        assert [record.node for _, record in memo.decode(pairs)] == ["a", "b", "c"]
    assert len(calls) == 3


def test_a_changed_value_is_decoded_afresh() -> None:
    calls: list[str] = []
    memo = DecodeMemo(_counting(calls))
    memo.decode(_registry(JOB, "a", "b"))
    moved = _registry(JOB, "a") + _registry(JOB, "b", state="stopping")
    assert {r.node: r.state for _, r in memo.decode(moved)} == {"a": "running", "b": "stopping"}
    assert calls == ["/elastic/run/nodes/a", "/elastic/run/nodes/b", "/elastic/run/nodes/b"]


def test_a_forged_value_stays_out_and_a_resigned_one_is_checked() -> None:
    memo = DecodeMemo(lambda key, value: decode_node(JOB, key, value))
    forged = _registry(OTHER, "mallory")
    for _ in range(3):
        assert memo.decode(_registry(JOB, "a") + forged) == memo.decode(_registry(JOB, "a"))
    # the same key with a properly signed value is a new pair: verified, then trusted
    assert [r.node for _, r in memo.decode(_registry(JOB, "mallory"))] == ["mallory"]


def test_only_the_last_look_is_remembered() -> None:
    calls: list[str] = []
    memo = DecodeMemo(_counting(calls))
    first = _registry(JOB, "a")
    memo.decode(first)
    memo.decode(_registry(JOB, "b"))  # a left (its lease expired)
    memo.decode(first)  # the identical value again: forgotten, so checked again
    assert calls == ["/elastic/run/nodes/a", "/elastic/run/nodes/b", "/elastic/run/nodes/a"]
