"""How a job ended, as the closed rendezvous carries it to every agent.

The first agent to see the job's end (its workers trained the last step, or it judged
the job failed) closes the rendezvous; the others learn of the end from it, often while
they wait in a round. Before the key carried an outcome they all exited 0 ("the
rendezvous was closed"), so a failed job ended with exit 0 on some nodes. Now each exits
as the job did, with the same cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUCCEEDED, FAILED = "succeeded", "failed"


@dataclass(frozen=True)
class JobEnded:
    by: str  # the node that closed the rendezvous
    outcome: str  # SUCCEEDED, FAILED, or '' (closed by torch's agent, which does not say)
    cause: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobEnded":
        def text(key: str) -> str:
            value = data.get(key, "")
            return value[:1000] if isinstance(value, str) else ""

        outcome = text("outcome")
        return cls(by=text("by"), outcome=outcome if outcome in (SUCCEEDED, FAILED) else "", cause=text("cause"))

    @property
    def failed(self) -> bool:
        """Anything but a known success: exit 0 means the job trained its last step."""
        return self.outcome != SUCCEEDED

    def line(self) -> str:
        """One line for the operator: who ended the job, how and why."""
        who = f"node {self.by}" if self.by else "another node"
        if self.outcome == SUCCEEDED:
            return f"the job finished ({who}: workers succeeded)"
        if self.outcome == FAILED:
            return f"the job failed ({who}): {self.cause or 'no cause given'}"
        return f"the job's rendezvous was closed by {who} without saying how it ended (a torchrun agent?)"
