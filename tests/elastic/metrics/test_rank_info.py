"""Rank info in DCGM's terms: uuid spelling, which GPU a local rank has, the one-series merge.

Pure functions, milliseconds. The real processes and the agent's endpoint are in
test_rank_info_processes.py; the CUDA path (torch's uuid of a real GPU) in test_cuda_timing.py.
"""

from __future__ import annotations

import socket

import pytest
from prometheus_client.samples import Sample

from elastic.metrics.multiprocess import rank_info_samples
from elastic.metrics.rank_info import (RankInfo, agent_gpu_uuids, dcgm_hostname, gpu_uuid_label,
                                       gpu_uuids_by_local_rank, parse_smi, visible_token)

# NVIDIA's example in dcgm-exporter's README: DCGM_FI_DEV_SM_CLOCK{gpu="0", UUID="GPU-604ac76c-..."}
DCGM_UUID = "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"
OTHER = "GPU-1b2c3d4e-0000-1111-2222-333344445555"
SMI = f"""0, {DCGM_UUID}, NVIDIA H100 80GB HBM3
1, {OTHER}, NVIDIA H100 80GB HBM3
"""


def test_torchs_bare_uuid_becomes_dcgms_uuid_label() -> None:
    # str(torch.cuda.get_device_properties(d).uuid) is the 16 bytes as lowercase 8-4-4-4-12 hex
    assert gpu_uuid_label("604ac76c-d9cf-fef3-62e9-d92044ab6e52") == DCGM_UUID
    assert gpu_uuid_label("604AC76C-D9CF-FEF3-62E9-D92044AB6E52") == DCGM_UUID
    assert gpu_uuid_label(DCGM_UUID) == DCGM_UUID
    assert gpu_uuid_label("604ac76c-d9cf-fef3-62e9-d92044ab6e52", mig=True) == "MIG-604ac76c-d9cf-fef3-62e9-d92044ab6e52"
    assert gpu_uuid_label("") == ""


def test_hostname_follows_dcgm_exporter_node_name_first() -> None:
    assert dcgm_hostname({"NODE_NAME": "gpu-node-7"}) == "gpu-node-7"
    assert dcgm_hostname({}) == socket.gethostname()
    assert dcgm_hostname({"NODE_NAME": ""}) == socket.gethostname()


@pytest.mark.parametrize(("cvd", "expect"), [
    (None, ["0", "1", "2"]),
    ("3,1", ["3", "1", None]),
    ("0,oops,1", ["0", None, None]),  # CUDA stops at the first entry it cannot read
    (f"{OTHER}, 0", [OTHER, "0", None]),
    ("", [None, None, None]),
    ("-1", [None, None, None]),
])
def test_visible_token_reads_cuda_visible_devices_as_cuda_does(cvd: str | None, expect: list[str | None]) -> None:
    assert [visible_token(cvd, i) for i in range(3)] == expect


def test_nvidia_smi_csv_is_parsed_and_noise_ignored() -> None:
    assert parse_smi(SMI + "No devices were found\n") == [(0, DCGM_UUID, "NVIDIA H100 80GB HBM3"),
                                                          (1, OTHER, "NVIDIA H100 80GB HBM3")]


def test_local_ranks_get_the_gpu_cuda_will_give_them() -> None:
    gpus = parse_smi(SMI)
    assert gpu_uuids_by_local_rank(None, gpus, 3, pci_order=False) == [DCGM_UUID, OTHER, ""]
    assert gpu_uuids_by_local_rank("1,0", gpus, 2, pci_order=False) == [OTHER, DCGM_UUID]
    assert gpu_uuids_by_local_rank("GPU-604ac76c", gpus, 1, pci_order=False) == [DCGM_UUID]  # a unique prefix
    assert gpu_uuids_by_local_rank("GPU-,GPU-9", gpus, 2, pci_order=False) == ["", ""]  # ambiguous, unknown
    assert gpu_uuids_by_local_rank("MIG-abc", gpus, 1, pci_order=False) == ["MIG-abc"]


def test_an_index_on_a_mixed_node_is_not_guessed_unless_cuda_counts_in_pci_order() -> None:
    mixed = [(0, DCGM_UUID, "NVIDIA H100 80GB HBM3"), (1, OTHER, "NVIDIA A100-SXM4-40GB")]
    assert gpu_uuids_by_local_rank("1", mixed, 1, pci_order=False) == [""]
    assert gpu_uuids_by_local_rank("1", mixed, 1, pci_order=True) == [OTHER]
    assert gpu_uuids_by_local_rank(OTHER, mixed, 1, pci_order=False) == [OTHER]  # a full uuid is exact


