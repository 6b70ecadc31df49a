"""Bad input to ``elastic agent`` and ``elastic etcd``: one ``error:`` line, exit 2, nothing
started and nothing of the user's deleted; and the agent's own directories cleaned up.

Refusals run the real entry point (``agent.cli.main``) in this process: they end before
anything starts. What needs a running agent or etcd runs them as the ``elastic`` command.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from agent import cli
from agent.node.agent_dir import MARKER, RUNTIME, claim_agent_dir
from agent.tools.etcd_cmd import default_data_dir
from agent.node.launch import build_agent_parser
from agent.node.proctree import kill_tree
from agent.etcd import EmbeddedEtcd
from tests.support.waiting import wait_until

ELASTIC = [sys.executable, "-m", "agent.cli"]
RUN_ID_RULE = "letters, digits, '.', '_' or '-', not starting with '.'"


@pytest.fixture(autouse=True)
def no_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what a test sets: any ELASTIC_*/PET_* of the shell running pytest would mix in."""
    for name in list(os.environ):
        if name.startswith(("ELASTIC_", "PET_")):
            monkeypatch.delenv(name)


@pytest.fixture
def etcd_endpoint() -> Iterator[socket.socket]:
    """A listening socket standing in for etcd, to tell whether the agent connected."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``elastic ARGV``; assert exit 2 and one ``error:`` line, no traceback; return it."""
    try:
        code: object = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err and out == "", out + err  # nothing started, nothing else said
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def agent_refused(capsys: pytest.CaptureFixture[str], endpoint: socket.socket, tmp_path: Path, *flags: str) -> str:
    """``elastic agent FLAGS train.py`` is refused before it connects to etcd or makes its directory."""
    host, port = endpoint.getsockname()
    agent_dir = tmp_path / "agent"
    line = refused(capsys, "agent", "--rdzv-endpoint", f"{host}:{port}", "--agent-dir", str(agent_dir),
                   *flags, "train.py")
    assert not select.select([endpoint], [], [], 0)[0], "the agent connected to etcd"
    assert not agent_dir.exists(), "the agent started setting up"
    return line


NPROC = "must be a positive integer or one of auto, cpu, gpu, xpu"
BACKEND = "is not a registered rendezvous backend; use one of c10d, etcd, etcd-v2, etcd-v3, etcd-v3-dynamic, static"
RUN_ID = f"a run id names etcd keys and directories, so use 1-128 {RUN_ID_RULE}"


