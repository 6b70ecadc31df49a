"""``python -m tests.support.rank_main MODULE:FUNCTION RANK ARGS_JSON``: one rank of
:func:`tests.support.spawn.ranks`, which calls ``FUNCTION(RANK, *ARGS)`` as
``torch.multiprocessing.spawn`` would (the function found by its module and name, as spawn's
pickling finds it)."""

from __future__ import annotations

import importlib
import json
import sys


def main() -> None:
    target, rank, args = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(rank, *args)


if __name__ == "__main__":
    main()
