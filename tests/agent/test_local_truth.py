"""``elastic local`` tells the truth about a user's own script (issue 26).

One real run, as a new user makes it: a tutorial-style DDP script with a bug at step 3
(a NameError), two nodes, no terminal. Its user must see the crash (in the progress lines,
the summary, with the traceback's last line and the log's path), one line saying why the
job failed, a non-zero exit, and no node claiming the job finished. The script's relative
paths are the user's (it runs where ``elastic local`` was started), it is handed the run's
snapshot directory, and the rendezvous is signed, so no node warns that it is not.

A second run, of a script that reports its step, loss and samples through
``elastic.report_progress``, must show them: a loss and a samples/s figure in the view,
not the example jobs' alone.

The reading behind the crash count is checked on its own too, on the events an agent
writes and the lines its workers print: a worker that failed because its peer was killed
is not a crash of its node.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from agent.local.local_cluster import parse_args
from agent.local.local_faults import Cluster, ClusterNode
from agent.local.local_node import LocalNode, NodeLog
from agent.node.events import Event, GaveUp, HealthyAgain, NotJoining, Restarted, WorkersFailed
from agent.node.policy import SCRIPT_ERROR_WORDS
from agent.node.proctree import process_tree
from tests.support.agent_output import write_output
from tests.support.waiting import wait_until

RUN_TIMEOUT = 150
WRITTEN = "written-by-rank0.jsonl"  # the script's own relative path

SCRIPT = textwrap.dedent('''\
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        with open("written-by-rank0.jsonl", "a") as f:
            f.write(json.dumps({"cwd": os.getcwd(), "snapshot_dir": os.environ.get("ELASTIC_SNAPSHOT_DIR")}) + "\\n")
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(int(sys.argv[1])):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if step == int(sys.argv[2]):  # right after the step's all-reduce, which both ranks leave together
            undefined_name  # a bug, as in a tutorial edited in a hurry
        optimizer.step()
        time.sleep(0.05)
    dist.destroy_process_group()
''')


REPORTING = textwrap.dedent('''\
    import sys, time
    import elastic  # no torch: the heartbeat is all elastic local reads

    for step in range(int(sys.argv[1])):
        time.sleep(0.02)
        elastic.report_progress(step, loss=1.0 / (step + 1), samples=8)
''')


def _started_at(pid: int) -> str | None:
    """A live process' start time, which tells it from a later reuse of its pid; None once gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else fields[19]


