"""Two plain gloo processes on two "hosts" (network namespaces): the classic failure, and its fix.

Nothing here uses ``elastic``: a bare ``torch.distributed`` script, rendezvousing through
a TCPStore on rank 0's address. Without ``GLOO_SOCKET_IFNAME`` each rank binds the address
its hostname resolves to, loopback here, and the all-reduce never connects
(``connectFullMesh ... remote=[127.0.0.1]``). With the value :mod:`agent.node.netif` computes
inside each namespace, exactly as the agent would on its node, the all-reduce succeeds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from tests.support.netns import NodeNetwork
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

PORT = 29500  # namespaces are fresh: any port is free in them
SCRIPT = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
rank, master, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=30))
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)
print("RESULT", x.item(), flush=True)
dist.destroy_process_group()
"""
DECIDE = """
import json, os, sys
from agent.node.netif import worker_env_for
updates, line = worker_env_for(sys.argv[1], None, "2", os.environ)  # the agent's own call
print(json.dumps(updates))
"""


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


def run_pair(net: NodeNetwork, script: Path, envs: dict[str, dict[str, str]], tmp: Path,
             until: Callable[[list[subprocess.Popen[bytes]]], bool], timeout: float) -> list[str]:
    """Start rank 0 in ``a`` and rank 1 in ``b``; return their outputs once ``until`` holds."""
    procs, logs = [], []
    try:
        for rank, node in enumerate(("a", "b")):
            logs.append(tmp / f"{script.stem}-{node}.log")
            with open(logs[-1], "wb") as out:
                procs.append(net.popen(node, [sys.executable, str(script), str(rank), net["a"].addr, str(PORT)],
                                       env=envs[node], stdout=out, stderr=subprocess.STDOUT))
        wait_until(lambda: until(procs), timeout, "the gloo pair",
                   on_timeout=lambda: "\n".join(p.read_text(errors="replace")[-2000:] for p in logs))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    return [p.read_text(errors="replace") for p in logs]


def test_gloo_across_namespaces_fails_on_loopback_and_works_with_the_computed_interface(
    node_network: Callable[..., NodeNetwork], tmp_path: Path
) -> None:
    net = node_network(["a", "b"])
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)

    # 1. Nothing set: the hostname resolves to loopback, so each rank advertises 127.0.0.1.
    outputs = run_pair(net, script, {"a": clean_env(), "b": clean_env()}, tmp_path,
                       until=lambda ps: any(p.poll() is not None for p in ps), timeout=240)
    joined = "\n".join(outputs)
    assert "connectFullMesh failed" in joined and "remote=[127.0.0.1]" in joined, joined[-3000:]
    assert "RESULT" not in joined

    # 2. Each node computes its own value, as the agent does before starting workers.
    envs = {}
    for node in ("a", "b"):
        done = subprocess.run(net[node].wrap([sys.executable, "-c", DECIDE, f"{net['a'].addr}:{PORT}"]),
                              env=clean_env(), capture_output=True, text=True, timeout=60, check=True)
        updates = json.loads(done.stdout)
        assert updates == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}, done
        envs[node] = {**clean_env(), **updates}
    outputs = run_pair(net, script, envs, tmp_path,
                       until=lambda ps: all(p.poll() is not None for p in ps), timeout=240)
    assert all("RESULT 3.0" in out for out in outputs), "\n".join(outputs)[-3000:]
