"""Pure naming and subnet logic of the network-namespace harness (no root, milliseconds)."""

from __future__ import annotations

import ipaddress

import pytest

from agent.local.netns_names import (
    IFNAMSIZ, Names, NetnsNameError, central_addr, node_addr, owner_pid, pick_subnet,
)

net = ipaddress.IPv4Network


def test_every_name_carries_its_owner_pid_and_fits_the_kernel_limit() -> None:
    names = Names(pid=32768, instance=9)
    made = [names.bridge, names.host_link(999), names.node_link(999), names.namespace("node-7.b_c")]
    assert [owner_pid(n) for n in made] == [32768] * 4
    assert all(len(n) <= IFNAMSIZ for n in made[:3])


def test_names_the_harness_did_not_make_have_no_owner() -> None:
    for name in ["eth0", "lo", "docker0", "et123", "etx1b", "et12x3", "et12x3q0", "et12x3-a/b", "et12x3-", "veth9"]:
        assert owner_pid(name) is None, name


def test_too_long_interface_names_and_bad_node_names_are_refused_with_the_fix() -> None:
    with pytest.raises(NetnsNameError, match="15 bytes"):
        Names(pid=4194304, instance=10).host_link(1000)
    with pytest.raises(NetnsNameError, match="letters, digits"):
        Names(pid=1, instance=1).namespace("a/b")


def test_the_subnet_avoids_every_route_but_the_default_one() -> None:
    used = [net("0.0.0.0/0"), net("192.0.2.0/24"), net("10.233.5.0/24")]
    assert pick_subnet(used, seed=5) == net("10.233.6.0/24")
    assert pick_subnet(used, seed=4) == net("10.233.4.0/24")
    assert pick_subnet(used, seed=255 + 256) == net("10.233.255.0/24")


def test_a_wider_route_over_the_pool_leaves_no_subnet() -> None:
    with pytest.raises(NetnsNameError, match="pass another pool"):
        pick_subnet([net("10.0.0.0/8")], seed=0)
    assert pick_subnet([net("10.0.0.0/8")], seed=0, pool=net("172.31.0.0/23")) == net("172.31.0.0/24")


def test_addresses_central_first_then_nodes() -> None:
    subnet = net("10.233.7.0/24")
    assert central_addr(subnet) == "10.233.7.1"
    assert [node_addr(subnet, i) for i in (0, 1)] == ["10.233.7.11", "10.233.7.12"]
    with pytest.raises(NetnsNameError, match="at most"):
        node_addr(subnet, 243)
