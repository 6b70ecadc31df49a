"""Who a rank is, in the label values NVIDIA's DCGM exporter uses, so the two can be joined.

``elastic_rank_info{rank, local_rank, node, hostname, gpu_uuid} 1`` names each live rank's
host and GPU. DCGM labels each GPU series with ``UUID`` (NVML's ``GPU-xxxxxxxx-xxxx-...``,
globally unique) and ``Hostname`` (``hostname`` in dcgm-exporter after 4.5.3-4.8.2): the
``NODE_NAME`` variable if set (its Kubernetes manifests set it to the node's name), else
the kernel's hostname. We fill ``hostname`` and ``gpu_uuid`` by the same rules, so PromQL
joins the two ``on (gpu_uuid)`` after a ``label_replace`` of ``UUID`` (docs/metrics.md).

Two sources, one series per rank: an ``ElasticRun`` worker reports itself (its GPU uuid
from CUDA, exact), and the agent reports the workers that do not (plain scripts), from
what it knows without touching CUDA: the worker's ranks, ``CUDA_VISIBLE_DEVICES`` and
``nvidia-smi``. :mod:`elastic.metrics.multiprocess` merges the two.

No torch here: the agent imports this.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

log = logging.getLogger(__name__)

LABELS = ("rank", "local_rank", "node", "hostname", "gpu_uuid")
SMI_QUERY = ("nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader")
SMI_TIMEOUT_S = 10.0
FULL_UUID_LEN = len("GPU-") + 36  # 8-4-4-4-12 hex digits and dashes


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    node: str
    hostname: str
    gpu_uuid: str = ""  # empty on the CPU: the label is then absent, as Prometheus treats ""

    def labels(self) -> tuple[str, ...]:
        """Label values in the order of :data:`LABELS`."""
        return (str(self.rank), str(self.local_rank), self.node, self.hostname, self.gpu_uuid)


def dcgm_hostname(environ: Mapping[str, str] = os.environ) -> str:
    """The host's name as dcgm-exporter reports it: ``NODE_NAME``, else the kernel's hostname.

    In a Kubernetes pod the kernel's hostname is the pod's name, while the exporter (a
    DaemonSet with ``NODE_NAME`` from ``spec.nodeName``) reports the node's: set
    ``NODE_NAME`` the same way in the trainer pod (deploy/k8s/base/trainer.yaml does).
    """
    return environ.get("NODE_NAME") or socket.gethostname()


def gpu_uuid_label(raw: str, *, mig: bool = False) -> str:
    """NVML's spelling of a GPU's uuid, which DCGM's ``UUID`` label holds.

    torch prints ``cudaDeviceProp.uuid`` bare (``5c2d…-…``, lowercase hex 8-4-4-4-12);
    NVML and ``nvidia-smi`` prefix ``GPU-`` (``MIG-`` for a MIG slice). A value that
    already has its prefix is kept as it is.
    """
    text = raw.strip()
    if not text or text.startswith(("GPU-", "MIG-")):
        return text
    return ("MIG-" if mig else "GPU-") + text.lower()


def visible_token(cuda_visible_devices: str | None, index: int) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` entry that CUDA numbers ``index``, or None if none is.

    As CUDA reads it: comma-separated, and an entry that is not an index or a ``GPU-``/
    ``MIG-`` uuid (prefix) hides itself and everything after it. Unset means all GPUs,
    in order, so the token is the index itself.
    """
    if cuda_visible_devices is None:
        return str(index)
    tokens = []
    for token in (t.strip() for t in cuda_visible_devices.split(",")):
        if not (token.isdigit() or token.startswith(("GPU-", "MIG-"))):
            break
        tokens.append(token)
    return tokens[index] if 0 <= index < len(tokens) else None


def parse_smi(text: str) -> list[tuple[int, str, str]]:
    """``nvidia-smi --query-gpu=index,uuid,name --format=csv,noheader`` -> (index, uuid, name)."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) == 3 and parts[0].isdigit() and parts[1].startswith("GPU-"):
            rows.append((int(parts[0]), parts[1], parts[2]))
    return rows


def gpu_uuids_by_local_rank(cuda_visible_devices: str | None, gpus: Sequence[tuple[int, str, str]],
                            count: int, *, pci_order: bool) -> list[str]:
    """The uuid of the GPU that ``cuda:local_rank`` is for local ranks ``0..count-1``.

    This is torchrun's convention (a worker uses ``cuda:LOCAL_RANK`` under the agent's
    ``CUDA_VISIBLE_DEVICES``; so does ``--virtual-local-rank``). An entry given as a uuid
    is exact. An index is a ``nvidia-smi`` index (PCI bus order), while CUDA numbers
    fastest-first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: the two agree when every GPU
    is the same model, so on a mixed node without ``pci_order`` an index stays unknown
    rather than guessed. "" where unknown.
    """
    by_index = {index: uuid for index, uuid, _ in gpus}
    uuids = [uuid for _, uuid, _ in gpus]
    indices_reliable = pci_order or len({name for _, _, name in gpus}) <= 1
    out = []
    for local_rank in range(count):
        token = visible_token(cuda_visible_devices, local_rank)
        if token is None:
            out.append("")
        elif token.isdigit():
            out.append(by_index.get(int(token), "") if indices_reliable else "")
        elif token.startswith("MIG-"):
            out.append(token)  # DCGM labels a slice with its parent's UUID: no join, but named
        else:
            matches = [u for u in uuids if u.startswith(token)]  # CUDA accepts a unique prefix
            whole = token if len(token) == FULL_UUID_LEN else ""  # a prefix alone names no GPU
            out.append(matches[0] if len(matches) == 1 else whole)
    return out


def query_gpus() -> list[tuple[int, str, str]]:
    """This host's GPUs from ``nvidia-smi`` (no CUDA context in the caller); [] without it."""
    try:
        done = subprocess.run(SMI_QUERY, capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.debug("no GPU list from nvidia-smi (%s): rank info has no gpu_uuid", exc)
        return []
    if done.returncode != 0:
        log.info("nvidia-smi exited %d: rank info has no gpu_uuid (%s)", done.returncode, done.stderr.strip()[:200])
        return []
    return parse_smi(done.stdout)


def agent_gpu_uuids(count: int, environ: Mapping[str, str] = os.environ) -> list[str]:
    """For the agent: what ``cuda:0..count-1`` will be in its workers, without CUDA."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    tokens = [visible_token(cvd, i) for i in range(count)]
    if not any(tokens):
        return [""] * count  # CUDA_VISIBLE_DEVICES="" or "-1": no GPUs, nothing to ask
    # Only indices and uuid prefixes need the host's list; full uuids are their own answer.
    ask = any(t is not None and not t.startswith("MIG-") and not (t.startswith("GPU-") and len(t) == FULL_UUID_LEN)
              for t in tokens)
    gpus = query_gpus() if ask else []
    return gpu_uuids_by_local_rank(cvd, gpus, count, pci_order=environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID")
