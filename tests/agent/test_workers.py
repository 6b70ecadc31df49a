"""A worker's error file: written whole by the bootstrap, and never the agent's undoing.

The agent reads a failed worker's error file through torch's ``ProcessFailure``, which
raises on a file it cannot parse. A script's own ``@record`` writes that file in place, and
a SIGKILL can end the write halfway; an agent that crashed on it took its node down with
the worker (seen in ``elastic local`` under load: ``JSONDecodeError`` after a freeze).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

from agent.worker.worker_boot import record_error
from elastic import contract, failure_record
from elastic.contract import FailureKind
from agent.node.workers import COLD, LocalWorkers, Worker, _Warm


@pytest.mark.slow  # starts a process (a real one that failed, no torch)
@pytest.mark.parametrize("torn", ["", '{"message": {"mess'])
def test_a_torn_error_file_is_reported_as_the_exit_code_alone(torn: str, tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    error_file.write_text(torn)  # a script's own @record, cut off
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    proc.wait(timeout=30)
    workers = LocalWorkers(DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    workers.workers[0] = Worker(0, _Warm(proc), COLD, str(error_file))
    (failure,) = workers.failures().values()  # torch's ProcessFailure raised here on such a file
    assert (failure.pid, failure.exitcode) == (proc.pid, 3)


def test_the_bootstrap_writes_the_error_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise RuntimeError("Connection closed by peer")
    except RuntimeError as exc:
        record_error(exc)
    data = json.loads(error_file.read_text())
    assert data["message"]["message"] == "RuntimeError: Connection closed by peer"
    assert os.listdir(tmp_path) == ["error.json"]  # renamed into place: no temporary left beside it
    # raised here, by the script, not by torch: its own error, whatever it says
    assert failure_record.read(str(error_file)) == ("RuntimeError: Connection closed by peer", FailureKind.USER)


def test_a_scripts_own_record_keeps_its_words_and_gains_the_kind(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    words = {"message": {"message": "ValueError: its own words", "extraInfo": {"py_callstack": "..."}}}
    error_file.write_text(json.dumps(words))  # torch's @record wrote it before the bootstrap saw the error
    try:
        raise ValueError("ignored")
    except ValueError as exc:
        record_error(exc)
    data = json.loads(error_file.read_text())
    assert data["message"]["message"] == "ValueError: its own words"
    assert data["message"]["extraInfo"][contract.FAILURE_KIND_KEY] == "user"
    assert failure_record.read(str(error_file)) == ("ValueError: its own words", FailureKind.USER)
    error_file.write_text(json.dumps({"message": {"message": "x", "extraInfo": {contract.FAILURE_KIND_KEY: "new"}}}))
    assert failure_record.read(str(error_file)) == ("x", None)  # a kind this build does not know: the script's


@pytest.mark.slow  # starts a process (a sleeping one, no torch)
def test_stopping_a_worker_forked_a_moment_ago_reaches_it_before_it_has_its_own_session(tmp_path: Path) -> None:
    """A warm worker is stopped by its session, which the forked child makes itself just
    after the template has said "started". A round that changed at once under load sent
    SIGKILL to a session that did not exist yet; the worker lived on, unseen, and joined a
    later round in place. Here a child still in our process group plays that worker."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert os.getpgid(proc.pid) != proc.pid  # no session of its own yet
        workers = LocalWorkers(DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
        workers.workers[0] = Worker(0, _Warm(proc), "warm", str(tmp_path / "error.json"))
        workers.stop(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
