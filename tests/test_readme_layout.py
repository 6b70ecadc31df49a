"""README's layout names real paths, and names every folder of the agent and the library.

A newcomer reads the layout table to find where a file runs; a renamed folder that the
table still names (or a new folder it does not) would send them to the wrong place.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _layout_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Layout")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _named_paths() -> set[str]:
    return {
        m for m in re.findall(r"`([\w./-]+)`", _layout_section()) if "/" in m or m.endswith(".py")
    }


def test_every_path_the_layout_names_exists() -> None:
    missing = sorted(p for p in _named_paths() if not (ROOT / p).exists())
    assert not missing, f"README's layout names paths that do not exist: {missing}"


def test_the_layout_names_every_folder_of_the_agent_and_each_top_level_package() -> None:
    named = {p.rstrip("/") for p in _named_paths()}
    folders = {
        f"agent/{d.name}"
        for d in (ROOT / "agent").iterdir()
        if d.is_dir() and (d / "__init__.py").exists()
    }
    folders |= {"elastic", "checkpoints", "tests", "bench", "deploy", "docs"}
    unnamed = sorted(folders - named)
    assert not unnamed, f"README's layout does not say where these run: {unnamed}"


def test_old_import_paths_are_the_moved_modules_themselves() -> None:
    import importlib

    for old, new in [
        ("agent.launch", "agent.node.launch"),
        ("agent.kill", "agent.tools.kill"),
        ("agent.local_cluster", "agent.local.local_cluster"),
        ("agent.worker_boot", "agent.worker.worker_boot"),
        ("elastic.rendezvous.entrypoint", "agent.rendezvous.entrypoint"),
        ("elastic.etcd.client", "agent.etcd.client"),
    ]:
        assert importlib.import_module(old) is importlib.import_module(new), old
