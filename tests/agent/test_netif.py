"""The workers' socket interface choice: the pure decision, the parsers, and look-ups here."""

from __future__ import annotations

import socket
import struct

import pytest

from agent.node.netif import (
    GLOO_IFNAME, NCCL_IFNAME, hostname_is_loopback, interface_of, ipv4_addresses, parse_if_inet6,
    parse_ifconf, route_source, socket_ifname_env, spans_nodes, worker_env_for, worker_socket_env,
)


def decide(env: dict[str, str] | None = None, addr: str | None = "10.0.0.5", many: bool = True,
           loopback: bool = True, ifname: str | None = "ens5") -> tuple[dict[str, str], str | None]:
    return socket_ifname_env(env or {}, addr, many, hostname_loopback=loopback, ifname=ifname)


def test_a_job_across_nodes_on_a_loopback_hostname_gets_the_interface_peers_reach() -> None:
    updates, line = decide()
    assert updates == {GLOO_IFNAME: "ens5", NCCL_IFNAME: "ens5"}
    assert line is not None and "ens5 (10.0.0.5)" in line and "loopback" in line


def test_a_variable_the_user_set_is_kept_and_the_other_is_filled_in() -> None:
    updates, line = decide({GLOO_IFNAME: "ib0"})
    assert updates == {NCCL_IFNAME: "ens5"}
    assert line is not None and "keeping the user's GLOO_SOCKET_IFNAME=ib0" in line
    assert decide({GLOO_IFNAME: "ib0", NCCL_IFNAME: "ib0"}) == ({}, None)


@pytest.mark.parametrize("case", [
    {"many": False},  # one node: loopback is right
    {"loopback": False},  # the hostname resolves to a routable address: gloo's own pick works
    {"addr": "127.0.0.1"},  # everything on one machine, reached over loopback
])
def test_nothing_changes_where_gloo_already_gets_it_right(case: dict[str, object]) -> None:
    assert decide(**case) == ({}, None)


def test_an_unknown_address_or_interface_is_one_line_naming_the_fix() -> None:
    updates, line = decide(addr=None)
    assert updates == {} and line is not None and "--local-addr" in line and GLOO_IFNAME in line
    updates, line = decide(ifname=None)
    assert updates == {} and line is not None and "no interface holds 10.0.0.5" in line


def test_nnodes_spans_nodes_when_its_maximum_exceeds_one() -> None:
    assert [spans_nodes(n) for n in ("1", "1:1", "2", "1:3", "bad")] == [False, False, True, True, True]


def test_parse_ifconf_reads_names_and_ipv4_addresses_and_drops_alias_labels() -> None:
    def ifreq(name: bytes, addr: str, family: int = socket.AF_INET) -> bytes:
        sockaddr = struct.pack("H", family) + b"\0\0" + socket.inet_aton(addr)
        return name.ljust(16, b"\0") + sockaddr.ljust(24, b"\0")

    data = ifreq(b"lo", "127.0.0.1") + ifreq(b"eth0:1", "10.1.2.3") + ifreq(b"x", "1.2.3.4", family=99)
    assert parse_ifconf(data) == [("lo", "127.0.0.1"), ("eth0", "10.1.2.3")]


def test_parse_if_inet6_reads_proc_format() -> None:
    text = ("fe80000000000000685998fffe732cb0 0d 40 20 80     eth0\n"
            "00000000000000000000000000000001 01 80 10 80       lo\n")
    assert parse_if_inet6(text) == [("eth0", "fe80::6859:98ff:fe73:2cb0"), ("lo", "::1")]


def test_lookups_on_this_machine() -> None:
    assert ("lo", "127.0.0.1") in ipv4_addresses()
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.254") is None  # TEST-NET-1: no interface here holds it
    assert route_source("127.0.0.1", 2379) == "127.0.0.1"  # a routing lookup, nothing is sent
    assert hostname_is_loopback("localhost")
    assert hostname_is_loopback("no-such-host.invalid")  # torch falls back to loopback too
    assert hostname_is_loopback("192.0.2.254")  # resolves, but no interface here holds it: loopback too


def test_worker_socket_env_looks_up_the_interface_of_a_routable_local_address() -> None:
    try:
        addr = route_source("192.0.2.1", 9)  # whatever this host routes documentation space from
    except OSError:
        pytest.skip("this host has no route beyond loopback")
    if addr.startswith("127."):
        pytest.skip("this host reaches everything over loopback")
    updates, line = worker_socket_env({}, addr, "1:4", hostname="localhost")
    assert updates == {GLOO_IFNAME: interface_of(addr), NCCL_IFNAME: interface_of(addr)}, line


def test_the_agents_call_leaves_a_one_machine_job_alone() -> None:
    assert worker_env_for("127.0.0.1:2379", None, "1:3", {}) == ({}, None)  # reached over loopback
    assert worker_env_for("http://127.0.0.1:2379,127.0.0.2:2379", None, "1", {}) == ({}, None)
    assert worker_env_for("not a port:x", None, "1:3", {})[0] == {}  # the rendezvous reports bad input
