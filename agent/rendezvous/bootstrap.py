"""The round's bootstrap address (``MASTER_ADDR``/``MASTER_PORT``), read without a watch per member.

torch's :meth:`RendezvousStoreInfo.build` has rank 0 publish its address and a free port in
the round's store, and every other rank ``get`` them. Our store's blocking ``get`` reads,
then watches the key from that read's revision. After a round closes every member reads at
the moment rank 0 writes, so almost every read misses and N-1 watches are created on one key
at once: at 1,024 simulated nodes those creations timed out (python3-etcd3's 5 s create
timeout) and the round failed (issue 53).

So a non-zero rank first reads both keys again a few times, on a jittered back-off
(:func:`read_delays`: ~50 ms, doubling to 0.5 s, ~2 s in all; members spread out instead of
arriving together), each read one range request; rank 0 writes within that in any but a
stalled round. Only if the keys are still missing does it fall back to torch's own
``build`` (rank 0's ``set``, everyone's blocking ``get``: a watch, under the store's
timeout), so torch's semantics are unchanged: the same keys, values and sealing, and a rank
0 that never writes still ends in the store's own timeout error.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Sequence

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

KEYS = (RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY)


def read_delays(first: float = 0.05, cap: float = 0.5, budget: float = 2.0,
                rng: random.Random | None = None) -> list[float]:
    """Pauses before each read: ``first`` doubling up to ``cap``, each scaled by a random
    0.5-1.5 so that members do not read in step, until they add up to ``budget``."""
    rng = rng or random.Random()
    delays: list[float] = []
    step = first
    while sum(delays) < budget:
        delays.append(min(step, cap) * rng.uniform(0.5, 1.5))
        step *= 2
    return delays


def bootstrap_info(rank: int, store: Store, peek: Callable[[Sequence[str]], list[bytes] | None],
                   local_addr: str | None, delays: Sequence[float] | None = None) -> RendezvousStoreInfo:
    """Rank 0: torch's ``build`` (it publishes). Others: ``peek(KEYS)`` (one read, None while
    a key is missing) after each of ``delays``; torch's ``build`` (a watch) if still missing."""
    if rank != 0:
        for pause in read_delays() if delays is None else delays:
            time.sleep(pause)
            found = peek(KEYS)
            if found is not None:
                return RendezvousStoreInfo(master_addr=found[0].decode("UTF-8"), master_port=int(found[1].decode()))
    return RendezvousStoreInfo.build(rank, store, local_addr)
