"""Import paths from before the folders were split by process (0.1.0), still importable.

Issue 38 moved the agent's flat modules into ``agent/{node,worker,tools,local}`` and the
agent-side packages ``elastic.rendezvous``/``elastic.etcd`` to ``agent.rendezvous``/
``agent.etcd``. Scripts, notebooks and torchrun configs written against the old paths keep
working: an old name imports the module at its new path, and both names are the *same*
module object (one set of module globals, one registry), not a copy.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

#: Old package prefix -> new one.
MOVED_PACKAGES = {"elastic.rendezvous": "agent.rendezvous", "elastic.etcd": "agent.etcd"}
#: The agent's folders, in the order an old ``agent.<module>`` is looked up in them.
AGENT_FOLDERS = ("node", "worker", "tools", "local")


def new_name(old: str) -> str | None:
    """The module an old dotted name now lives at, or None if ``old`` was not moved."""
    for before, after in MOVED_PACKAGES.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before):]
    parts = old.split(".")
    if len(parts) >= 2 and parts[0] == "agent" and parts[1] not in AGENT_FOLDERS:
        for folder in AGENT_FOLDERS:
            if importlib.util.find_spec(f"agent.{folder}.{parts[1]}") is not None:
                return ".".join(["agent", folder, *parts[1:]])
    return None


class _Alias(importlib.abc.Loader):
    """Hands back the module at its new path instead of executing a second copy."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at its new path is already executed."""


class OldPathFinder(importlib.abc.MetaPathFinder):
    """Answers only for moved names; first, so that ``elastic.rendezvous.x`` is never loaded a
    second time from the moved package's folder under its old name."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(("agent.", "elastic.")):
            return None
        target_name = new_name(fullname)
        if target_name is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(target_name))


def install() -> None:
    """Idempotent: one finder, first in ``sys.meta_path``; it answers for moved names only."""
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, OldPathFinder())
