"""Standby workers: a real pool of pre-imported processes turned into workers.

The pool is driven directly (no agent) so each promise can be checked in isolation:
the worker runs the script as ``__main__`` with torchrun's argv and environment, torch
is already imported when its first line runs, log files and exit codes are what a cold
start gives, and a failed worker exits at once. tests/agent/test_recovery.py checks
that a real agent's restarts after a node loss are warm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from agent.node.proctree import process_tree
from agent.node.warm_start import WarmPool
from tests.conftest import WARM_START_ENV
from agent.worker.worker_boot import BOOT_CODE, boot_command, parse_boot_command
from tests.support.waiting import wait_until

PY = sys.executable

PROBE = """\
import json, os, sys
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "rank": os.environ.get("RANK"),
                  "torch_preloaded": "torch" in sys.modules, "started_at": os.environ.get("ELASTIC_WORKER_STARTED_AT"),
                  "pid": os.getpid()}), flush=True)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


@pytest.mark.parametrize(("target", "args", "module", "expected"), [
    ("train.py", ["--lr", "1"], False, {"script": "train.py", "args": ["--lr", "1"]}),
    ("elastic.train", ["--job", "mlp"], True, {"module": "elastic.train", "args": ["--job", "mlp"]}),
    ("train.py", [], False, {"script": "train.py", "args": []}),
])
def test_the_agents_python_commands_are_warmable(target: str, args: list[str], module: bool, expected: dict) -> None:
    assert parse_boot_command(boot_command(PY, target, args, module)) == expected


@pytest.mark.parametrize("command", [
    ("/usr/bin/env", "bash", "job.sh"),  # --no-python
    ("numactl", "--cpunodebind=0", PY, "-u", "-c", BOOT_CODE, "train.py"),  # a NUMA wrapper
    (PY, "-X", "importtime", "train.py"),  # not the agent's boot command
    ("/usr/bin/python2", "-u", "-c", BOOT_CODE, "train.py"),  # another interpreter
    (PY, "-u", "-c", BOOT_CODE, "-m"),
    (PY, "-u", "-c", BOOT_CODE),
])
def test_anything_else_starts_cold(command: tuple[str, ...]) -> None:
    assert parse_boot_command(command) is None


@pytest.fixture
def pool() -> Iterator[WarmPool]:
    pool = WarmPool(1)
    try:
        yield pool
    finally:
        pool.close()


def ready(pool: WarmPool) -> None:
    pool.fill()
    wait_until(lambda: pool.ready_count() == 1, 120, "the standby to finish importing torch")


def run_probe(pool: WarmPool, tmp_path: Path, exit_code: int = 0) -> tuple[subprocess.Popen[bytes], Path, Path]:
    script = tmp_path / "job" / "train.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(PROBE)
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    env = {**os.environ, "RANK": "3", "EXIT_CODE": str(exit_code)}
    proc = pool.take(boot_command(PY, str(script), ["--lr", "0.1"], module=False), env, str(out), str(err))
    assert proc is not None, "a ready standby was not used"
    return proc, out, err


@pytest.mark.slow  # starts processes
def test_a_standby_becomes_the_worker_with_torchruns_argv_env_and_logs(pool: WarmPool, tmp_path: Path) -> None:
    ready(pool)
    given_at = time.time()
    proc, out, _ = run_probe(pool, tmp_path)
    assert proc.wait(timeout=60) == 0
    seen = json.loads(out.read_text())
    script = str(tmp_path / "job" / "train.py")
    assert seen["name"] == "__main__" and seen["argv"] == [script, "--lr", "0.1"]
    assert seen["path0"] == str(tmp_path / "job")  # as `python train.py` sets it
    assert seen["rank"] == "3" and seen["torch_preloaded"] is True and seen["pid"] == proc.pid
    assert given_at <= float(seen["started_at"]) <= time.time()  # time to first step counts from here


@pytest.mark.slow  # starts processes
def test_exit_codes_pass_through_and_a_failure_exits_at_once(pool: WarmPool, tmp_path: Path) -> None:
    ready(pool)
    proc, _, _ = run_probe(pool, tmp_path, exit_code=2)
    assert proc.wait(timeout=60) == 2  # the agent's "usage error, do not restart" code survives

    pool.fill()
    wait_until(lambda: pool.ready_count() == 1, 120, "the replacement standby")
    script = tmp_path / "boom.py"
    script.write_text("import atexit, sys\natexit.register(lambda: print('atexit ran', flush=True))\n"
                      "raise RuntimeError('Connection closed by peer')\n")
    out, err = tmp_path / "boom.out", tmp_path / "boom.err"
    boom = pool.take(boot_command(PY, str(script), [], module=False), dict(os.environ), str(out), str(err))
    assert boom is not None
    assert boom.wait(timeout=60) == 1
    assert "RuntimeError: Connection closed by peer" in err.read_text()
    assert out.read_text() == "atexit ran\n"  # a snapshot writer's atexit flush still happens


@pytest.mark.slow  # starts processes
def test_module_mode_runs_from_the_working_directory(pool: WarmPool, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "myjob").mkdir()
    (tmp_path / "myjob" / "__init__.py").write_text("")
    (tmp_path / "myjob" / "main.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)  # the agent's working directory is the workers'
    ready(pool)
    out = tmp_path / "stdout.log"
    proc = pool.take(boot_command(PY, "myjob.main", ["x"], module=True), dict(os.environ), str(out), None)
    assert proc is not None and proc.wait(timeout=60) == 0
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__" and seen["argv"] == [str(tmp_path / "myjob" / "main.py"), "x"]


@pytest.mark.slow  # starts processes
def test_no_standby_means_a_cold_start_and_close_leaves_no_process(pool: WarmPool, tmp_path: Path) -> None:
    assert pool.take(boot_command(PY, "train.py", [], module=False), dict(os.environ), None, None) is None
    assert pool.take(("/bin/true",), dict(os.environ), None, None) is None
    before = set(process_tree(os.getpid()))  # a session's etcd may be our child too
    pool.fill()
    standby_pids = set(process_tree(os.getpid())) - before
    assert len(standby_pids) == 1
    pool.close()
    wait_until(lambda: not (set(standby_pids) & set(process_tree(os.getpid()))), 30, "standbys to exit")


@pytest.mark.parametrize(("argv", "env", "expected"), [
    ([], {}, True),
    (["--no-warm-start"], {}, False),
    ([], {"ELASTIC_WARM_START": "0"}, False),
    (["--warm-start"], {"ELASTIC_WARM_START": "0"}, True),  # a flag given wins over the environment
])
def test_warm_start_is_on_by_default_and_can_be_turned_off(argv: list[str], env: dict[str, str], expected: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.node.launch import build_agent_parser

    monkeypatch.delenv(WARM_START_ENV, raising=False)  # tests/conftest.py turns it off for agents
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert build_agent_parser().parse_args([*argv, "train.py"]).warm_start is expected
