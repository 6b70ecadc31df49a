"""Naming what ended a worker by its kind: by the error's type where the worker fails
(elastic.failure_record.fault_cause), torch's untyped CUDA and NCCL errors by their words in
elastic.torch_untyped alone (pure; no GPU needed: the texts are torch's and NCCL's own)."""

from __future__ import annotations

import errno
from pathlib import Path

import torch
import torch.distributed as dist

from agent.node.fault_cause import attribute, timeline_reason
from agent.local.local_node import Crash
from agent.node.policy import Failure
from checkpoints.errors import SnapshotDiskFullError
from elastic.collectives import CollectiveFailure
from elastic.contract import FaultCause
from elastic.failure_record import fault_cause
from elastic.snapshots import StaleGroupError
from elastic.torch_untyped import untyped_cause


def _chained(outer: Exception, inner: Exception) -> Exception:
    outer.__cause__ = inner  # as ``raise outer from inner`` leaves it
    return outer


def test_the_errors_the_os_torch_and_the_run_raise_are_named_by_type() -> None:
    assert fault_cause(OSError(errno.ENOSPC, "No space left on device")) is FaultCause.DISK_FULL
    assert fault_cause(OSError(errno.EDQUOT, "Disk quota exceeded")) is FaultCause.DISK_FULL
    assert fault_cause(SnapshotDiskFullError("snapshot directory /x: disk full")) is FaultCause.DISK_FULL
    assert fault_cause(_chained(RuntimeError("could not write"), OSError(errno.ENOSPC, "full"))) is FaultCause.DISK_FULL
    assert fault_cause(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) is FaultCause.GPU_OOM
    assert fault_cause(torch.AcceleratorError("CUDA error: device-side assert triggered")) is FaultCause.CUDA
    assert fault_cause(dist.DistBackendError("NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
                                             "unhandled cuda error, NCCL version 2.20.5")) is FaultCause.NCCL
    assert fault_cause(_chained(CollectiveFailure("ncclRemoteError"), dist.DistBackendError(
        "ncclRemoteError: A call failed possibly due to a network error"))) is FaultCause.NCCL
    assert fault_cause(MemoryError()) is FaultCause.OOM
    assert fault_cause(StaleGroupError("round 3 is older than the fence")) is FaultCause.LEASE_LOST
    assert fault_cause(NameError("name 'x' is not defined")) is None
    assert fault_cause(OSError(errno.ENOENT, "No such file")) is None
    # a script's own error is its own, whatever it says: only torch's untyped errors are read
    assert fault_cause(RuntimeError("CUDA error: an illegal memory access was encountered")) is None


def test_torchs_untyped_texts_are_read_in_one_module() -> None:
    assert untyped_cause("CUDA out of memory. Tried to allocate 9313.23 GiB. GPU 0 has a total capacity of "
                         "139.80 GiB of which 139.29 GiB is free.") is FaultCause.GPU_OOM
    assert untyped_cause("NCCL communicator was aborted on rank 3.") is FaultCause.NCCL
    assert untyped_cause("ncclRemoteError: A call failed possibly due to a network error") is FaultCause.NCCL
    assert untyped_cause("CUDA error: an illegal memory access was encountered") is FaultCause.CUDA
    assert untyped_cause("CUDNN_STATUS_EXECUTION_FAILED") is FaultCause.CUDA
    assert untyped_cause("[gloo] Connection closed by peer") is None


def test_the_line_says_the_kind_first_once_and_leaves_the_rest_as_it_was() -> None:
    line = attribute("OSError: [Errno 28] No space left on device", FaultCause.DISK_FULL)
    assert line == "disk full (ENOSPC): OSError: [Errno 28] No space left on device"
    assert attribute(line, FaultCause.DISK_FULL) == line
    assert attribute("ValueError: boom", None) == "ValueError: boom" and attribute("", FaultCause.OOM) == ""
    # the words never name it: a line that only says so is not attributed
    assert attribute("OSError: [Errno 28] No space left on device", None) == "OSError: [Errno 28] No space left on device"
    oom = "killed by the OOM killer (SIGKILL; the machine's OOM kill count went from 1 to 2): give the job more"
    assert attribute(oom, FaultCause.OOM) == oom  # agent.node.oom's words name it already


def test_the_names_do_not_make_a_fault_look_like_a_peers_doing() -> None:
    for text, kind in (("RuntimeError: CUDA error: an illegal memory access was encountered", FaultCause.CUDA),
                       ("OSError: [Errno 28] No space left on device", FaultCause.DISK_FULL),
                       ("torch.distributed.DistBackendError: ncclUnhandledCudaError: Call to CUDA function failed.",
                        FaultCause.NCCL)):
        assert not Failure(1, 1.0, attribute(text, kind), cause=kind).peer_caused, text


def test_the_timeline_names_a_worker_failure_by_its_kind() -> None:
    assert timeline_reason("worker_failed", [None, FaultCause.DISK_FULL]) == "disk_full"
    assert timeline_reason("worker_failed", [None]) == "worker_failed"
    assert timeline_reason("peer_lost", [FaultCause.CUDA]) == "peer_lost"
    assert timeline_reason("worker_failed", [FaultCause.LEASE_LOST]) == "worker_failed"


def test_elastic_locals_summary_says_the_kind_too() -> None:
    crash = Crash(0.0, "crash", "1", "OSError: [Errno 28] No space left on device", cause="disk_full")
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
