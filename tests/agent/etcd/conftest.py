"""A real 3-member etcd cluster in network namespaces, one per test that asks for it."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.support.etcd_cluster import MEMBERS, EtcdCluster
from tests.support.netns import NodeNetwork, unavailable_reason


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with NodeNetwork(list(MEMBERS)) as net:
        etcd = EtcdCluster(net, tmp_path, MEMBERS)
        try:
            yield etcd.start()
        finally:
            etcd.close()
