"""The network-namespace harness: real namespaces, real faults, checked with TCP probes.

Every fault is checked to cut exactly what it says, in both directions, with a bounded
TCP connect from the side that should (or should not) get through, and to be undone by
``heal``. Needs root and ``ip netns``; skips with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from typing import Any, Callable

import pytest

from agent.etcd import free_port
from tests.support.netns import NodeNetwork, listening, sweep
from tests.support.waiting import wait_until

Build = Callable[..., NodeNetwork]
OUTSIDE = "198.51.100.1"  # TEST-NET-2: an address outside every harness subnet


def ip_json(*args: str) -> list[dict[str, Any]]:
    return json.loads(subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True).stdout or "[]")


def reach(net: NodeNetwork, src: str | None, dst: str | None, port: int) -> bool:
    host = net[dst].addr if dst is not None else net.central_addr
    return net.probe(src, host, port, timeout=1.0).ok


def reachability(net: NodeNetwork, port: int) -> dict[tuple[str, str], bool]:
    """Who reaches whom right now: ("a", "central") -> True, ..."""
    places = [None, *(ns.node for ns in net)]
    return {(s or "central", d or "central"): reach(net, s, d, port)
            for s in places for d in places if s != d}


def all_reach(net: NodeNetwork, port: int) -> bool:
    return all(reachability(net, port).values())


def leftovers(tag: str) -> list[str]:
    links = [link["ifname"] for link in ip_json("link", "show")]
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [name for name in [*links, *spaces] if name.startswith(tag)]


def test_each_node_has_its_own_address_lo_up_and_no_way_off_the_bridge(node_network: Build) -> None:
    net = node_network(["a", "b"])
    assert net.subnet is not None and net.subnet.subnet_of(net.pool)
    for ns in net:
        addrs = {a["ifname"]: [i["local"] for i in a["addr_info"]]
                 for a in ip_json("-n", ns.name, "addr", "show")}
        assert addrs == {"lo": ["127.0.0.1", "::1"], "eth0": [ns.addr]}  # IPv4 only on the wire
        routes = ip_json("-n", ns.name, "route", "show", "table", "all")
        assert not [r for r in routes if r.get("dst") == "default"], routes
        # nothing outside the /24 is routable: the connect fails at once, no packet leaves
        assert net.probe(ns.node, OUTSIDE, 80).error.startswith("OSError: [Errno 101]")
    assert len({ns.addr for ns in net} | {net.central_addr}) == 3
    with listening(net, free_port(net.central_addr)) as listeners:
        assert all_reach(net, listeners[None].port)


def test_a_full_partition_cuts_the_node_off_both_ways_until_healed(node_network: Build) -> None:
    net = node_network(["a", "b"])
    with listening(net, free_port(net.central_addr)) as listeners:
        port = listeners[None].port
        net.partition("b")
        assert net.faults("b") == ["partition"]
        assert reachability(net, port) == {
            ("central", "a"): True, ("central", "b"): False, ("a", "central"): True,
            ("a", "b"): False, ("b", "central"): False, ("b", "a"): False,
        }
        net.heal("b")
        assert net.faults("b") == []
        wait_until(lambda: all_reach(net, port), 20, "every place to reach every other after healing")


def test_cut_from_peers_keeps_central_and_cut_from_central_keeps_peers(node_network: Build) -> None:
    net = node_network(["a", "b", "c"])
    with listening(net, free_port(net.central_addr)) as listeners:
        port = listeners[None].port
        net.cut_from_peers("b")
        seen = reachability(net, port)
        assert [k for k, ok in seen.items() if not ok] == [("a", "b"), ("b", "a"), ("b", "c"), ("c", "b")], seen
        # the cut node's own connects fail at once (blackhole: EINVAL); its peers' time out
        assert net.probe("b", net["a"].addr, port).error == "OSError: [Errno 22] Invalid argument"
        assert net.probe("a", net["b"].addr, port).error == "TimeoutError"
        net.heal("b")
        wait_until(lambda: all_reach(net, port), 20, "every place to reach every other after healing")

        net.cut_from_central("b")
        seen = reachability(net, port)
        assert [k for k, ok in seen.items() if not ok] == [("central", "b"), ("b", "central")], seen
        net.heal("b")
        wait_until(lambda: all_reach(net, port), 20, "every place to reach every other after healing")


def test_an_established_connection_hangs_through_a_partition_and_resumes_after_it(node_network: Build) -> None:
    """What a process on a cut-off node sees: no error, only silence, then the data."""
    net = node_network(["a"])
    echo = net.popen("a", [sys.executable, "-c", ECHO, net["a"].addr, "7000", "60"])
    try:
        wait_until(lambda: net.probe(None, net["a"].addr, 7000).ok, 30, "the echo server in a")
        with socket.create_connection((net["a"].addr, 7000), timeout=5) as conn:
            conn.sendall(b"1")
            assert conn.recv(1) == b"1"
            net.partition("a")
            conn.settimeout(1.5)
            conn.sendall(b"2")  # buffered: a send does not fail
            with pytest.raises(TimeoutError):  # and a receive does not error, it waits
                conn.recv(1)
            net.heal("a")
            conn.settimeout(20)  # TCP delivers at its next retransmission
            assert conn.recv(1) == b"2"
    finally:
        echo.kill()
        echo.wait(timeout=10)


ECHO = """
import socket, sys, time
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:  # one connection at a time (the readiness probe's, then the test's)
    srv.settimeout(deadline - time.monotonic())
    conn, _ = srv.accept()
    conn.settimeout(max(0.1, deadline - time.monotonic()))
    while (data := conn.recv(64)):
        conn.sendall(data)
