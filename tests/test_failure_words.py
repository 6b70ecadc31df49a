"""A broken world is told by the error's kind, never by lists of gloo's words (issue 54).

The worker classifies its error once, by type and origin (``elastic/collectives.py``), and the
agent reads the kind (``contract.FailureKind``). A list of gloo's or NCCL's phrases elsewhere is
how ``agent/node/policy.py`` once took a script's own ``RuntimeError("timeout")`` for a peer's
doing. This parses every module of the three packages and fails on a new such list. The ones
left say why; each is a place to move to the kind, not one to copy.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("elastic", "agent", "checkpoints")
PHRASES = ("closed by peer", "connection reset", "connection closed", "broken pipe", "pair.cc", "connectfullmesh")
ALLOWED = {
    # torch 2.14 raises gloo's lost peer untyped: read here only, for an error torch itself raised
    "elastic/torch_untyped.py",
}


@functools.cache
def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _word_lists(path: Path) -> list[int]:
    """Lines of tuples, lists or sets of two or more strings that name one of gloo's phrases."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            words = [e.value.lower() for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(words) >= 2 and any(p in w for w in words for p in PHRASES):
                found.append(node.lineno)
    return found


def test_no_module_tells_a_broken_world_by_a_list_of_gloos_words() -> None:
    stray = [f"{path.relative_to(ROOT).as_posix()}:{line}"
             for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))
             if path.relative_to(ROOT).as_posix() not in ALLOWED for line in _word_lists(path)]
    assert not stray, ("classify the error where it is caught (elastic.collectives.failure_kind) and read its "
                       "kind, not its words:\n" + "\n".join(stray))


def test_the_allow_list_is_still_needed() -> None:
    for rel in ALLOWED:
        assert _word_lists(ROOT / rel), f"{rel} keeps no list of gloo's words any more: take it off ALLOWED"


# ---------------------------------------------------------------------- any error told apart by its words

# The modules that read a third party's untyped error by its words, each the only one for its party,
# with a guard test that fails once the party words (or types) it otherwise.
UNTYPED_READERS = {
    "elastic/torch_untyped.py",  # torch: tests/elastic/test_collectives.py, tests/elastic/test_plan.py
    "agent/etcd/grpc_untyped.py",  # gRPC: tests/agent/test_grpc_untyped.py
}
_TEXT_TESTS = {"startswith", "endswith", "find", "index", "count", "search", "match", "fullmatch", "findall"}
_ERROR_NAMES = {"e", "exc", "err", "error", "rpc", "failure"}


def _says(node: ast.AST, names: set[str], copies: frozenset[str] = frozenset()) -> bool:
    """``str(e)``, ``e.details()``, ``repr(e)``, ``e.args``, or any of them ``.lower()``ed, for an error
    ``e``; or a variable ``copies`` names, assigned one of them."""
    if isinstance(node, ast.Name):
        return node.id in copies
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("lower", "strip"):
        return _says(node.func.value, names, copies)
    if isinstance(node, ast.BoolOp):
        return any(_says(v, names, copies) for v in node.values)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("str", "repr") \
            and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in names:
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "details":
        return True
    return isinstance(node, ast.Attribute) and node.attr == "args" and isinstance(node.value, ast.Name) \
        and node.value.id in names


def _words_read(tree: ast.AST) -> list[int]:
    """Lines that test an error's words: ``"x" in str(e)``, ``str(e).startswith(...)``, ``re.search(p, str(e))``."""
    names = set(_ERROR_NAMES)
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    copied: set[str] = set()  # variables an error's words were put in first: ``details = (rpc.details() or "").strip()``
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and isinstance(
                    node.value, ast.Tuple) else [(target, node.value)]
                copied.update(t.id for t, v in pairs if isinstance(t, ast.Name) and _says(v, names))
    copies = frozenset(copied)
    found: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_says(c, names, copies) for c in node.comparators):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _TEXT_TESTS \
                and (_says(node.func.value, names, copies) or any(_says(a, names, copies) for a in node.args)):
            found.append(node.lineno)
    return sorted(found)


def test_no_module_tells_errors_apart_by_their_words() -> None:
    """Issue 54's "done": an error is told apart by its type (an exception class, a
    contract.FailureKind, a FaultCause, a checkpoints ProblemKind), never by its message, except
    in the one module per third party whose errors have no type for it."""
    stray = [f"{path.relative_to(ROOT).as_posix()}:{line}"
             for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))
             if path.relative_to(ROOT).as_posix() not in UNTYPED_READERS
             for line in _words_read(_tree(path))]
    assert not stray, ("tell the error apart by its type (raise a typed error, carry a kind), or read a third "
                       "party's untyped words in its one module (elastic/torch_untyped.py, "
                       "agent/etcd/grpc_untyped.py):\n" + "\n".join(stray))


def test_the_check_catches_what_it_is_for() -> None:
    caught = _words_read(ast.parse(
        "try:\n    f()\nexcept OSError as oops:\n    if 'No space' in str(oops):\n        pass\n"
        "def g(exc):\n    return str(exc).lower().startswith('round')\n"
        "def h(rpc):\n    return 'token' in (rpc.details() or '').lower()\n"
        "def k(exc):\n    code, text = exc.code(), (exc.details() or '').strip()\n    return 'failed' in text\n"))
    assert caught == [4, 7, 9, 12], caught
    assert _words_read(ast.parse("def ok(exc):\n    return isinstance(exc, OSError) and exc.errno == 28\n")) == []