@pytest.mark.parametrize(("flags", "says"), [
    (["--nproc-per-node", "0"], f"--nproc-per-node 0: {NPROC}"),
    (["--nproc-per-node", "-1"], f"--nproc-per-node -1: {NPROC}"),
    (["--nproc-per-node", "abc"], f"--nproc-per-node abc: {NPROC}"),
    (["--max-restarts", "-1"], "--max-restarts -1: must be an integer >= 0"),
    (["--rdzv-backend", "etcd-v4"], f"--rdzv-backend etcd-v4: {BACKEND}"),
    (["--rdzv-id", "a/../b"], f"--rdzv-id a/../b: {RUN_ID}"),
    (["--rdzv-id", ""], f"--rdzv-id '': {RUN_ID}"),
    (["--rdzv-id", ".hidden"], f"--rdzv-id .hidden: {RUN_ID}"),
    (["--rdzv-id", "x" * 129], f"--rdzv-id {'x' * 129}: {RUN_ID}"),
    (["--lease-ttl", "1"], "--lease-ttl 1: is below etcd's minimum lease TTL of 2 s"),
    (["--metrics-port", "port"], "--metrics-port port: is not a port"),
    (["--keep-out-s", "0"], "--keep-out-s 0: must be positive seconds"),
    (["--metrics-port", "70000"], "--metrics-port 70000: is not a port"),
    (["--hang-timeout", "-3"], "--hang-timeout -3: must be positive seconds"),
    (["--snapshot-dir", "/proc/elastic-cannot-be-here"], "--snapshot-dir /proc/elastic-cannot-be-here"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag; see elastic agent --help"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_bad_flag_is_one_line_before_anything_starts(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str], etcd_endpoint: socket.socket, tmp_path: Path
) -> None:
    line = agent_refused(capsys, etcd_endpoint, tmp_path, *flags)
    assert line.startswith(f"error: {says}"), line


@pytest.mark.parametrize(("variable", "value", "says"), [
    ("ELASTIC_NPROC_PER_NODE", "0", f"ELASTIC_NPROC_PER_NODE=0: {NPROC}"),
    ("PET_NPROC_PER_NODE", "abc", f"PET_NPROC_PER_NODE=abc: {NPROC}"),
    ("ELASTIC_MAX_RESTARTS", "-1", "ELASTIC_MAX_RESTARTS=-1: must be an integer >= 0"),
    ("ELASTIC_RDZV_BACKEND", "etcd-v4", f"ELASTIC_RDZV_BACKEND=etcd-v4: {BACKEND}"),
    ("ELASTIC_RDZV_ID", "a/../b", f"ELASTIC_RDZV_ID=a/../b: {RUN_ID}"),
    ("PET_RDZV_ID", "", f"PET_RDZV_ID='': {RUN_ID}"),
])
def test_the_same_value_from_the_environment_is_refused_naming_the_variable(
    variable: str, value: str, says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    etcd_endpoint: socket.socket, tmp_path: Path
) -> None:
    monkeypatch.setenv(variable, value)
    line = agent_refused(capsys, etcd_endpoint, tmp_path)
    assert line.startswith(f"error: {says}"), line


def test_a_flag_given_wins_over_a_bad_value_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_NPROC_PER_NODE", "0")
    monkeypatch.setenv("ELASTIC_RDZV_ID", "a/../b")
    args = build_agent_parser().parse_args(["--nproc-per-node", "2", "--rdzv-id", "job-1", "train.py"])
    assert (args.nproc_per_node, args.rdzv_id) == ("2", "job-1")


@pytest.mark.parametrize("nproc", ["1", "8", "auto", "cpu", "gpu", "xpu"])
def test_torchruns_nproc_per_node_values_still_parse(nproc: str) -> None:
    assert build_agent_parser().parse_args(["--nproc-per-node", nproc, "train.py"]).nproc_per_node == nproc


@pytest.mark.parametrize("backend", ["etcd-v3", "etcd-v3-dynamic", "c10d", "etcd", "etcd-v2", "static"])
def test_every_registered_backend_still_parses(backend: str) -> None:
    assert build_agent_parser().parse_args(["--rdzv-backend", backend, "train.py"]).rdzv_backend == backend


@pytest.mark.parametrize("run_id", ["none", "resnet-prod-1", "run_1.2", "3760f84a-3614-4daa-9beb-75cc91d4387d", "r" * 128])
def test_run_ids_from_the_docs_and_torchrun_still_parse(run_id: str) -> None:
    assert build_agent_parser().parse_args(["--rdzv-id", run_id, "train.py"]).rdzv_id == run_id


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA GPU")
def test_nproc_per_node_gpu_without_a_gpu_is_one_line(
    capsys: pytest.CaptureFixture[str], etcd_endpoint: socket.socket, tmp_path: Path
) -> None:
    line = agent_refused(capsys, etcd_endpoint, tmp_path, "--nproc-per-node", "gpu")
    assert line.startswith("error: --nproc-per-node gpu: this node has no CUDA GPU"), line


# -- --agent-dir: the agent deletes only what it created ---------------------------------------------


def users_dir(path: Path) -> dict[str, str]:
    """A directory someone cares about, with folders named like the agent's run-time ones."""
    files = {"notes.txt": "mine", "control/plan.txt": "keep", "heartbeat/log.csv": "1,2",
             "goodput/report.md": "# q3"}
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return files


@pytest.mark.parametrize("given_as", ["flag", "env"])
def test_an_agent_dir_holding_someone_elses_files_is_refused_and_left_alone(
    given_as: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    etcd_endpoint: socket.socket
) -> None:
    mine = tmp_path / "mine"
    files = users_dir(mine)
    host, port = etcd_endpoint.getsockname()
    flags = ["--agent-dir", str(mine)] if given_as == "flag" else []
    if given_as == "env":
        monkeypatch.setenv("ELASTIC_AGENT_DIR", str(mine))
    line = refused(capsys, "agent", "--rdzv-endpoint", f"{host}:{port}", *flags, "train.py")
    assert line.startswith(f"error: --agent-dir {mine} holds files the agent did not create"), line
    assert "pass a new or empty directory" in line
    assert {str(p.relative_to(mine)): p.read_text() for p in mine.rglob("*") if p.is_file()} == files
    assert not (mine / MARKER).exists()
    assert not select.select([etcd_endpoint], [], [], 0)[0], "the agent connected to etcd"


def test_a_file_as_agent_dir_is_refused_and_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 etcd_endpoint: socket.socket) -> None:
    file = tmp_path / "status.json"
    file.write_text("{}")
    host, port = etcd_endpoint.getsockname()
    line = refused(capsys, "agent", "--rdzv-endpoint", f"{host}:{port}", "--agent-dir", str(file), "train.py")
    assert line == f"error: --agent-dir {file} is not a directory; pass a new or empty directory"
    assert file.read_text() == "{}"


def test_a_directory_an_earlier_agent_marked_has_only_its_run_time_folders_cleared(tmp_path: Path) -> None:
    first = claim_agent_dir(tmp_path / "agent")
    for folder in RUNTIME:
        (first.path / folder).mkdir()
        (first.path / folder / "stale").write_text("from the earlier agent")
    (first.path / "notes.txt").write_text("the user's, added later")
    again = claim_agent_dir(tmp_path / "agent")
    assert not again.temporary and (again.path / MARKER).is_file()
    assert not any((again.path / folder).exists() for folder in RUNTIME)
    assert (again.path / "notes.txt").read_text() == "the user's, added later"
    again.release()
    assert again.path.is_dir()  # a given directory stays


# -- the agent's temporary directory goes when the agent does ------------------------------------


SCRIPT = """\
import pathlib, sys, time
pathlib.Path(sys.argv[1]).write_text("started")
time.sleep(float(sys.argv[2]))
"""


def start_agent(tmp_path: Path, *flags: str, sleep: float = 0) -> tuple[subprocess.Popen[str], Path, Path]:
    """A one-node agent (``--standalone``: no etcd) whose worker writes ``started`` and sleeps."""
    tmp, started, script = tmp_path / "tmp", tmp_path / "started", tmp_path / "train.py"
    tmp.mkdir()
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_", "PET_"))}
    proc = subprocess.Popen(
        [*ELASTIC, "agent", "--standalone", "--no-warm-start", "--metrics-port", "0", "--monitor-interval", "0.1",
         *flags, str(script), str(started), str(sleep)],
        env={**env, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, tmp, started


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()


def agent_temp_dirs(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("elastic-agent-*"))


@pytest.mark.slow  # starts processes
def test_the_temporary_agent_dir_is_removed_after_a_clean_exit(tmp_path: Path) -> None:
    proc, tmp, started = start_agent(tmp_path)
    code, out = finish(proc)
    assert code == 0, out
    assert started.read_text() == "started"
    assert agent_temp_dirs(tmp) == [], out
    # nor anything else: torch's log directory (torchelastic_*) was the agent's too
    assert sorted(p.name for p in tmp.iterdir()) == [], out


@pytest.mark.slow  # starts processes
def test_the_temporary_agent_dir_is_removed_when_the_agent_is_stopped(tmp_path: Path) -> None:
    proc, tmp, started = start_agent(tmp_path, sleep=600)
    try:
        wait_until(lambda: started.exists(), 120, "the worker to start")
        assert len(agent_temp_dirs(tmp)) == 1  # the agent's, while it runs
        proc.send_signal(signal.SIGUSR1)  # stops nothing: the agent writes its threads' stacks
        proc.send_signal(signal.SIGTERM)
    finally:
        code, out = finish(proc, timeout=60)
    assert code == 128 + signal.SIGTERM, out
    assert agent_temp_dirs(tmp) == [], out
    assert "(most recent call first)" in out and "in _loop" in out, out  # the main thread, in the agent's loop


@pytest.mark.slow  # starts processes
def test_an_empty_agent_dir_is_adopted_and_kept(tmp_path: Path) -> None:
    given = tmp_path / "agent"
    given.mkdir()
    proc, tmp, _ = start_agent(tmp_path, "--agent-dir", str(given))
    code, out = finish(proc)
    assert code == 0, out
    assert (given / MARKER).is_file() and (given / "status.json").is_file()
    assert agent_temp_dirs(tmp) == []


# -- elastic etcd ---------------------------------------------------------------------------------


def test_etcd_data_dir_that_is_a_file_is_one_line_and_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "data"
    file.write_text("precious")
    line = refused(capsys, "etcd", "--data-dir", str(file), "--client-port", "0")
    assert line.startswith(f"error: --data-dir {file} is not a directory"), line
    assert file.read_text() == "precious"


def test_etcd_on_a_port_another_etcd_serves_is_one_line(
    etcd_server: EmbeddedEtcd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = etcd_server.client_port
    line = refused(capsys, "etcd", "--data-dir", str(tmp_path / "data"), "--client-port", str(port))
    assert line.startswith(f"error: --client-port {port} on 127.0.0.1: address already in use"), line
    assert "pick another --client-port" in line


def test_etcd_whose_peer_port_is_taken_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with held_port_after_a_free_one() as taken:
        peer = taken.getsockname()[1]
        line = refused(capsys, "etcd", "--data-dir", str(tmp_path / "data"), "--client-port", str(peer - 1))
    expected = f"error: --client-port {peer - 1}: its peer port {peer} on 127.0.0.1: address already in use"
    assert line.startswith(expected), line


def held_port_after_a_free_one() -> socket.socket:
    """A listening socket on port P where P - 1 is free: etcd's client port, then its peer port."""
    for _ in range(20):
        taken = socket.create_server(("127.0.0.1", 0))
        try:
            socket.create_server(("127.0.0.1", taken.getsockname()[1] - 1)).close()
            return taken
        except OSError:
            taken.close()
    raise AssertionError("no free port below a free port in 20 tries")


@pytest.mark.parametrize(("xdg", "expected"), [
    ("/srv/state", "/srv/state/elastic/etcd"),
    ("relative/state", "~/.local/state/elastic/etcd"),  # the XDG spec: ignore a relative path
    ("", "~/.local/state/elastic/etcd"),
])
def test_etcd_default_data_dir_is_absolute_and_per_user(xdg: str, expected: str) -> None:
    assert default_data_dir({"XDG_STATE_HOME": xdg}) == Path(expected).expanduser()


@pytest.mark.slow  # starts processes
def test_etcd_serves_from_its_default_data_dir_and_says_it_is_for_trials(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    proc = subprocess.Popen([*ELASTIC, "etcd", "--client-port", "0"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline()]  # the note first, then "etcd serving at" (after the version warning)
        while lines[-1] and "etcd serving at" not in lines[-1] and len(lines) < 5:
            lines.append(proc.stdout.readline())
        assert lines[0].startswith("note: elastic etcd is for trying the service on one machine, not for production")
        assert "etcd serving at" in lines[-1] and f"data in {tmp_path}/state/elastic/etcd" in lines[-1], lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
    assert (tmp_path / "state" / "elastic" / "etcd" / "data").is_dir()
    assert not (tmp_path / ".elastic-etcd").exists()  # nothing relative to where it was started


def test_torchs_backend_registry_is_still_where_the_check_reads_it() -> None:
    """The backend check reads torch's private registry and refuses nothing where it is
    gone; this fails loudly when a torch moves it, so the check does not vanish silently."""
    from agent.node.launch import _registered_backends

    assert {"etcd-v3", "etcd-v3-dynamic", "c10d"} <= set(_registered_backends()), (
        "torch.distributed.elastic.rendezvous.rendezvous_handler_registry._registry moved; "
        "update agent/node/launch.py's _registered_backends")
