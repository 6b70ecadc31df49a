"""RNG state as tensors and plain numbers, so it round-trips through weights_only loading.

``random.getstate()`` and ``numpy.random.get_state()`` return tuples holding a Mersenne
Twister array; pickling those would put arbitrary objects in the format, so they are
unpacked into an int64 tensor plus plain numbers here and rebuilt on restore.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Mapping, cast

import torch

log = logging.getLogger(__name__)

try:
    import numpy as np
except ImportError:  # numpy is optional for the store
    np = None  # type: ignore[assignment]  # numpy is optional: its state is saved when present


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy (global legacy RNG), torch CPU and every visible CUDA device's RNG."""
    version, mt, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": int(version), "state": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        # legacy=True: always the 5-tuple (a dict only for a non-MT19937 generator without it)
        got = cast("tuple[str, Any, int, int, float]", np.random.get_state(legacy=True))
        kind, keys, pos, has_gauss, cached = got
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    torch.set_rng_state(state["torch"].cpu().to(torch.uint8))
    if "numpy" in state:
        if np is None:
            log.warning("snapshot has NumPy RNG state but numpy is not installed; not restoring it")
        else:
            n = state["numpy"]
            np.random.set_state(
                (n["kind"], n["keys"].numpy().astype(np.uint32), int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"]))
            )
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            log.warning("snapshot has CUDA RNG state but CUDA is not available; not restoring it")
        elif len(cuda) != torch.cuda.device_count():
            log.warning(
                "snapshot has CUDA RNG state for %d device(s) but %d are visible; restoring the common ones",
                len(cuda),
                torch.cuda.device_count(),
            )
            for i, s in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s.cpu().to(torch.uint8), i)
        else:
            torch.cuda.set_rng_state_all([s.cpu().to(torch.uint8) for s in cuda])
