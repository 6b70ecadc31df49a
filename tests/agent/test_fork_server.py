"""Warm starts by fork: a real template forking real workers, driven without an agent.

Each promise a cold start makes is checked on a forked worker: the script runs as
``__main__`` with torchrun's argv and environment and its own log files, in a session of
its own; exit codes (a signal's included) reach the agent; a failure exits at once with
the atexit flush. And what a fork adds: one template serves every start, its workers die
with it, each draws its own random numbers, and a template that cannot fork safely hands
over to standbys. tests/agent/test_recovery.py and the end-to-end suites run real agents,
whose workers are forked by default.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from agent.node.fork_server import ForkServer, ForkedProcess
from agent.node.proctree import process_tree
from agent.worker.worker_boot import boot_command
from checkpoints.layout import pid_alive
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow  # every test here starts a template

PY = sys.executable

PROBE = """\
import gc, json, os, random, sys
import numpy
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "rank": os.environ.get("RANK"),
                  "torch_preloaded": "torch" in sys.modules, "frozen": gc.get_freeze_count(),
                  "started_at": os.environ.get("ELASTIC_WORKER_STARTED_AT"),
                  "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "random": random.random(),
                  "numpy": float(numpy.random.random()),
                  "ps": open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode()}), flush=True)
if os.environ.get("HANG"):
    import time
    time.sleep(600)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


def _closed_after() -> Iterator[ForkServer]:
    server = ForkServer(2)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def shared() -> Iterator[ForkServer]:
    """One template for the tests that neither kill nor close it (each start costs it a fork)."""
    yield from _closed_after()


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[ForkServer]:
    """A template of the test's own, for those that kill or close it. It preloads numpy, not
    torch: what these tests check is its life and death, the same for any import, and a
    template's torch import is the suite's dearest start (the shared template's tests and
    the agent-forked one check that torch is preloaded)."""
    monkeypatch.setenv("ELASTIC_WARM_IMPORTS", "numpy")
    yield from _closed_after()


def ready(server: ForkServer) -> None:
    server.fill()
    wait_until(lambda: server.ready_count() == server.size, 120, "the template to finish its imports")


def template_pid(server: ForkServer) -> int:
    pid = server.template_pid
    assert pid is not None and pid in process_tree(os.getpid()), "no live template of this server"
    return pid


def start(server: ForkServer, tmp_path: Path, name: str, **env: str) -> tuple[ForkedProcess, Path, Path]:
    script = tmp_path / "job" / "train.py"
    if not script.exists():  # written once: rewriting it would truncate it under a worker reading it
        script.parent.mkdir(exist_ok=True)
        script.write_text(PROBE)
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    proc = server.take(boot_command(PY, str(script), ["--lr", "0.1"], module=False), {**os.environ, **env},
                       str(out), str(err))
    assert isinstance(proc, ForkedProcess), "a ready template did not fork the worker"
    return proc, out, err


def test_a_forked_worker_runs_the_script_with_torchruns_argv_env_and_logs_in_its_own_session(
        shared: ForkServer, tmp_path: Path) -> None:
    ready(shared)
    given_at = time.time()
    proc, out, _ = start(shared, tmp_path, "w", RANK="3")
    assert proc.wait(timeout=60) == 0
    seen = json.loads(out.read_text())
    script = str(tmp_path / "job" / "train.py")
    assert seen["name"] == "__main__" and seen["argv"] == [script, "--lr", "0.1"]
    assert seen["path0"] == str(tmp_path / "job")  # as `python train.py` sets it
    assert seen["rank"] == "3" and seen["torch_preloaded"] is True and seen["pid"] == proc.pid
    # the template's imports are out of every collection the worker makes, its exit's included
    # (agent.worker.gc_frozen): torch's objects number in the hundreds of thousands
    assert seen["frozen"] > 100_000, seen["frozen"]
    assert seen["sid"] == proc.pid  # its own session: the agent signals it and its children together
    assert f"{PY} -u {script} --lr 0.1" in seen["ps"]  # what `ps` shows: the worker's command, not the template's
    assert given_at <= float(seen["started_at"]) <= time.time()


