"""Each rank's own copy in its node agent's shared memory (elastic.inplace.memory_copies), and
the choice a restarted world makes between it and the snapshot: a pure function, and the
files as a restarted worker finds them (written, torn, of another run or world)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from agent.node.agent_dir import MEMORY_PREFIX, claim_memory_dir, release_memory_dir
from elastic.inplace.memory_copies import (NONE, OTHER_RUN, OTHER_WORLD, UNKNOWN_SNAPSHOT, USABLE, MemoryCopies, World,
                                           choose)
from elastic.inplace.peer_copies import _header, host_copy

WORLD = World("job-1", 4, 2, 2, (4,))


def _state(step: int) -> dict:
    return {"state": {"model": {"w": torch.full((3, 5), float(step)), "b": torch.arange(7, dtype=torch.bfloat16)},
                      "progress": {"step": step, "samples": 12 * step}, "rng": torch.zeros(0, dtype=torch.uint8),
                      "scalar": torch.tensor(2.5)},
            "recent": [[step, 0, 4, [1, 2, 3]]]}


def _write(copies: MemoryCopies, step: int, world: World = WORLD) -> None:
    payload, _ = host_copy(_state(step))
    copies.write(step, *_header(payload), world, round_=7)


def test_choose_memory_only_when_every_rank_holds_one_step_no_older_than_the_snapshot() -> None:
    assert choose([[USABLE, 9, 8], [USABLE, 9, 8]], snapshot_step=8) == (9, "")
    # a worker killed while writing step 9 still holds 8: the ranks share 8
    assert choose([[USABLE, 9, 8], [USABLE, 8, 7]], snapshot_step=8) == (8, "")
    assert choose([[USABLE, 9, -1], [USABLE, 9, -1]], snapshot_step=-1) == (9, "")
    step, why = choose([[USABLE, 7, 6], [USABLE, 7, 6]], snapshot_step=8)
    assert step is None and "older than snapshot step 8" in why
    step, why = choose([[USABLE, 9, 8], [NONE, -1, -1], [OTHER_WORLD, -1, -1]], snapshot_step=0)
    assert step is None and why == "rank(s) [1] hold no copy in memory; rank(s) [2] hold a copy of another world"
    step, why = choose([[USABLE, 9, -1], [USABLE, 5, -1]], snapshot_step=0)
    assert step is None and "different steps" in why
    assert choose([[OTHER_RUN, -1, -1]], 0)[1] == "rank(s) [0] hold a copy of another run"
    assert choose([[USABLE, 9, 8]], UNKNOWN_SNAPSHOT)[0] is None  # never chosen over a snapshot it cannot see


def test_a_copy_reads_back_equal_and_each_local_rank_keeps_at_most_two(tmp_path: Path) -> None:
    copies = MemoryCopies(tmp_path, local_rank=1)
    for step in (3, 4, 5):
        _write(copies, step)
    assert copies.steps() == [5, 4]  # the one before the newest kept: a rank killed mid-write still has it
    assert copies.held(WORLD) == (USABLE, [5, 4])
    back = copies.read(5)
    want = _state(5)
    for key in ("w", "b"):
        assert torch.equal(back["state"]["model"][key], want["state"]["model"][key])
    assert back["state"]["model"]["b"].dtype == torch.bfloat16
    assert torch.equal(back["state"]["scalar"], want["state"]["scalar"])
    assert back["state"]["progress"] == {"step": 5, "samples": 60} and back["recent"] == want["recent"]
    assert MemoryCopies(tmp_path, local_rank=0).steps() == []  # another local rank's files are not its own
    assert copies.in_place("job-1") == [(5, 4, 2, 7), (4, 4, 2, 7)]


def test_a_torn_write_is_never_read_and_copies_of_another_run_or_world_are_refused(tmp_path: Path) -> None:
    copies = MemoryCopies(tmp_path, local_rank=0)
    _write(copies, 6)
    (tmp_path / ".rank-0.step-000000000007.copy.123.tmp").write_bytes(b"half a copy")  # killed mid-write
    assert copies.steps() == [6]
    _write(copies, 7)  # the next write clears what its killed predecessor left
    assert not list(tmp_path.glob(".*.tmp")) and copies.steps() == [7, 6]
    assert copies.held(World("job-2", 4, 2, 2, (4,)))[0] == OTHER_RUN
    assert copies.held(World("job-1", 6, 2, 2, (6,)))[0] == OTHER_WORLD
    assert copies.held(World("job-1", 4, 3, 2, (4,)))[0] == OTHER_WORLD  # another rank's shards
    assert copies.in_place("job-2") == []
    empty = MemoryCopies(tmp_path / "none", local_rank=0)
    assert empty.held(WORLD) == (NONE, [])


def test_a_full_directory_turns_the_copies_off_in_one_line_and_the_job_goes_on(tmp_path: Path, caplog) -> None:
    copies = MemoryCopies(tmp_path / "missing", local_rank=0)
    _write(copies, 1)
    assert copies.off_reason is not None and copies.steps() == []
    assert "memory copies off" in caplog.text and "loads the newest snapshot instead" in caplog.text


def test_from_env_is_the_agents_directory_and_nothing_without_it(tmp_path: Path) -> None:
    assert MemoryCopies.from_env({}) is None
    copies = MemoryCopies.from_env({"ELASTIC_MEMORY_COPY_DIR": str(tmp_path), "LOCAL_RANK": "3"})
    assert copies is not None and copies.directory == tmp_path and copies.local_rank == 3


def test_the_agent_makes_its_memory_directory_removes_it_and_sweeps_one_a_killed_agent_left(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it: an agent gone
    orphan = shm / f"{MEMORY_PREFIX}{dead}-x"
    orphan.mkdir()
    (orphan / "rank-0.step-000000000001.copy").write_bytes(b"x")
    live = shm / f"{MEMORY_PREFIX}{os.getppid()}-y"  # a live agent's: never touched
    live.mkdir()
    made = claim_memory_dir(tmp_path / "agent", shm=shm)
    assert made is not None and made.parent == shm and made.name.startswith(f"{MEMORY_PREFIX}{os.getpid()}-")
    assert not orphan.exists() and live.exists()
    assert (made.stat().st_mode & 0o777) == 0o700  # the node's other users do not read the job's state
    release_memory_dir(made)
    assert not made.exists()
    # no shared memory on the node: under the agent's own directory
    (tmp_path / "agent").mkdir()
    there = claim_memory_dir(tmp_path / "agent", shm=tmp_path / "no-shm")
    assert there is not None and there.parent == tmp_path / "agent"