class LocalProcess:
    """``elastic local`` as a subprocess with no terminal; every process of its tree is
    remembered by pid (and start time) while it runs, so none outlives the test."""

    def __init__(self, args: list[str], cwd: Path, out: Path) -> None:
        self.out = out
        with open(out, "wb") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "agent.cli", "local", *args], cwd=cwd, stdout=sink, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                                    "COLUMNS": "160"})  # a table row per line
        self.seen: dict[int, str] = {}

    def exited(self) -> bool:
        for pid in process_tree(self.process.pid):
            started = _started_at(pid)
            if started is not None:
                self.seen.setdefault(pid, started)
        return self.process.poll() is not None

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def stop(self) -> None:
        """Ctrl-C if it still runs, then SIGKILL by pid whatever of its tree is left."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for pid, started in self.seen.items():
            if _started_at(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.process.poll() is None:
            self.process.wait(timeout=10)


@dataclass(frozen=True)
class Outcome:
    code: int
    output: str
    user_dir: Path
    run_dir: Path

    def node_logs(self) -> dict[str, str]:
        return {p.name: p.read_text(errors="replace") for p in sorted(self.run_dir.glob("node-*.log"))}

    def explain(self) -> str:
        tails = [f"--- {name} ---\n" + "\n".join(text.splitlines()[-25:]) for name, text in self.node_logs().items()]
        return "\n".join([self.output[-4000:], *tails])


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    """``cd project && elastic local --nodes 2 train.py 400 120`` with a bug at step 120 (about 7 s
    in: a status line or two first)."""
    root = tmp_path_factory.mktemp("truth")
    user_dir, run_dir = root / "project", root / "run"
    user_dir.mkdir()
    (user_dir / "train.py").write_text(SCRIPT)
    local = LocalProcess(["--nodes", "2", "--faults", "0", "--max-restarts", "1", "--lease-ttl", "2",
                          "--run-dir", str(run_dir), "train.py", "400", "120"], user_dir, root / "local.out")
    try:
        wait_until(local.exited, RUN_TIMEOUT, "elastic local to end the failed job", interval=0.2,
                   on_timeout=lambda: Outcome(-1, local.output(), user_dir, run_dir).explain())
        yield Outcome(local.process.returncode, local.output(), user_dir, run_dir)
    finally:
        local.stop()


@pytest.mark.slow  # starts elastic local
def test_a_crashing_script_ends_elastic_local_with_the_crash_shown_and_one_line_why(crashed: Outcome) -> None:
    out = crashed.output
    assert crashed.code == 1, crashed.explain()
    error = "NameError: name 'undefined_name' is not defined"
    assert re.search(r"│ +1 │ crash +│ node-\d", out), out  # the summary's row
    details = [line for line in out.splitlines() if re.match(r"#[\d, #]+ node-\d: worker ", line)]
    assert details and all(error in line and str(crashed.run_dir / "node-") in line for line in details), out
    why = [line for line in out.splitlines() if line.startswith("the job failed")]
    # the same error on both nodes is the script's: the job ends at its first crash (agent.node.policy)
    assert len(why) == 1 and error in why[0] and "with the same error, the script's own" in why[0], out
    assert out.rstrip().splitlines()[-1] == why[0]  # the last word
    assert "finished" not in out, out
    for name, text in crashed.node_logs().items():
        assert "finished" not in text, f"{name} says the failed job finished:\n{text[-3000:]}"


@pytest.mark.slow  # starts elastic local
def test_a_relative_path_of_the_script_is_where_elastic_local_was_started(crashed: Outcome) -> None:
    written = crashed.user_dir / WRITTEN
    assert written.exists(), crashed.explain()
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert {r["cwd"] for r in rows} == {str(crashed.user_dir)}
    assert not (crashed.run_dir / WRITTEN).exists()
    tool_written = {"etcd", "etcd.log", "snapshots", "rdzv.key", "node-0.log", "node-1.log", "node-0.agent",
                    "node-1.agent"}
    assert {p.name for p in crashed.run_dir.iterdir()} <= tool_written


@pytest.mark.slow  # starts elastic local
def test_every_worker_gets_the_runs_snapshot_directory(crashed: Outcome) -> None:
    rows = [json.loads(line) for line in (crashed.user_dir / WRITTEN).read_text().splitlines()]
    assert rows and {r["snapshot_dir"] for r in rows} == {str(crashed.run_dir / "snapshots")}


@pytest.mark.slow  # starts elastic local
def test_the_rendezvous_is_signed_with_a_key_only_its_owner_reads(crashed: Outcome) -> None:
    logs = crashed.node_logs()
    assert len(logs) == 2 and not [name for name, text in logs.items() if "NOT signed" in text], crashed.explain()
    key = crashed.run_dir / "rdzv.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


@pytest.mark.slow  # starts elastic local
def test_without_a_terminal_progress_is_printed_as_it_happens(crashed: Outcome) -> None:
    lines = [line for line in crashed.output.splitlines() if re.match(r"\[ *[\d.]+ s\] ", line)]
    assert any(re.search(r"; node-0 \S+.*; faults 0 \(recovered 0\), crashes \d", line) for line in lines), \
        crashed.output  # a status line, every few seconds
    # the crash, as it came: "worker exit 1" when its agent restarted it first, "worker crashed"
    # when both nodes failed at once and their agents gave up at that first crash
    assert any(re.search(r"worker (exit 1|crashed): NameError", line) for line in lines), crashed.output
    assert any("agent failed (exit 1)" in line for line in lines), crashed.output
    seconds = [float(re.match(r"\[ *([\d.]+) s\]", line)[1]) for line in lines]
    assert seconds == sorted(seconds) and seconds[0] < seconds[-1]


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    """``elastic local --nodes 2 report.py 100``: a script reporting loss and samples, to its end."""
    root = tmp_path_factory.mktemp("reported")
    user_dir, run_dir = root / "project", root / "run"
    user_dir.mkdir()
    (user_dir / "report.py").write_text(REPORTING)
    local = LocalProcess(["--nodes", "2", "--faults", "0", "--lease-ttl", "2", "--run-dir", str(run_dir),
                          "report.py", "100"], user_dir, root / "local.out")
    try:
        wait_until(local.exited, RUN_TIMEOUT, "elastic local to end the job", interval=0.2,
                   on_timeout=lambda: Outcome(-1, local.output(), user_dir, run_dir).explain())
        yield Outcome(local.process.returncode, local.output(), user_dir, run_dir)
    finally:
        local.stop()


@pytest.mark.slow  # starts elastic local
def test_a_script_that_reports_loss_and_samples_has_them_shown(reported: Outcome) -> None:
    out = reported.output
    assert reported.code == 0, reported.explain()
    # the final view: node | state | rank | world | step | samples/s | loss | faults | crashes
    rows = re.findall(r"│ (node-\d) +│ exited \(0\) +│ +\d+ │ +\d+ │ +(\d+) │ +(\d+) │ +([\d.]+) │", out)
    assert len(rows) == 2, out
    for _, step, rate, loss in rows:
        assert step == "99" and float(loss) == pytest.approx(0.01, abs=1e-4), out  # step 99's loss, 1/100
        assert 0 < int(rate) <= 8 / 0.02, out  # 8 samples a step, a step at most every 20 ms
    assert re.search(r"final step 99 in a world of \d, final loss 0\.01 \(first [\d.]+\)", out), out
    assert "until your script reports them" not in out, out


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        parse_args(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--first-fault-after", "default 10"), ("--fault-every", "default 20"),
                          ("--back-after", "default 15"), ("--lease-ttl", "default "), ("--max-restarts", "default 20"),
                          ("--timeout", "default: none")):
        assert re.search(re.escape(flag) + r" \S+ [^-]*" + re.escape(default), text), (flag, text)
    assert "ELASTIC_SNAPSHOT_DIR" in text and "elastic.report_progress(step)" in text


T0 = 1_767_348_000.0  # 2026-01-02 10:00:00 UTC: the events' clock


def _log(tmp_path: Path, *items: str | Event) -> NodeLog:
    path = tmp_path / "node-0.log"
    write_output(path, *items)
    return NodeLog(path)


TRACEBACK = ["Traceback (most recent call last):", '  File "train.py", line 19, in <module>', "    undefined_name",
             "NameError: name 'undefined_name' is not defined"]
GLOO = ["Traceback (most recent call last):", '  File "train.py", line 15, in <module>',
        "RuntimeError: [gloo] Connection closed by peer"]


def test_a_worker_failed_by_a_killed_peer_is_not_a_crash_of_its_node(tmp_path: Path) -> None:
    log = _log(tmp_path, *GLOO, WorkersFailed((0,), (1,), at=T0 + 1), Restarted("peer_lost", at=T0 + 2))
    assert log.read() == []


def test_a_crash_the_agent_restarted_for_and_the_one_it_gave_up_on(tmp_path: Path) -> None:
    log = _log(tmp_path, *TRACEBACK, WorkersFailed((0,), (1,), at=T0 + 1), Restarted("worker_failed", at=T0 + 2),
               *TRACEBACK, GaveUp("worker_failed", "no restarts left", at=T0 + 5))
    first, last = log.read()
    assert first.describe() == "worker exit 1: NameError: name 'undefined_name' is not defined"
    assert not first.gave_up and last.gave_up == "no restarts left" and last.at - first.at == 4


def test_a_crash_not_yet_told_apart_counts_once_its_agent_exits(tmp_path: Path) -> None:
    log = _log(tmp_path, WorkersFailed((0,), (-11,), at=T0 + 1))
    assert log.read() == []
    log.settle()
    assert [c.describe() for c in log.read()] == ["worker killed by SIGSEGV"]


def test_an_oom_kill_is_named_as_the_agent_named_it(tmp_path: Path) -> None:
    oom = ("killed by the OOM killer (SIGKILL; the cgroup's OOM kill count went from 0 to 1): give the job more "
           "memory or use less")
    log = _log(tmp_path, WorkersFailed((0,), (-9,), oom, at=T0 + 1), Restarted("worker_failed", at=T0 + 2))
    assert [c.describe() for c in log.read()] == [f"worker {oom}"]


def test_a_crash_loop_with_too_few_nodes_left_is_the_agent_giving_up(tmp_path: Path) -> None:
    """The crash-loop rule's last word names its cause at the end, so it starts with the verdict."""
    log = _log(tmp_path, *TRACEBACK, WorkersFailed((0,), (1,), at=T0 + 1),
               GaveUp("crash_loop", "crashed 3 times right after starting; without this node 1 of min 2 would remain; "
                      "the cause: NameError: name 'undefined_name' is not defined", at=T0 + 2))
    (crash,) = log.read()
    assert crash.gave_up.startswith("crashed 3 times right after starting")
    assert crash.describe() == "worker exit 1: NameError: name 'undefined_name' is not defined"