def test_one_template_serves_every_start_and_each_worker_draws_its_own_random_numbers(
        shared: ForkServer, tmp_path: Path) -> None:
    ready(shared)
    template = template_pid(shared)
    runs = [start(shared, tmp_path, f"w{i}", RANK=str(i)) for i in range(4)]
    assert [proc.wait(timeout=60) for proc, _, _ in runs] == [0, 0, 0, 0]
    seen = [json.loads(out.read_text()) for _, out, _ in runs]
    assert {s["ppid"] for s in seen} == {template}  # no import per start: all forked from the one template
    assert len({s["random"] for s in seen}) == 4, "forked workers share Python's random state"
    assert len({s["numpy"] for s in seen}) == 4, "forked workers share NumPy's random state"
    assert template_pid(shared) == template


def test_exit_codes_and_signals_reach_the_agent_and_a_failure_exits_at_once(shared: ForkServer,
                                                                           tmp_path: Path) -> None:
    ready(shared)
    proc, _, _ = start(shared, tmp_path, "usage", EXIT_CODE="2")
    assert proc.wait(timeout=60) == 2  # the agent's "usage error, do not restart" code survives

    hung, out, _ = start(shared, tmp_path, "hung", HANG="1")
    wait_until(lambda: out.exists() and out.read_text(), 60, "the worker to start")
    assert hung.poll() is None
    os.killpg(hung.pid, signal.SIGKILL)  # as LocalWorkers.stop ends a worker
    assert hung.wait(timeout=30) == -signal.SIGKILL  # Popen's meaning: minus the signal

    script = tmp_path / "boom.py"
    script.write_text("import atexit, sys\natexit.register(lambda: print('atexit ran', flush=True))\n"
                      "raise RuntimeError('Connection closed by peer')\n")
    out, err = tmp_path / "boom.out", tmp_path / "boom.err"
    boom = shared.take(boot_command(PY, str(script), [], module=False), dict(os.environ), str(out), str(err))
    assert boom is not None and boom.wait(timeout=60) == 1
    assert "RuntimeError: Connection closed by peer" in err.read_text()
    assert out.read_text() == "atexit ran\n"  # a snapshot writer's atexit flush still happens


def test_a_dead_template_takes_its_workers_with_it_and_the_next_fill_starts_another(
        server: ForkServer, tmp_path: Path) -> None:
    ready(server)
    old = template_pid(server)
    hung, out, _ = start(server, tmp_path, "hung", HANG="1")
    wait_until(lambda: out.exists() and out.read_text(), 60, "the worker to start")
    os.kill(old, signal.SIGKILL)  # the worker's parent: PR_SET_PDEATHSIG ends it too
    assert hung.wait(timeout=30) == -signal.SIGKILL
    assert server.ready_count() == 0 and not server.full
    assert server.take(boot_command(PY, "train.py", [], module=False), dict(os.environ), None, None) is None

    ready(server)
    assert template_pid(server) != old
    proc, _, _ = start(server, tmp_path, "again")
    assert proc.wait(timeout=60) == 0


