"""What :mod:`elastic.inplace.reconfigure` relies on in torch's experimental API.

If this fails after a torch upgrade, in-place recovery must be re-checked before use: the
trainer would otherwise take a path whose contract changed. Two real processes, real gloo.
"""

from __future__ import annotations

import pytest

import re
from pathlib import Path

from elastic.inplace.reconfigure import unsupported_reason
from tests.support.pair import run_pair

SCRIPT = """\
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from elastic.inplace import reconfigure as rc

rank, port = int(sys.argv[1]), int(sys.argv[2])
t = timedelta(seconds=30)
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=t)
rc.init_group("gloo", store, stable_rank=rank, stable_ranks=2, timeout=t)
first = rc.handle()
print("handle", first, flush=True)
store.set(f"h{rank}", first)
handles = [store.get(f"h{r}").decode() for r in (1, 0)]  # reversed: the list's order assigns ranks
rc.reconfigure(7, handles, t)
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x)
print("rank", dist.get_rank(), "world", dist.get_world_size(), "sum", x.item(), flush=True)
print("changed", rc.handle() != first, flush=True)
# shrink: every process alone, as a survivor whose peer died
rc.reconfigure(8 + rank, [rc.handle()], t)  # a uuid is spent store-wide, even by a lone member
y = torch.tensor([5.0])
dist.all_reduce(y)
print("alone", dist.get_rank(), dist.get_world_size(), y.item(), flush=True)
"""


def test_this_torch_supports_in_place_recovery_on_gloo() -> None:
    assert unsupported_reason("gloo") is None
    assert "backend 'mpi'" in (unsupported_reason("mpi") or "")


@pytest.mark.slow  # starts processes
def test_reconfigure_assigns_ranks_by_handle_order_and_can_shrink(tmp_path: Path) -> None:
    outs = run_pair(SCRIPT, tmp_path)
    for stable_rank, out in enumerate(outs):
        handle = re.search(r"^handle (\S+)$", out, re.M)
        assert handle, out
        backend, _, _, stable, _addr = handle.group(1).split(":", 4)
        assert (backend, int(stable)) == ("gloo", stable_rank), handle.group(1)
        new_rank = 1 - stable_rank
        assert f"rank {new_rank} world 2 sum 3.0" in out, out
        assert "changed True" in out, out  # handles are gathered afresh after every reconfigure
        assert "alone 0 1 5.0" in out, out
