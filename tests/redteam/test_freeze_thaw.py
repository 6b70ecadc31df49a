"""``elastic kill --via-etcd --freeze --seconds 1`` must thaw the node after a second.

The agent that finds a freeze command in etcd freezes its own process tree. Its thaw
helper used to be its own child, so the SIGSTOP of the tree stopped the helper too and the
node stayed frozen for good. Here a real process tree (a parent and a child, plain Python
sleeping loops) runs the agent's own code path on a signed freeze command for 1 s, and
must be running again within a deadline, with no helper left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.node.commands import FREEZE, KILL, MAX_FREEZE_S, Command
from agent.tools.kill import THAW_MARK, freeze_for
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow  # real process trees, frozen and thawed

REPO = Path(__file__).resolve().parents[2]

# The child appends a timestamp every 20 ms; the parent does too, then acts on a freeze
# command from its (fake) mirror exactly as an agent's monitor loop does, and goes on.
CHILD = "import sys, time\nwhile True:\n    print(time.time(), file=open(sys.argv[1], 'a')); time.sleep(0.02)\n"
PARENT = """\
import subprocess, sys, time, types
from pathlib import Path
out = Path(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", sys.argv[2], str(out / "child.beats")])
(out / "child.pid").write_text(str(child.pid))
from agent.node.commands import FREEZE, CommandWatch, Command, command_key
from agent.rendezvous.session import EtcdSession
from agent.rendezvous.signing import StateSigner
signer = StateSigner(b"k" * 32)
key = command_key("/elastic", "run", "node")
mirror = {}
handler = types.SimpleNamespace(
    options=types.SimpleNamespace(key_prefix="/elastic"), run_id="run", signer=signer,
    mirror=types.SimpleNamespace(entries=lambda: (mirror, 0)),
    client=types.SimpleNamespace(call=lambda request, deadline=None: mirror.clear()))
watch = CommandWatch(EtcdSession(handler), "node")
while not (out / "go").exists():
    time.sleep(0.02)
value = signer.seal(key.encode(), Command(FREEZE, float(sys.argv[3]), time.time()).to_json())
mirror[key] = types.SimpleNamespace(value=value)
(out / "parent.beats").write_text(f"{time.time()}\\n")
watch.poll()
while True:
    with open(out / "parent.beats", "a") as f:
        print(time.time(), file=f)
    time.sleep(0.02)
"""


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def _beats(path: Path) -> list[float]:
    try:
        return [float(line) for line in path.read_text().split()]
    except (OSError, ValueError):  # a line half-written
        return []


def _helpers(root: int) -> list[int]:
    """Live thaw helpers whose pid list holds ``root``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if THAW_MARK.encode() in argv and str(root).encode() in argv and _state(int(entry.name)) not in (None, "Z"):
            found.append(int(entry.name))
    return found


def _kill(*pids: int) -> None:
    for pid in pids:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _largest_gap(beats: list[float]) -> float:
    return max((b - a for a, b in zip(beats, beats[1:])), default=0.0)


def test_an_agent_frozen_by_a_command_from_etcd_thaws_after_its_seconds(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), CHILD, "1.0"], cwd=REPO, env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    child = 0
    try:
        child = int(wait_until(lambda: (tmp_path / "child.pid").exists() and (tmp_path / "child.pid").read_text(),
                               30, "the parent to start its child"))
        wait_until(lambda: len(_beats(tmp_path / "child.beats")) >= 3, 30, "the child to beat")
        (tmp_path / "go").touch()
        wait_until(lambda: (tmp_path / "parent.beats").exists(), 30, "the parent to act on the command")
        frozen_from = _beats(tmp_path / "parent.beats")[0]

        def both_back() -> bool:
            parent_beats, child_beats = _beats(tmp_path / "parent.beats"), _beats(tmp_path / "child.beats")
            return (len(parent_beats) >= 3 and bool(child_beats) and child_beats[-1] > frozen_from + 1.0
                    and _state(parent.pid) not in ("T", None) and _state(child) not in ("T", None))

        wait_until(both_back, 20, "the frozen parent and child to run again",
                   on_timeout=lambda: f"states: parent {_state(parent.pid)}, child {_state(child)}; "
                                      f"helpers {_helpers(parent.pid)}; {parent.stderr}")
        # they were frozen for the second asked for: neither made progress meanwhile
        parent_beats = _beats(tmp_path / "parent.beats")
        assert parent_beats[1] - parent_beats[0] >= 0.9, parent_beats[:3]
        child_beats = [b for b in _beats(tmp_path / "child.beats") if b >= frozen_from - 0.5]
        assert _largest_gap(child_beats) >= 0.9, "the child was not frozen"
        assert parent.poll() is None, "the parent died instead of thawing"
        wait_until(lambda: not _helpers(parent.pid), 10, "the thaw helper to exit")
    finally:
        _kill(parent.pid, child, *_helpers(parent.pid))
        parent.wait(timeout=10)
        if parent.stderr is not None:
            parent.stderr.close()


def test_the_helper_is_not_in_the_tree_it_thaws(tmp_path: Path) -> None:
    """Direct path (``elastic kill --freeze`` on this machine): the helper is reparented away
    from the caller too, so freezing a tree that holds the caller cannot catch it."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.02)"],
                               start_new_session=True)
    try:
        frozen = freeze_for(sleeper.pid, 1.0)
        assert frozen == [sleeper.pid]
        helpers = _helpers(sleeper.pid)
        assert len(helpers) == 1
        status = Path(f"/proc/{helpers[0]}/status").read_text()
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        assert ppid != os.getpid(), "the helper is this process's child"
        wait_until(lambda: _state(sleeper.pid) == "T", 5, "the sleeper to be stopped", interval=0.01)
        wait_until(lambda: _state(sleeper.pid) not in ("T", None), 15, "the sleeper to run again")
        wait_until(lambda: not _helpers(sleeper.pid), 10, "the thaw helper to exit")
    finally:
        _kill(sleeper.pid, *_helpers(sleeper.pid))
        sleeper.wait(timeout=10)


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), float("inf"), MAX_FREEZE_S * 2])
def test_a_freeze_no_thaw_could_end_is_refused(seconds: float) -> None:
    with pytest.raises(ValueError):
        freeze_for(os.getpid(), seconds)
    with pytest.raises(ValueError):  # nor is such a command read from etcd
        Command.from_json(Command(FREEZE, seconds, time.time()).to_json())
    assert Command.from_json(Command(KILL, seconds, time.time()).to_json()).action == KILL