def test_a_template_that_cannot_fork_safely_hands_over_to_standbys(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A module whose import leaves a thread running, as a library's might: a fork would copy
    # whatever lock that thread holds. The template must refuse, and warm starts go on.
    (tmp_path / "threaded.py").write_text("import threading, time\n"
                                          "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("ELASTIC_WARM_IMPORTS", "torch,threaded")
    server = ForkServer(1)
    try:
        ready(server)  # ready by the standbys it keeps instead
        (tmp_path / "probe.py").write_text(PROBE)
        proc = server.take(boot_command(PY, str(tmp_path / "probe.py"), [], module=False), dict(os.environ),
                           str(tmp_path / "out"), None)
        assert proc is not None and not isinstance(proc, ForkedProcess)
        assert proc.wait(timeout=60) == 0
        assert json.loads((tmp_path / "out").read_text())["torch_preloaded"] is True
    finally:
        server.close()


def test_other_commands_start_cold_and_close_leaves_no_process(server: ForkServer, tmp_path: Path) -> None:
    assert server.take(boot_command(PY, "train.py", [], module=False), dict(os.environ), None, None) is None
    before = set(process_tree(os.getpid()))  # a session's etcd may be our child too
    ready(server)
    assert server.take(("/bin/true",), dict(os.environ), None, None) is None  # --no-python: not ours to fork
    hung, out, _ = start(server, tmp_path, "hung", HANG="1")
    wait_until(lambda: out.exists() and out.read_text(), 60, "the worker to start")
    started = set(process_tree(os.getpid())) - before
    assert len(started) == 3  # the template, its worker and the worker's snapshot writer forked ahead
    server.close()  # the agent stops its workers first; one left behind dies with the template
    wait_until(lambda: hung.poll() is not None, 30, "the worker to die with its template")
    assert hung.poll() == -signal.SIGKILL
    # the worker's writer stub dies with it (PR_SET_PDEATHSIG), a moment after
    wait_until(lambda: not [pid for pid in started if pid_alive(pid)], 30, "every process it started to end")


DRIVER = """\
import json, os, sys
from agent.node.fork_server import ForkServer, fork_early
from agent.worker.worker_boot import boot_command
fork_early()  # as `elastic agent` does first: the template shares this process's torch import
node_env = {**os.environ, "NODE_ONLY": "from the agent's node env", "PROMETHEUS_MULTIPROC_DIR": sys.argv[3]}
server = ForkServer(1, env=node_env)
server.fill()
import time
deadline = time.monotonic() + 120
while server.ready_count() < 1 and time.monotonic() < deadline:
    time.sleep(0.05)
out = sys.argv[2]
proc = server.take(boot_command(sys.executable, sys.argv[1], [], module=False),
                   {**server.env, "RANK": "5"}, out, out + ".err")
code = proc.wait(timeout=60) if proc is not None else None
print(json.dumps({"agent": os.getpid(), "forked": type(proc).__name__, "code": code}), flush=True)
server.close()
"""

WORKER = """\
import json, os, sys
template = os.getppid()
with open(f"/proc/{template}/stat") as stat:
    template_parent = int(stat.read().rsplit(")", 1)[1].split()[1])
with open(f"/proc/{template}/cmdline", "rb") as cmdline:
    template_command = cmdline.read().replace(b"\\0", b" ").decode().strip()
print(json.dumps({"node_only": os.environ.get("NODE_ONLY"), "rank": os.environ.get("RANK"),
                  "torch_preloaded": "torch" in sys.modules, "sid": os.getsid(0), "pid": os.getpid(),
                  "template_parent": template_parent, "template_command": template_command,
                  "metrics_mode": __import__("prometheus_client.values").values.ValueClass.__name__,
                  "metrics_preloaded": "prometheus_client" in sys.modules,
                  "ps": open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode()}), flush=True)
"""


def test_a_template_forked_from_the_agent_takes_the_node_env_and_forks_workers(tmp_path: Path) -> None:
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "worker.out"
    root = str(Path(__file__).resolve().parents[2])
    (tmp_path / "metrics").mkdir()
    argv = [PY, str(tmp_path / "driver.py"), str(tmp_path / "worker.py"), str(out), str(tmp_path / "metrics")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "PYTHONPATH": root})  # the template dies with it (PDEATHSIG)
    assert done.returncode == 0, done.stderr
    agent = json.loads(done.stdout.strip().splitlines()[-1])
    assert agent["forked"] == "ForkedProcess" and agent["code"] == 0
    seen = json.loads(out.read_text())
    assert seen["node_only"] == "from the agent's node env" and seen["rank"] == "5"
    assert seen["torch_preloaded"] is True and seen["sid"] == seen["pid"]
    # the template is the agent's own fork (its command line, its child), not a new interpreter
    assert seen["template_parent"] == agent["agent"]
    assert seen["template_command"] == " ".join(argv)
    assert f"{PY} -u {tmp_path / 'worker.py'}" in seen["ps"]  # not the agent's command line
    # imported after the node's env arrived: prometheus_client in multiprocess mode, as the agent's /metrics needs
    assert seen["metrics_preloaded"] is True and seen["metrics_mode"] == "MmapedValue"


def test_a_pid_given_out_again_is_not_taken_for_its_predecessors_exit() -> None:
    """The kernel reuses pids (pid_max is 32768 here): a worker forked with the pid of one
    that exited long ago must not read as exited at once. The template's lines arrive in
    order: the old child's exit, then the new child's start."""
    server = ForkServer(1)
    for line in ("exited 4321 0", "started 7 4321"):
        server._heard(line)
    assert server.exit_code(4321) is None
    server._heard("exited 4321 3")
    assert server.exit_code(4321) == 3
