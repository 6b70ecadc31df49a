"""The zygote that local nodes' agents (and the tests' own scripts) are forked from.

A forked process must be what ``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` would have
started: its own argv, ``sys.path[0]``, environment, working directory, ``__main__``, session and
log, its exit code (or signal) reported, and ``ps`` showing its own command. Where the zygote
cannot fork, the caller starts the process by exec.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from agent.local.local_node import LocalNode
from agent.local.zygote import ForkedProcess, Zygote, ZygoteGone
from tests.support.waiting import wait_until

SCRIPT = """\
import json, os, sys, torch
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                  "env": os.environ.get("ZYGOTE_PROBE"), "sid": os.getsid(0) == os.getpid(),
                  "torch": torch.__version__}), flush=True)
if sys.argv[1] == "wait":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


def _said(log: Path) -> dict[str, object]:
    return json.loads(log.read_text().splitlines()[0])


@pytest.mark.slow  # starts processes
def test_a_forked_script_runs_as_its_command_line_would_and_its_exit_code_comes_back(
        zygote: Zygote, tmp_path: Path) -> None:
    script, work, log = tmp_path / "scripts" / "job.py", tmp_path / "work", tmp_path / "job.log"
    script.parent.mkdir()
    work.mkdir()
    script.write_text(SCRIPT)
    proc = zygote.fork(str(script), ["7", "x"], {**os.environ, "ZYGOTE_PROBE": "mine"}, work, log, kind="script")
    assert isinstance(proc, ForkedProcess)
    assert proc.wait(timeout=60) == 7
    said = _said(log)
    assert said["argv"] == [str(script), "7", "x"] and said["path0"] == str(script.parent), said
    assert said["cwd"] == str(work) and said["name"] == "__main__" and said["env"] == "mine", said
    assert said["sid"] is True, "a forked process runs in a session of its own, as Popen(start_new_session) would"


@pytest.mark.slow  # starts processes
def test_a_forked_process_killed_by_a_signal_reports_it_and_shows_its_own_command(
        zygote: Zygote, tmp_path: Path) -> None:
    script, log = tmp_path / "job.py", tmp_path / "job.log"
    script.write_text(SCRIPT)
    proc = zygote.fork(str(script), ["wait"], dict(os.environ), tmp_path, log, kind="script")
    wait_until(lambda: log.exists() and log.read_text().strip(), 60, "the forked script to start")
    title = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert f"{script} wait" in title and "zygote" not in title, title
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.slow  # starts processes
def test_a_module_runs_as_python_dash_m_would(zygote: Zygote, tmp_path: Path) -> None:
    log = tmp_path / "m.log"
    proc = zygote.fork("json.tool", ["--help"], dict(os.environ), tmp_path, log, kind="module")
    assert proc.wait(timeout=60) == 0
    assert "usage:" in log.read_text() and "json.tool" in log.read_text(), log.read_text()


@pytest.mark.slow  # starts processes
def test_a_node_whose_zygote_is_gone_starts_its_agent_by_exec(zygote: Zygote, tmp_path: Path) -> None:
    zygote.close()
    with pytest.raises(ZygoteGone):
        zygote.fork("agent.cli", ["--help"], dict(os.environ), tmp_path, tmp_path / "x.log")
    node = LocalNode(name="a", endpoint="127.0.0.1:1", run_id="r", workdir=tmp_path, zygote=zygote,
                     agent_args=["--lease-ttl", "0"])
    node.start()
    try:
        assert isinstance(node.process, subprocess.Popen)
        assert node.process.wait(timeout=120) != 0  # the agent ran (and refused its flags) by exec
    finally:
        node.cleanup()


@pytest.mark.slow  # starts processes
def test_a_node_whose_forked_agent_ended_signals_nothing_under_its_old_pid(zygote: Zygote, tmp_path: Path) -> None:
    """The zygote reaps a forked process at once, so nothing holds its pid once it ends, and on
    a busy machine (pid_max 32768, a pid per thread) the kernel gives it to another process
    within minutes: a whole-suite run once saw an agent that had logged its normal end come
    back as -9. The kernel's reuse cannot be forced, so the ended process's pid is pointed at a
    live stranger of ours (the one stand-in here); its kill, its node's kill and clean-up must
    leave the stranger alone."""
    script, log = tmp_path / "job.py", tmp_path / "job.log"
    script.write_text(SCRIPT)
    proc = zygote.fork(str(script), ["0"], dict(os.environ), tmp_path, log, kind="script")
    assert isinstance(proc, ForkedProcess)
    wait_until(lambda: zygote.exit_code(proc.pid) is not None, 60, "the forked process to end")
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        # the kernel's reuse of the freed pid, made certain: the pid the zygote said ended now names the stranger
        zygote._exits[stranger.pid] = zygote._exits.pop(proc.pid)
        proc.pid = stranger.pid
        proc.kill()
        node = LocalNode(name="a", endpoint="127.0.0.1:1", run_id="r", workdir=tmp_path, process=proc)
        assert node.kill() == []
        node.freeze()
        node.cleanup()
        assert stranger.poll() is None, "a signal meant for the ended process reached the stranger"
        assert proc.returncode == 0
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.slow  # starts a process
def test_a_child_started_under_an_ended_childs_pid_is_not_taken_for_ended() -> None:
    """The kernel reuses pids (pid_max 32768 here, a pid per thread), so a new agent can get the
    pid of one this zygote forked and reported ended earlier in the session, as SIGKILLed (-9).
    Its node then read as ended at once, with that old -9: a whole-suite run failed a job whose
    agent had logged its normal end. The reuse cannot be forced, so ``cat`` stands in for the
    zygote's reply stream (the protocol's lines, in its order); the parsing is the real one."""
    zygote = Zygote()
    stream = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert stream.stdin is not None and stream.stdout is not None
    os.set_blocking(stream.stdout.fileno(), False)
    zygote._process = stream
    try:
        def say(line: str) -> None:
            assert stream.stdin is not None
            stream.stdin.write(f"{line}\n".encode())
            stream.stdin.flush()

        pid = 2 ** 22 + 17  # no live process of ours: exit codes come from the stream alone
        say(f"exited {pid} -9")
        assert zygote.exit_code(pid, timeout=10) == -9
        say(f"started 7 {pid}")  # a new child under that pid
        assert zygote._line(10) == f"started 7 {pid}"
        assert zygote.exit_code(pid) is None, "the new child was taken for the ended one"
        say(f"exited {pid} 0")
        assert zygote.exit_code(pid, timeout=10) == 0
        say(f"started 8 {pid}")
        say(f"exited {pid} 3")  # read in one batch with its start: kept
        assert zygote._line(10) == f"started 8 {pid}" and zygote.exit_code(pid, timeout=10) == 3
    finally:
        zygote._process = None
        stream.kill()
        stream.wait()