def test_the_job_wide_verdict_on_a_broken_script_is_the_why_though_a_peer_gave_up_a_moment_before(
        tmp_path: Path) -> None:
    """Both agents of a job whose script fails everywhere give up within moments. One whose
    restart raced its peer's crash runs out of restarts first and says only that; the line
    why names the other's verdict, which names the script (seen in a loaded whole-suite run)."""
    verdict = (f"the workers of every node (2) {SCRIPT_ERROR_WORDS} (no restart or keep-out can fix it): "
               "NameError: name 'undefined_name' is not defined")
    nodes = []
    for name, second, reason, why in (("node-0", 6, "script_error", f"{verdict}; the traceback: above"),
                                      ("node-1", 5, "worker_failed", "no restarts left")):
        node = LocalNode(name=name, endpoint="127.0.0.1:1", run_id="r", workdir=tmp_path)
        write_output(node.log_path, *TRACEBACK, GaveUp(reason, why, at=T0 + second), agent_dir=node.agent_dir)
        nodes.append(ClusterNode(node=node, exited=1))
    ok, why = Cluster(nodes, tmp_path, 1).outcome(None)
    assert not ok and why.startswith("the job failed: node-0 gave up") and SCRIPT_ERROR_WORDS in why, why
    ok, why = Cluster(nodes[1:], tmp_path, 1).outcome(None)  # alone, the earliest give-up is still the why
    assert not ok and why.startswith("the job failed: node-1 gave up (no restarts left)"), why


