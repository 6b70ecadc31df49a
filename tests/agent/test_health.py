"""Node health checks and the decision on them: pure, in milliseconds (the real faults are in
tests/agent/test_health_faults.py)."""

from __future__ import annotations

import os
from pathlib import Path

from agent.node import health
from agent.node.health import Check, HealthReport, Limits, verdict
from agent.node.policy import Action, Observation, Reason, decide


def _statvfs(free_blocks: int, blocks: int = 1000, frsize: int = 4096):
    return lambda _path: os.statvfs_result((frsize, frsize, blocks, free_blocks, free_blocks, 0, 0, 0, 0, 255))


def test_a_disk_under_the_minimum_fails_with_its_path_and_the_fix() -> None:
    bad = health.disk_space("snapshot_dir", Path("/snap"), 1 << 20, _statvfs(10))
    assert not bad.ok and bad.name == "snapshot_dir_space"
    assert "/snap has 0.0 MiB free of 3.9 MiB, under the 1.0 MiB needed" in bad.line()
    assert "ELASTIC_HEALTH_MIN_FREE_MB" in bad.fix
    assert health.disk_space("snapshot_dir", Path("/snap"), 1 << 20, _statvfs(900)).ok


def test_a_directory_that_takes_no_file_is_named_with_its_errno(tmp_path: Path) -> None:
    assert health.writable("agent_dir", tmp_path).ok and not list(tmp_path.iterdir())  # the probe is gone
    gone = health.writable("agent_dir", tmp_path / "missing")
    assert not gone.ok and "is not writable" in gone.detail


def test_memory_is_what_the_kernel_calls_available() -> None:
    assert not health.memory(256 << 20, "MemTotal: 1000000 kB\nMemAvailable: 1024 kB\n").ok
    assert health.memory(256 << 20, "MemAvailable: 4000000 kB\n").ok
    assert health.memory(256 << 20, "").ok  # not reported: not a sick node


def test_a_clock_fails_only_beyond_the_limit_by_more_than_the_measurements_own_error() -> None:
    late = health.clock(-3600.2, 0.6, 10.0, "Date of etcd")
    assert not late.ok and "3600.2 s behind etcd's" in late.detail and "chronyc makestep" in late.fix
    assert not health.clock(11.0, 0.5, 10.0, "x").ok
    assert health.clock(10.4, 0.5, 10.0, "x").ok  # within the measurement's error
    assert health.clock(None, 0.0, 10.0, "etcd unreachable").ok  # cannot tell: passes


def test_an_interface_must_exist_and_be_up() -> None:
    flags = {"eth0": 0x1043, "eth1": 0x1002}.get
    assert health.interface(("eth0",), flags).ok
    assert "eth1 is down" in health.interface(("eth1",), flags).detail
    assert "does not exist" in health.interface(("ib0",), flags).detail
    assert health.interface((), flags).ok
    heal = health.interface(("eth0", "ib0"), flags, {"eth0": "GLOO_SOCKET_IFNAME", "ib0": "ELASTIC_HEAL_IFNAME"})
    assert not heal.ok and heal.detail == "network interface ib0 (ELASTIC_HEAL_IFNAME) does not exist", heal.detail


def test_the_kernels_own_flags_say_a_live_link_is_running() -> None:
    """The real look-up: loopback is up and running as the kernel reports it to ``ip link``.
    ``/sys/class/net/lo/flags`` reads 0x9 (no IFF_RUNNING, which the kernel computes on
    demand), so every real link read as down there and no node of a job that named its
    interface (GLOO_SOCKET_IFNAME) ever joined (the namespaced tests showed it)."""
    flags = health.net_flags("lo")
    assert flags is not None and flags & health.IFF_UP and flags & health.IFF_RUNNING, flags
    assert health.interface(("lo",), health.net_flags).ok
    assert health.net_flags("no-such-if0") is None


