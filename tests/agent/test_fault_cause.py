"""Naming what ended a worker from its last words (pure; no GPU needed: the texts are torch's
and NCCL's own)."""

from __future__ import annotations

from pathlib import Path

from agent.node.fault_cause import CUDA, DISK_FULL, GPU_OOM, LEASE, NCCL, OOM, attribute, classify, timeline_reason
from agent.local.local_node import Crash
from agent.node.policy import Failure


def test_the_texts_torch_and_nccl_raise_are_named_by_kind() -> None:
    assert classify("OSError: [Errno 28] No space left on device: '/snap/step-40.tmp'") is DISK_FULL
    assert classify("checkpoints.SnapshotDirError: snapshot directory /x: ENOSPC") is DISK_FULL
    assert classify("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB") is GPU_OOM
    assert classify("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
                    "NCCLUtils.hpp:275, unhandled cuda error, NCCL version 2.20.5") is NCCL
    assert classify("RuntimeError: NCCL communicator was aborted on rank 3.") is NCCL
    assert classify("torch.distributed.DistBackendError: ncclRemoteError: A call failed possibly due to a "
                    "network error or a remote process exiting prematurely.") is NCCL
    assert classify("RuntimeError: CUDA error: an illegal memory access was encountered") is CUDA
    assert classify("RuntimeError: CUDA error: device-side assert triggered") is CUDA
    assert classify("RuntimeError: CUDNN_STATUS_EXECUTION_FAILED") is CUDA
    assert classify("killed by the OOM killer (SIGKILL; the cgroup's OOM kill count went from 0 to 1)") is OOM
    assert classify("elastic.inplace.fence.StaleGroupError: round 3 is older than the fence") is LEASE
    # as torch 2.x on an H200 raised them (a run on the device machine, 2026-11-28)
    assert classify("torch.AcceleratorError: CUDA error: device-side assert triggered") is CUDA
    assert classify("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 9313.23 GiB. GPU 0 has a total "
                    "capacity of 139.80 GiB of which 139.29 GiB is free.") is GPU_OOM
    assert classify("NameError: name 'x' is not defined") is None
    assert classify("") is None


def test_the_line_says_the_kind_first_once_and_leaves_the_rest_as_it_was() -> None:
    line = attribute("OSError: [Errno 28] No space left on device")
    assert line == "disk full (ENOSPC): OSError: [Errno 28] No space left on device"
    assert attribute(line) == line
    assert attribute("ValueError: boom") == "ValueError: boom" and attribute("") == ""
    oom = "killed by the OOM killer (SIGKILL; the machine's OOM kill count went from 1 to 2): give the job more"
    assert attribute(oom) == oom  # agent.node.oom's words name it already


def test_the_names_do_not_make_a_fault_look_like_a_peers_doing() -> None:
    for text in ("RuntimeError: CUDA error: an illegal memory access was encountered",
                 "OSError: [Errno 28] No space left on device",
                 "torch.distributed.DistBackendError: ncclUnhandledCudaError: Call to CUDA function failed."):
        assert not Failure(1, 1.0, attribute(text)).peer_caused, text


def test_the_timeline_names_a_worker_failure_by_its_kind() -> None:
    assert timeline_reason("worker_failed", ["ValueError: x", "disk full (ENOSPC): OSError: [Errno 28]"]) == "disk_full"
    assert timeline_reason("worker_failed", ["ValueError: x"]) == "worker_failed"
    assert timeline_reason("peer_lost", ["RuntimeError: CUDA error: x"]) == "peer_lost"
    assert timeline_reason("worker_failed", ["StaleGroupError: old"]) == "worker_failed"


def test_elastic_locals_summary_says_the_kind_too() -> None:
    crash = Crash(0.0, "crash", "1", "OSError: [Errno 28] No space left on device")
    assert crash.describe() == "worker exit 1: disk full (ENOSPC): OSError: [Errno 28] No space left on device"


def test_a_lost_lease_in_a_nodes_log_is_told_under_the_freeze_that_caused_it(tmp_path: Path) -> None:
    from agent.local.local_faults import FREEZE, Cluster, ClusterNode, Fault
    from agent.local.local_node import LocalNode, NodeLog

    from agent.node.events import Restarted
    from tests.support.agent_output import write_output

    node = LocalNode(name="b", endpoint="x", run_id="r", workdir=tmp_path)
    write_output(node.log_path, Restarted("lease_lost", "this node lost its own etcd lease (it was frozen or cut off); "
                                                        "its workers are stale", at=2.0), agent_dir=node.agent_dir)
    log = NodeLog(node.log_path)
    assert log.read() == []  # not a crash of its workers
    [loss] = log.lease_losses
    assert loss.describe() == ("workers stopped: etcd lease lost: this node lost its own etcd lease (it was frozen "
                               "or cut off); its workers are stale")
    cluster = Cluster([ClusterNode(node)], tmp_path, nproc=1)
    cluster.faults.append(Fault(FREEZE, "b", 0.0, 2, 10, 3))
    cluster._take_lease_losses(cluster.nodes[0])
    assert cluster.faults[0].crashes == [("b", node.log.lease_losses[0])]
