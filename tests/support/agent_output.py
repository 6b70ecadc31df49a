"""A node's output as its agent leaves it, for tests of what reads it (agent.local.local_node):
the workers' lines in the node's log and the agent's events (agent.node.events) beside it,
each event marked with the log's length when it was written, as the agent marks it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from agent.node.events import EVENTS_FILE, Event, to_line


def write_output(log_path: Path, *items: str | Event, agent_dir: Path | None = None) -> None:
    """Append ``items`` in order: a str is a line of the log, an event goes to the agent's
    events file (``agent_dir``, default: ``<log's stem>.agent`` beside it, as LocalNode's)."""
    agent_dir = agent_dir if agent_dir is not None else log_path.with_name(f"{log_path.stem}.agent")
    agent_dir.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log, open(agent_dir / EVENTS_FILE, "a") as events:
        for item in items:
            if isinstance(item, str):
                log.write(item + "\n")
                log.flush()
            else:
                events.write(to_line(dataclasses.replace(item, log_offset=log.tell())))