@pytest.mark.slow  # starts processes
def test_agent_on_this_cpu_machine() -> None:
    """Real: no nvidia-smi here, so indices give no uuid; full uuids need no nvidia-smi."""
    assert agent_gpu_uuids(2, {}) == ["", ""]
    assert agent_gpu_uuids(2, {"CUDA_VISIBLE_DEVICES": ""}) == ["", ""]
    assert agent_gpu_uuids(3, {"CUDA_VISIBLE_DEVICES": f"{OTHER},{DCGM_UUID}"}) == [OTHER, DCGM_UUID, ""]


# -- the merge the agent's endpoint does -------------------------------------------------------
def claim(pid: int, info: RankInfo, value: float = 1.0) -> Sample:
    labels = dict(zip(("rank", "local_rank", "node", "hostname", "gpu_uuid"), info.labels()))
    return Sample("elastic_rank_info", {**labels, "pid": str(pid)}, value)


def ranks(samples: list[Sample]) -> dict[str, dict[str, str]]:
    out = {}
    for s in samples:
        assert s.value == 1 and "pid" not in s.labels
        assert s.labels["rank"] not in out, f"two series for rank {s.labels['rank']}"
        out[s.labels["rank"]] = s.labels
    return out


def test_a_worker_speaks_for_itself_and_the_agent_for_the_silent_ones() -> None:
    own = RankInfo(0, 0, "n", "h", "")
    guessed = RankInfo(0, 0, "n", "h", DCGM_UUID)
    silent = RankInfo(1, 1, "n", "h", OTHER)
    got = ranks(rank_info_samples([claim(100, own)], {100: guessed, 101: silent}))
    assert got["0"]["gpu_uuid"] == "" and got["1"]["gpu_uuid"] == OTHER


def test_a_worker_that_retired_its_claim_is_still_not_spoken_for() -> None:
    # pid 100 moved from rank 0 to rank 1 in place; rank 0 is gone from the world
    got = ranks(rank_info_samples([claim(100, RankInfo(0, 0, "n", "h"), 0.0), claim(100, RankInfo(1, 0, "n", "h"))],
                                  {100: RankInfo(0, 0, "n", "h")}))
    assert list(got) == ["1"] and got["1"]["local_rank"] == "0"


def test_a_rank_a_worker_claims_is_not_claimed_again_for_an_unknown_pid() -> None:
    got = ranks(rank_info_samples([claim(100, RankInfo(0, 0, "n", "h"))], {999: RankInfo(0, 0, "n", "h", OTHER)}))
    assert got["0"]["gpu_uuid"] == ""


def test_ranks_swapped_in_place_show_each_rank_once() -> None:
    a_now, b_now = RankInfo(1, 0, "n", "h"), RankInfo(0, 1, "n", "h")
    written = [claim(100, RankInfo(0, 0, "n", "h"), 0.0), claim(100, a_now),
               claim(101, RankInfo(1, 1, "n", "h"), 0.0), claim(101, b_now)]
    got = ranks(rank_info_samples(written, {}))
    assert (got["0"]["local_rank"], got["1"]["local_rank"]) == ("1", "0")


def test_a_rank_that_never_stepped_has_no_step_histogram() -> None:
    """A joiner's set-up world is rank 0 for a moment, then it joins as another rank: no
    histogram under rank 0 (it read 0/0, a NaN row in the p50 and straggler-ratio rules,
    beside the node's real rank, for as long as the process lived)."""
    from elastic.metrics.catalogue import families
    from elastic.metrics.worker import WorkerMetrics

    fam = families.__wrapped__()
    worker = WorkerMetrics(0, 1, backend="gloo", device="cpu", torch_version="x", restart_count=0, fam=fam)
    worker.rank_changed(1, 2)  # joined before any step of its set-up world
    worker.step_done(16, 0.30, 0.05)
    count = lambda rank: fam.registry.get_sample_value(  # noqa: E731
        "elastic_step_duration_seconds_count", {"rank": rank})
    assert count("0") is None and count("1") == 1
    assert fam.registry.get_sample_value("elastic_data_wait_seconds_count", {"rank": "0"}) is None
