"""The worker's environment, typed (``elastic.worker_env.WorkerEnv``): what the agent builds
is what a worker parses back, and a worker under plain torchrun still gets its defaults.

Pure and process-free: dictionaries in, dictionaries out.
"""

from __future__ import annotations

from dataclasses import replace

from elastic import contract
from elastic.worker_env import NodeEnv, Place, RankEnv, WorkerEnv, be_world_of_one, in_setup_world, read, \
    under_torchrun

NODE = NodeEnv(node_name="n1", heartbeat_dir="/w/heartbeat", metrics_dir="/w/metrics", agent_pid=4242,
               snapshot_dir="/shared/ckpt", term_grace=25.0, control_dir="/w/control", goodput_dir="/w/goodput")
ME = RankEnv(Place(rank=5, world_size=8, group_rank=1, group_world_size=2, local_world_size=4, round=7),
             local_rank=1, role="default", master_addr="10.0.0.1", master_port=29500, restart_count=2,
             max_restarts=3, run_id="job1", use_agent_store=False, nccl_async_error_handling="1")


def test_the_agent_gives_a_worker_exactly_these_variables_in_this_order() -> None:
    """Pinned: the agent's workers saw these before WorkerEnv existed (agent/node/node_agent.py)."""
    env = WorkerEnv(replace(NODE, extra={"GLOO_SOCKET_IFNAME": "eth0"}), replace(ME, recovering=True)).to_env()
    assert list(env.items()) == [
        ("GLOO_SOCKET_IFNAME", "eth0"),
        ("ELASTIC_NODE_NAME", "n1"), ("ELASTIC_HEARTBEAT_DIR", "/w/heartbeat"),
        ("PROMETHEUS_MULTIPROC_DIR", "/w/metrics"), ("ELASTIC_AGENT_PID", "4242"),
        ("ELASTIC_SNAPSHOT_DIR", "/shared/ckpt"), ("ELASTIC_TERM_GRACE", "25"), ("ELASTIC_CONTROL_DIR", "/w/control"),
        ("ELASTIC_GOODPUT_DIR", "/w/goodput"),
        ("RANK", "5"), ("LOCAL_RANK", "1"), ("GROUP_RANK", "1"), ("ROLE_RANK", "5"), ("ROLE_NAME", "default"),
        ("LOCAL_WORLD_SIZE", "4"), ("WORLD_SIZE", "8"), ("GROUP_WORLD_SIZE", "2"), ("ROLE_WORLD_SIZE", "8"),
        ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500"), ("TORCHELASTIC_RESTART_COUNT", "2"),
        ("TORCHELASTIC_MAX_RESTARTS", "3"), ("TORCHELASTIC_RUN_ID", "job1"),
        ("TORCHELASTIC_USE_AGENT_STORE", "False"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        ("ELASTIC_ROUND", "7"), ("ELASTIC_GOODPUT_RECOVERY", "1"),
    ]


def test_what_the_agent_builds_a_worker_parses_back() -> None:
    for me in (ME, replace(ME, recovering=True), ME.in_setup_world([1, 3], 4711)):
        built = WorkerEnv(NODE, me)
        assert read(built.to_env()) == built
    optional_off = replace(NODE, snapshot_dir=None, control_dir=None, goodput_dir=None)
    assert read(WorkerEnv(optional_off, ME).to_env()) == WorkerEnv(optional_off, ME)
    written_in_the_worker = WorkerEnv(NODE, ME, started_at=1700000000.25, error_file="/logs/error.json")
    assert read(written_in_the_worker.to_env()) == written_in_the_worker


def test_a_standby_gets_the_nodes_part_and_no_rank() -> None:
    env = WorkerEnv(NODE).to_env()
    assert env == NODE.to_env() and not set(env) & set(contract.TORCHRUN)
    assert contract.METRICS_DIR_ENV in env  # it imports prometheus_client before it knows its rank


def test_a_plain_torchrun_worker_reads_the_defaults() -> None:
    plain = read({})
    assert plain.node == NodeEnv() and plain.started_at is None and plain.error_file is None
    assert (plain.me.place, plain.me.local_rank, plain.me.restart_count) == (Place(0, 1, 0, 0, 0, -1), 0, 0)
    assert not plain.me.recovering and not plain.me.setup_world and not under_torchrun({})
    garbled = read({"RANK": "", "LOCAL_RANK": "x", contract.TERM_GRACE_ENV: "soon", contract.AGENT_PID_ENV: "-1"})
    assert (garbled.me.place.rank, garbled.me.local_rank, garbled.node.term_grace, garbled.node.agent_pid) == \
        (0, 0, None, None)


def test_a_joiners_set_up_world_is_its_own_and_keeps_its_round() -> None:
    joiner = ME.in_setup_world([3, 1], 4711)
    assert joiner.place == Place(rank=0, world_size=2, group_rank=0, group_world_size=1, local_world_size=2, round=7)
    assert (joiner.master_addr, joiner.master_port, joiner.local_rank) == ("127.0.0.1", 4711, 1)
    env = WorkerEnv(NODE, joiner).to_env()
    assert in_setup_world(env) and list(env)[-1] == contract.SETUP_WORLD_ENV


def test_a_script_without_a_launcher_becomes_rank_0_of_a_world_of_one() -> None:
    env = {contract.MASTER_PORT_ENV: "1234"}
    be_world_of_one(5678, env)
    assert env == {"MASTER_PORT": "1234", "MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    assert under_torchrun(env)
