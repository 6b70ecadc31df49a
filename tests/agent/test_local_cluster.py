"""``elastic local``'s pure decisions: each worker's share of the machine's cores."""

from __future__ import annotations

import signal
import types
from pathlib import Path

import pytest

from agent.local.local_cluster import _job, _nodes, _verdict, parse_args, stop_reason, threads_per_worker


@pytest.mark.parametrize(("workers", "cores", "threads"), [
    (3, 2, 1),    # the demo on a 2-core machine: one each, not two spinning against each other
    (3, 16, 5),   # what is left over stays idle rather than oversubscribed
    (2, 16, 8),
    (1, 8, 8),    # one worker: torch's own default
    (4, None, 1),  # os.cpu_count() may not know
])
def test_each_worker_gets_its_share_of_the_cores(workers: int, cores: int | None, threads: int) -> None:
    assert threads_per_worker(workers, cores) == threads


def test_every_node_hands_its_workers_that_share_unless_the_user_set_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args, job_args = parse_args(["--nodes", "3", "--nproc-per-node", "2", "--run-dir", str(tmp_path)])
    job, _ = _job(args, job_args, tmp_path)
    etcd = types.SimpleNamespace(endpoint="127.0.0.1:2379")  # only its address is read; nothing starts here
    monkeypatch.setattr("os.cpu_count", lambda: 12)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    nodes = _nodes(args, job, tmp_path, etcd, None, tmp_path / "key")
    assert [n.node.env["OMP_NUM_THREADS"] for n in nodes] == ["2", "2", "2"]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    nodes = _nodes(args, job, tmp_path, etcd, None, tmp_path / "key")
    assert all("OMP_NUM_THREADS" not in n.node.env for n in nodes)  # the user's own reaches the workers as is


@pytest.mark.parametrize(("flags", "said"), [
    (["--faults", "-1"], "--faults -1: give 0 or more"),
    (["--fault-every", "-3"], "--fault-every -3: give 0 or more seconds"),
    (["--back-after", "-1"], "--back-after -1: give 0 or more seconds"),
    (["--first-fault-after", "nan"], "--first-fault-after nan"),
    (["--steps", "0"], "--steps 0: give 1 or more"),
    (["--lease-ttl", "0"], "--lease-ttl 0: give at least 2"),
    (["--nproc-per-node", "0"], "--nproc-per-node 0: give 1 or more workers"),
])
def test_a_value_that_means_nothing_is_refused_up_front_with_one_error_line(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_args(flags)  # refused before any etcd or node could start
    assert stopped.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("elastic local: error:")]
    assert len(errors) == 1 and said in errors[0], errors


@pytest.mark.parametrize(("chaos", "said"), [
    ("kill,,freeze", "--chaos kill,,freeze: an empty entry"),  # accepted before: the missing kind never ran
    ("kill,", "--chaos kill,: an empty entry"),
    (",", "--chaos ,: an empty entry"),
    ("", "--chaos '': an empty entry"),
    ("kill,boom", "--chaos kill,boom: unknown kind 'boom'"),
    ("Kill,frezee", "--chaos Kill,frezee: unknown kinds 'Kill', 'frezee'"),
])
def test_a_chaos_list_with_an_empty_or_unknown_entry_is_one_line_exit_2(
    chaos: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--chaos", chaos])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {said}") and "kill, freeze" in err, err


def test_a_chaos_list_may_have_spaces_after_its_commas() -> None:
    args, _ = parse_args(["--chaos", "kill, freeze"])
    assert args.kinds == ["kill", "freeze"]


def test_zero_faults_and_zero_seconds_are_still_values() -> None:
    args, _ = parse_args(["--faults", "0", "--fault-every", "0", "--back-after", "0", "--steps", "1"])
    assert (args.faults, args.fault_every, args.back_after, args.steps) == (0, 0, 0, 1)


@pytest.mark.parametrize(("why", "timeout", "signum", "said", "code"), [
    ("signal", None, signal.SIGINT, "Ctrl-C", 130),
    ("signal", None, signal.SIGTERM, "SIGTERM", 143),
    ("signal", None, signal.SIGHUP, "SIGHUP", 129),
    ("q", None, None, "q", 1),
    ("timeout", 30.0, None, "--timeout 30 s", 1),
])
def test_a_stop_says_why_with_the_shells_code_and_no_timeout_needed(
    why: str, timeout: float | None, signum: int | None, said: str, code: int
) -> None:
    from rich.console import Console

    args, _ = parse_args(["--steps", "10"] + (["--timeout", f"{timeout:g}"] if timeout else []))
    console = Console(record=True, width=120)
    assert _verdict(console, None, args, why, True, signum) == code
    assert f"stopped before step 10 ({said})" in console.export_text()
    assert stop_reason(why, timeout, signum) == said
