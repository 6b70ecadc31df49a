"""Every Python name the README and docs/*.md tell users to use exists.

The rule, applied to code spans and fenced code blocks only (prose may say anything):

* ``from elastic|agent|checkpoints[.sub] import a, b`` and ``import elastic[.sub]``: each
  name must import;
* a dotted ``elastic.<name>[.<name>...]`` (``elastic.report_progress()``,
  ``elastic.metrics.allreduce_hook``, ``python -m elastic.train``) must resolve: the longest
  importable module, then attributes. A dotted name glued to a word, a dot, a hyphen or a
  slash before it is not ours (``etcd.elastic.svc``, ``file_sd/elastic.json.example``).

Shell commands (``elastic agent``, ``elastic top``) have no dot after ``elastic`` and are
not Python API, so they are never collected. A module is found without running it
(``python -m elastic.train`` must not start training).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("elastic", "agent", "checkpoints")

_FENCE = re.compile(r"^(?P<fence>```|~~~)[^\n]*\n(?P<body>.*?)^(?P=fence)", re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"(?P<ticks>`+)(?P<body>.+?)(?P=ticks)", re.DOTALL)
_PKG = "|".join(PACKAGES)
_FROM_IMPORT = re.compile(
    rf"^[ \t]*(?:>>>[ \t]*)?from[ \t]+(?P<module>(?:{_PKG})(?:\.\w+)*)[ \t]+import[ \t]+"
    r"(?P<names>\([^)]*\)|[^\n#]*)",
    re.MULTILINE,
)
_IMPORT = re.compile(rf"^[ \t]*(?:>>>[ \t]*)?import[ \t]+(?P<module>(?:{_PKG})(?:\.\w+)*)", re.MULTILINE)
_DOTTED = re.compile(r"(?<![\w./-])elastic(?:\.[A-Za-z_]\w*)+")


@dataclass(frozen=True)
class Reference:
    where: str  # file:line, for the failure message
    target: str  # "module" or "module:name" (an import), or a dotted name
    kind: str  # "import" or "dotted"


def code_chunks(text: str) -> list[tuple[int, str]]:
    """(offset, code) for every fenced block, then every inline span outside them."""
    chunks: list[tuple[int, str]] = []
    blanked = list(text)
    for block in _FENCE.finditer(text):
        chunks.append((block.start("body"), block.group("body")))
        for i in range(block.start(), block.end()):
            if blanked[i] != "\n":
                blanked[i] = " "  # keep offsets, drop the block from the inline search
    prose = "".join(blanked)
    for span in _SPAN.finditer(prose):
        if "\n\n" not in span.group("body"):  # a span never crosses a paragraph
            chunks.append((span.start("body"), span.group("body")))
    return chunks


def references_in(text: str, source: str) -> list[Reference]:
    found: list[Reference] = []
    for offset, code in code_chunks(text):
        def where(position: int) -> str:
            return f"{source}:{text.count(chr(10), 0, offset + position) + 1}"

        for match in _FROM_IMPORT.finditer(code):
            for name in _imported_names(match.group("names")):
                found.append(Reference(where(match.start()), f"{match.group('module')}:{name}", "import"))
        for match in _IMPORT.finditer(code):
            found.append(Reference(where(match.start()), match.group("module"), "import"))
        for match in _DOTTED.finditer(code):
            found.append(Reference(where(match.start()), match.group(0), "dotted"))
    return found


def _imported_names(names: str) -> list[str]:
    """``a, b as c`` or ``(a,\\n b)`` -> ``["a", "b"]`` (comments and aliases dropped)."""
    cleaned = re.sub(r"#[^\n]*", "", names).strip("() \t\n")
    return [part.split()[0] for part in cleaned.split(",") if part.strip()]


def resolve(ref: Reference) -> None:
    """Import or look up the name; raises (ImportError, AttributeError, ...) if the docs are wrong."""
    if ref.kind == "import":
        module, _, name = ref.target.partition(":")
        imported = importlib.import_module(module)
        if name:
            getattr(imported, name)  # what `from module import name` needs (lazy exports too)
        return
    parts = ref.target.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # a parent is not a package
            spec = None
        if spec is not None:
            break
    else:
        raise ImportError(f"no module in {ref.target}")
    if cut == len(parts):
        return  # a module: found, not run
    value: object = importlib.import_module(module)
    for attr in parts[cut:]:
        value = getattr(value, attr)


def all_references() -> list[Reference]:
    return [ref for doc in DOCS for ref in references_in(doc.read_text(), doc.relative_to(ROOT).as_posix())]


def problem(ref: Reference) -> str | None:
    try:
        resolve(ref)
    except Exception as exc:  # noqa: BLE001 - an import that fails in any way breaks the documented call
        return f"{ref.where} documents {ref.target!r}, which does not resolve: {exc}"
    return None


REFERENCES = all_references()
# Resolved while pytest collects: importing torch runs `ldconfig -p` (cuda's library
# finder), and the fast suite lets imports start a process only during collection.
PROBLEMS = {ref: problem(ref) for ref in REFERENCES}


@pytest.mark.parametrize("ref", REFERENCES, ids=[f"{r.where}:{r.target}" for r in REFERENCES])
def test_documented_name_resolves(ref: Reference) -> None:
    if PROBLEMS[ref] is not None:
        pytest.fail(PROBLEMS[ref], pytrace=False)


def test_the_docs_name_the_calls_users_are_told_to_make() -> None:
    """The collector sees what the docs promise (an empty list would pass everything)."""
    targets = {ref.target for ref in REFERENCES}
    assert {"elastic.report_progress", "elastic.ElasticRun", "elastic:check_ledger"} <= targets
    assert "elastic.metrics:prepare_dir" in targets


def test_the_rule_on_a_sample() -> None:
    sample = "\n".join([
        "Run `elastic agent --nnodes 2` or `elastic top`; scrape `etcd-0.etcd.elastic.svc` and",
        "`file_sd/elastic.json.example`. Call `elastic.report_progress(step)` or",
        "`python -m elastic.train`. Prose elastic.not_code is ignored.",
        "",
        "```python",
        "import elastic.metrics",
        "from elastic import (ElasticRun,  # the runner",
        "                     StepInfo as Info)",
        "from checkpoints import SnapshotStore",
        "```",
    ])
    refs = references_in(sample, "sample.md")
    assert sorted((r.kind, r.target) for r in refs) == [
        ("dotted", "elastic.metrics"),
        ("dotted", "elastic.report_progress"),
        ("dotted", "elastic.train"),
        ("import", "checkpoints:SnapshotStore"),
        ("import", "elastic.metrics"),
        ("import", "elastic:ElasticRun"),
        ("import", "elastic:StepInfo"),
    ]
    assert {r.where for r in refs if r.target == "elastic:StepInfo"} == {"sample.md:7"}
