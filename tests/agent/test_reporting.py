"""What the agent says about a round a worker asked for: told apart by the worker's field, not its words.

Pure: :meth:`Reporting.describe` over an observer's findings (the only part a REFORM's line
reads; the other parts are not touched, so they are left out, not mocked).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.node.policy import Action, Decision, Reason
from agent.node.reporting import Reporting
from elastic.inplace.channel import WorkerStatus


def _said(why: str, peers_stopped: bool) -> str:
    observer: Any = SimpleNamespace(kept_out_peers=[], reform_why=why, reform_peers_stopped=peers_stopped,
                               seen_failures={})
    none: Any = None
    reporting = Reporting(none, node="a", nproc=1, work_dir=Path("."), metrics=none, rdzv=none, watch=none,
                          workers=none, observer=observer)  # only the observer's findings are read
    return reporting.describe(Decision(Action.REJOIN, Reason.REFORM))


def test_peers_stopped_after_sigterm_is_said_as_such_whatever_the_words() -> None:
    assert _said("rank(s) [1] stopped after step 7 (SIGTERM)", True) == \
        "rank(s) [1] stopped after step 7 (SIGTERM): forming the round again without them"
    assert _said("they left", True) == "they left: forming the round again without them"


@pytest.mark.parametrize("why", ["Connection closed by peer", "ends in (SIGTERM)"])
def test_a_failed_collective_is_said_as_such_even_if_its_words_end_in_sigterm(why: str) -> None:
    assert _said(why, False) == f"a local worker's collective failed ({why}) while every lease held; forming " \
                                "the round again"


def test_the_field_crosses_the_channel_and_an_older_workers_status_reads_as_a_failure() -> None:
    status = WorkerStatus(pid=1, want_round_after=3, reason="r", peers_stopped=True)
    assert WorkerStatus.from_json(status.to_json()).peers_stopped
    assert not WorkerStatus.from_json(b'{"pid": 1, "want_round_after": 3, "reason": "x (SIGTERM)"}').peers_stopped
