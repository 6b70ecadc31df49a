"""How a job ended, as its closed rendezvous carries it to every agent (no etcd here)."""

from __future__ import annotations

import pytest

from agent.rendezvous.ended import FAILED, SUCCEEDED, JobEnded


def test_a_failed_job_carries_its_cause_and_every_agent_says_it() -> None:
    ended = JobEnded.from_dict({"by": "node-0", "outcome": FAILED, "cause": "NameError: name 'x' is not defined"})
    assert ended.failed
    assert ended.line() == "the job failed (node node-0): NameError: name 'x' is not defined"


def test_only_a_known_success_is_one() -> None:
    assert not JobEnded.from_dict({"by": "a", "outcome": SUCCEEDED}).failed
    # closed by torch's agent, which does not say, or by an older one: not a success to exit 0 on
    unknown = JobEnded.from_dict({"by": "a"})
    assert unknown.failed and unknown.outcome == "" and "without saying how" in unknown.line()


@pytest.mark.parametrize("data", [{"by": 3, "outcome": "won", "cause": ["x"]}, {}])
def test_odd_values_are_not_taken_for_an_outcome(data: dict[str, object]) -> None:
    ended = JobEnded.from_dict(data)
    assert (ended.by, ended.outcome, ended.cause) == ("", "", "") and ended.failed