"""


def test_a_command_inside_a_namespace_keeps_its_own_pid(node_network: Build) -> None:
    net = node_network(["a"])
    code = "import os; print(os.getpid(), os.readlink('/proc/self/ns/net'))"
    proc = net.popen("a", [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    pid, netns = out.split()
    assert int(pid) == proc.pid  # `ip netns exec` execs: SIGKILL of this pid is node loss
    assert netns != os.readlink("/proc/self/ns/net")


def test_close_kills_what_runs_inside_and_removes_everything(node_network: Build) -> None:
    net = node_network(["a", "b"])
    sleeper = net.popen("b", [sys.executable, "-c", "import time; time.sleep(60)"])
    assert leftovers(net.names.tag)
    net.close()
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert leftovers(net.names.tag) == []
    assert not [r for r in ip_json("-4", "route", "show") if str(r.get("dst", "")).startswith(str(net.subnet))]


def test_two_harnesses_coexist_on_separate_subnets_that_cannot_reach_each_other(node_network: Build) -> None:
    one, two = node_network(["a"]), node_network(["a"])
    assert one.subnet is not None and two.subnet is not None
    assert not one.subnet.overlaps(two.subnet)
    assert one.probe("a", two["a"].addr, 80).error.startswith("OSError: [Errno 101]")


# The owner gets SIGINT as from a terminal's Ctrl-C (Python's KeyboardInterrupt). Without the
# first line it would inherit SIGINT *ignored* whenever the suite itself runs as a background
# job of a non-interactive shell (`make test &`, nohup), and ignore the test's Ctrl-C.
OWNER = """
import signal; signal.signal(signal.SIGINT, signal.default_int_handler)
import sys, time
from agent.local.netns import NodeNetwork
net = NodeNetwork(["a", "b"]).start()
print(net.names.tag, flush=True)
time.sleep(60)
"""


def start_owner() -> tuple[subprocess.Popen[str], str]:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    tag = owner.stdout.readline().strip()
    assert tag and len(leftovers(tag)) == 5, (tag, leftovers(tag))  # bridge, 2 veths, 2 namespaces
    return owner, tag


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_owner_stopped_by_a_signal_cleans_up_on_its_way_out(node_network: Build, sig: int) -> None:
    owner, tag = start_owner()
    try:
        owner.send_signal(sig)
        owner.wait(timeout=30)
        assert leftovers(tag) == []
    finally:
        owner.kill()
        owner.wait(timeout=10)


def test_leftovers_of_a_sigkilled_owner_are_swept_by_the_next_run(node_network: Build) -> None:
    owner, tag = start_owner()
    owner.kill()
    owner.wait(timeout=10)
    assert leftovers(tag)  # nothing ran to clean up
    mine = node_network(["a"])  # a live harness's objects must survive the sweep
    assert leftovers(tag) == []  # start() swept them
    assert sweep() == []
    assert len(leftovers(mine.names.tag)) == 3
