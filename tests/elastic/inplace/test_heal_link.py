"""A heal over the interface the operator names (``ELASTIC_HEAL_IFNAME``), between two real
processes on loopback: the state arrives whole over a gloo group of its own, bound there.

That the bytes really cross the named link, and only there, is the namespaced test's
(``tests/agent/test_heal_network.py``); this one is the wire itself, in seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic.inplace import heal_link
from elastic.inplace.transfer import recv_state

PEER = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from elastic.inplace.heal_link import open_wire
    from elastic.inplace.transfer import send_state
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=60))
    wire = open_wire({2: 0}, 0, torch.device("cpu"), "gloo", store, "7", timedelta(seconds=60))
    state = {"w": torch.arange(300000, dtype=torch.float32), "b": torch.ones(3), "step": 41, "t": ("x", 1)}
    print(send_state(state, 2, torch.device("cpu"), wire), flush=True)
    wire.close()
""")


@pytest.mark.slow  # starts the sending process
def test_the_state_arrives_whole_over_a_group_bound_to_the_named_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_HEAL_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    sender = subprocess.Popen([sys.executable, "-c", PEER, str(store.port)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        wire = heal_link.open_wire({2: 0}, 2, torch.device("cpu"), "gloo", store, "7",
                                   timedelta(seconds=60))
        assert isinstance(wire, heal_link.InterfaceWire) and wire.over == "over lo"
        got = recv_state(0, torch.device("cpu"), wire)
        wire.close()
        out, _ = sender.communicate(timeout=60)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
    assert sender.returncode == 0
    assert got["step"] == 41 and got["t"] == ("x", 1) and got["b"].tolist() == [1.0, 1.0, 1.0]
    assert torch.equal(got["w"], torch.arange(300000, dtype=torch.float32))
    assert int(out) == 300000 * 4 + 3 * 4


def test_without_the_setting_a_heal_rides_the_worlds_own_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTIC_HEAL_IFNAME", raising=False)
    wire = heal_link.open_wire({1: 0}, 0, torch.device("cpu"), "gloo", None, "1", timedelta(seconds=5))
    assert isinstance(wire, heal_link.GroupWire)
    assert heal_link.collectives_link("gloo", {"GLOO_SOCKET_IFNAME": "eth0"}) == "over gloo (eth0)"
    assert heal_link.collectives_link("gloo", {}) == "over gloo (the host name's address)"
    assert heal_link.collectives_link("nccl", {}) == "over nccl"
    monkeypatch.setenv("ELASTIC_HEAL_IFNAME", "lo")  # a rank with no part in the heal opens nothing
    assert isinstance(heal_link.open_wire({1: 0}, 3, torch.device("cpu"), "gloo", None, "1",
                                          timedelta(seconds=5)), heal_link.GroupWire)