def test_gpus_with_ecc_errors_or_pending_retired_pages_fail() -> None:
    h200 = "0, 00000000:00:06.0, 0, [N/A]\n"  # nvidia-smi's answer on an H200 (the device machine, 2026-11-28)
    assert health.gpus(h200).ok and "1 GPU(s)" in health.gpus(h200).detail
    good = "0, 00000000:18:00.0, 0, No\n1, 00000000:2A:00.0, [N/A], [N/A]\n"
    assert health.gpus(good).ok and "2 GPU(s)" in health.gpus(good).detail
    bad = health.gpus("0, 00000000:18:00.0, 3, No\n1, 00000000:2A:00.0, 0, Yes\n")
    assert not bad.ok and "GPU 0 (00000000:18:00.0): 3 uncorrected ECC" in bad.detail and "GPU 1" in bad.detail
    assert not health.gpus(None, "Unable to determine the device handle for GPU 0000:18:00.0: Unknown Error").ok
    assert health.gpus(None).ok  # no driver: not a GPU node


def test_the_verdict_names_every_failed_check_and_nothing_for_a_healthy_node() -> None:
    ok, disk = Check("memory", True, "plenty"), Check("snapshot_dir_writable", False, "full", "free space")
    assert verdict(None) == "" and verdict(HealthReport((ok,))) == ""
    line = verdict(HealthReport((ok, disk, Check("clock", False, "late", "sync it"))))
    assert line == ("health check snapshot_dir_writable failed: full; free space | "
                    "health check clock failed: late; sync it")


def test_limits_come_from_the_environment_and_bad_values_keep_the_defaults() -> None:
    limits = Limits.from_env({"ELASTIC_HEALTH_MIN_FREE_MB": "64", "ELASTIC_HEALTH_MAX_SKEW_S": "x"})
    assert limits.min_free_bytes == 64 << 20 and limits.max_skew_s == 10.0 and limits.enabled
    assert not Limits.from_env({"ELASTIC_HEALTH": "off"}).enabled


def test_a_sick_node_that_trains_is_kept_out_only_where_the_others_go_on_without_it() -> None:
    running = {0: None}
    sick = decide(Observation(exits=running, health="health check clock failed", nodes_without_us=2, min_nodes=2))
    assert sick.action is Action.KEEP_OUT and sick.reason is Reason.HEALTH and "clock" in sick.detail
    alone = decide(Observation(exits=running, health="health check clock failed", nodes_without_us=1, min_nodes=2))
    assert alone.action is Action.CONTINUE  # the job needs it: trains on, the line and metric say it is sick
    assert decide(Observation(exits=running, health="x", nodes_without_us=None)).action is Action.CONTINUE
    assert decide(Observation(exits=running, nodes_without_us=2, min_nodes=1)).action is Action.CONTINUE
    lost = decide(Observation(exits=running, membership=Reason.LEASE_LOST, health="x", nodes_without_us=2))
    assert lost.reason is Reason.LEASE_LOST  # stale workers die first
    done = decide(Observation(exits={0: 0}, health="x", nodes_without_us=2))
    assert done.action is Action.SUCCEED
    assert not sick.counted  # a sick node spends none of --max-restarts


def test_the_gate_lets_a_healthy_node_join_and_keeps_a_sick_one_out_until_the_job_ends(tmp_path: Path) -> None:
    """:meth:`HealthWatch.gate` carries out :func:`agent.node.policy.before_joining`: in
    process, real checks (a snapshot location that is a file is not writable; no thresholds on
    free space or memory, which a busy machine may not meet), the job's end seen at the first
    look of the keep-out so that the test waits no back-off."""
    from agent.node.health_watch import HealthWatch
    from agent.node.keep_outs import KeepOuts
    from agent.rendezvous.keepout import KeepOut

    published: list[KeepOut | None] = []
    (tmp_path / "snap").mkdir()
    limits = Limits(min_free_bytes=0, min_mem_bytes=0)
    healthy = HealthWatch("n", tmp_path / "snap", tmp_path, {}, limits=limits)
    assert healthy.gate(3, KeepOuts("n", lambda: True), published.append) and published == []
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    keep_outs = KeepOuts("n", lambda: True)
    assert not HealthWatch("n", blocked, tmp_path, {}, limits=limits).gate(3, keep_outs, published.append)
    out, back = published
    assert out is not None and back is None and keep_outs.strikes == 1
    assert out.round == 3 and "snapshot_dir" in out.cause, out
