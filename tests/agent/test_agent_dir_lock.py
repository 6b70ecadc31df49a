"""Two agents on one ``--agent-dir``: the second is refused and the first's files stay.

A second ``elastic agent`` started by mistake with the same directory used to clear the live
agent's run-time folders; the live agent crashed writing its next round's offer there. The
live agent here is a real process holding the directory as the agent does (claim_agent_dir);
its death, even by SIGKILL, frees the directory."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.node.agent_dir import AgentDirError, claim_agent_dir
from tests.support.waiting import wait_until

HOLDER = """
import sys
from pathlib import Path
from agent.node.agent_dir import claim_agent_dir
d = claim_agent_dir(sys.argv[1])
(Path(sys.argv[1]) / "control").mkdir()
(Path(sys.argv[1]) / "control" / "round.json").write_text("{}")
print("claimed", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_second_claim_of_a_live_agents_directory_is_refused_and_clears_nothing(tmp_path: Path) -> None:
    agent_dir = tmp_path / "a.agent"
    live = subprocess.Popen([sys.executable, "-c", HOLDER, str(agent_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert live.stdout is not None and live.stdout.readline().strip() == "claimed"
        with pytest.raises(AgentDirError, match=rf"in use by a live agent \(pid {live.pid}\)") as info:
            claim_agent_dir(agent_dir)
        assert "\n" not in str(info.value)
        assert (agent_dir / "control" / "round.json").read_text() == "{}", "the live agent's files were cleared"

        live.send_signal(signal.SIGKILL)
        live.wait(timeout=10)
        wait_until(lambda: live.poll() is not None, 10, "the holder to die")
        mine = claim_agent_dir(agent_dir)  # the kernel dropped the dead agent's lock
        try:
            assert not (agent_dir / "control").exists()  # a dead agent's run-time folders are cleared, as before
        finally:
            mine.release()
    finally:
        if live.poll() is None:
            live.kill()
            live.wait(timeout=10)