def test_a_node_kept_out_by_its_health_check_shows_why_not_starting(tmp_path: Path) -> None:
    """``elastic local``'s console named a node that a failed health check kept out "starting"
    until the timeout; it names the check, and the node is "starting" again once it passes."""
    node = LocalNode(name="node-1", endpoint="127.0.0.1:1", run_id="r", workdir=tmp_path)
    cluster = Cluster([ClusterNode(node=node)], tmp_path, 1)
    out = NotJoining("snapshot dir /nvme/ckpt: 0.2 GiB free, below the 1 GiB floor", 5.0, 1, at=T0 + 1)
    write_output(node.log_path, out, agent_dir=node.agent_dir)
    state = cluster.node_state(cluster.nodes[0])
    assert state == "kept out: snapshot dir /nvme/ckpt: 0.2 GiB free, below the 1 GiB floor", state
    write_output(node.log_path, HealthyAgain(6.0, at=T0 + 7), agent_dir=node.agent_dir)
    assert cluster.node_state(cluster.nodes[0]) == "starting"


def test_an_error_every_rank_hits_is_said_by_rank_0_alone_and_is_the_why(tmp_path: Path) -> None:
    """A usage error or a diverged training: rank 0 prints the one ``error:`` line and every
    worker exits 2. The node whose agent gave up first may be another rank's (silent), so the
    line why names the node whose workers said it, and its crash carries the line."""
    said = ("error: training diverged at step 33: its gradients are non-finite again after a recompute, with every "
            "replica's state finite and agreeing")
    gave_up = GaveUp("worker_failed", "local worker(s) [0] exited with code 2 (a usage error, which would come back "
                     "at every start); not restarting", (0,), (2,))
    nodes = []
    for name, second, lines in (("node-0", 5, []), ("node-1", 6, [said])):
        node = LocalNode(name=name, endpoint="127.0.0.1:1", run_id="r", workdir=tmp_path)
        write_output(node.log_path, *lines, dataclasses.replace(gave_up, at=T0 + second), agent_dir=node.agent_dir)
        nodes.append(ClusterNode(node=node, exited=2))
    (crash,) = nodes[1].node.crashes()
    assert crash.describe() == f"worker exit 2: {said}", crash.describe()
    ok, why = Cluster(nodes, tmp_path, 1).outcome(None)
    assert not ok and why.startswith("the job failed: node-1 gave up") and said in why, why
