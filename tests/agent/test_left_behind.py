"""A worker that never leaves a world its round replaced is restarted by its agent, not waited for.

Three nodes (``--nnodes 2:3``), one rank each, train in place. Node b's script then waits for
ever on a FIFO of its own (idle, in a wait no fence covers), and node c's whole process tree
is SIGKILLed. The round that leaves c out replaces b's world: a's worker leaves it at once,
b's cannot. Before, a's join of the new round waited for b's handle for ever while every
agent looked healthy (the whole suite's HSDP 3-node flake). Now b's worker writes its stacks
and one line once the bound has passed idle (:mod:`elastic.inplace.left_behind`), exits, and
its agent starts it again in place: a and b train on in a world of 2, a's worker in its own
process, no step rolled back, every sample once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from elastic import contract
from elastic.inplace.left_behind import FLOOR_S
from tests.agent.test_spares import DATASET
from tests.elastic.inplace.support import at_world, logs, rows, start_script, train_together
from tests.elastic.inplace.test_user_code import assert_trained_once, assert_went_on_from_where_it_stood
from tests.support import agent_job
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until


@pytest.mark.slow
def test_a_worker_wedged_outside_any_collective_when_a_node_dies_is_restarted_and_the_job_goes_on(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = agent_job.write_to(tmp_path / "job.py")
    wedge = tmp_path / "wedge"
    a, b, c = (start_script(nodes, name, etcd_server, run_id, tmp_path, script, nnodes="2:3",
                            env={"DATASET": str(DATASET), "WEDGE_MARKER": str(wedge)}) for name in ("a", "b", "c"))
    every_log = logs(a, b, c)
    train_together([a, b, c], tmp_path, 3, steps=6)
    kept = {r["pid"] for r in rows(a, tmp_path)}
    wedged_pid = rows(b, tmp_path)[-1]["pid"]
    Path(f"{wedge}.arm").touch()
    wait_until(wedge.exists, 60, "b's script to wedge", on_timeout=every_log)
    wedged_at = time.time()
    c.kill()  # its whole tree, SIGKILL

    train_together([a, b], tmp_path, 2, steps=6, after=wedged_at, timeout=FLOOR_S + 60)
    back_at = at_world(b, tmp_path, 2, wedged_at)[0]["time"]
    text = b.log_path.read_text()
    said = next((line for line in text.splitlines() if "did not leave round" in line), "")
    assert "exiting for the agent to restart it in place" in said, every_log()
    # its stacks came first, and they name where the script waited (the FIFO's open)
    dump = text[:text.index(said)]
    assert "most recent call first" in dump and f'File "{script}"' in dump, b.log_tail(80)
    print(f"\n{said}\nwedged to training again in a world of 2: {back_at - wedged_at:.1f} s")

    assert {r["pid"] for r in rows(a, tmp_path)} == kept, "a's worker was restarted"
    assert wedged_pid not in {r["pid"] for r in at_world(b, tmp_path, 2, wedged_at)}, "b's worker still the wedged one"
    restarted = f"local worker(s) [0] failed (exit {contract.LEFT_BEHIND_EXIT})"
    assert restarted in text and "starting local rank(s) [0] again" in text, b.log_tail(80)
    assert_went_on_from_where_it_stood(a, tmp_path, wedged_at, 2)
    assert_trained_once(tmp_path)
