"""DDP's one-time bucket rebuild, moved to where a lost peer can be caught.

After the first backward, DDP reorders its gradient buckets by the order gradients became
ready and, at the *next forward*, broadcasts rank 0's order to every rank: a collective
inside the user's forward. In place, DDP is built again after every change of world, so
that window reopens after every re-formation; a peer lost inside it made the user's forward
raise and the worker die with its state intact (the freeze right after a join in the demo
lost both survivors that way, and with them every replica). :func:`settle` runs the rebuild
right after the backward, inside the step's guarded collectives; DDP's forward then finds
nothing left to do.

``Reducer._rebuild_buckets`` is private (DDP's own forward and its join hook call it). A
torch without it gets ``False`` and the rebuild stays in the forward, as in plain DDP;
``tests/elastic/test_ddp_buckets.py`` fails loudly when torch changes it.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel


def settle(model: DistributedDataParallel) -> bool:
    """Rebuild DDP's buckets now if it is due (a collective); True if it ran here."""
    rebuild = getattr(getattr(model, "reducer", None), "_rebuild_buckets", None)
    if rebuild is None:
        return False
    if rebuild():
        model._has_rebuilt_buckets = True  # what DDP's forward records when it rebuilds
        return True
    return False
