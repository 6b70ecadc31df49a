"""The agent/worker contract lives in one module (``elastic/contract.py``) that both sides import.

Fast and process-free: the source is parsed, not run; the imports are the ones any test pays.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from elastic import contract

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("elastic", "agent", "checkpoints")
CONTRACT = ROOT / "elastic" / "contract.py"
_NAME = re.compile(r"ELASTIC_[A-Z0-9_]*")
DECLARED = {*contract.AGENT_TO_WORKER, *contract.SETTINGS}

# Files that may spell a declared name themselves, and why. Their names must still be
# declared in the contract (checked below), so they cannot drift from it unnoticed.
ALLOWED = {
    # An example of a plain script: it never imports `elastic`, on purpose (its docstring).
    "elastic/examples/tiny_ddp.py",
    # `checkpoints` does not depend on `elastic` (its docstring); equal values are checked below.
    "checkpoints/signing.py",
}


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if p != CONTRACT)


def _spelled_names(path: Path) -> list[tuple[int, str]]:
    """(line, name) for every string constant that is, whole, a contract name or an
    ``ELASTIC_*`` name: a variable spelled out rather than taken from the contract. Prose
    (docstrings, messages, help) that mentions a name in a longer string is not a use."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in DECLARED or _NAME.fullmatch(node.value):
                found.append((node.lineno, node.value))
    return found


def test_every_elastic_variable_is_spelled_only_in_the_contract() -> None:
    stray, undeclared = [], []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for line, name in _spelled_names(path):
            if rel not in ALLOWED:
                stray.append(f"{rel}:{line}: {name!r}")
            elif name not in DECLARED:
                undeclared.append(f"{rel}:{line}: {name!r}")
    assert not stray, "use the constant from elastic.contract instead:\n" + "\n".join(stray)
    assert not undeclared, "declare these in elastic.contract:\n" + "\n".join(undeclared)


def test_the_allow_list_is_still_needed() -> None:
    for rel in ALLOWED:
        assert _spelled_names(ROOT / rel), f"{rel} spells no name any more: take it off ALLOWED"


def test_checkpoints_copy_of_the_key_variables_matches() -> None:
    from checkpoints import signing

    assert (signing.KEY_ENV, signing.KEY_FILE_ENV) == (contract.HMAC_KEY_ENV, contract.HMAC_KEY_FILE_ENV)


def test_the_contract_declares_each_name_once_in_one_section() -> None:
    assert not set(contract.AGENT_TO_WORKER) & set(contract.SETTINGS)
    for name in DECLARED - {contract.METRICS_DIR_ENV}:  # prometheus_client's name, not ours
        assert name.startswith(contract.ENV_PREFIX) and _NAME.fullmatch(name), name
    constants = [v for k, v in vars(contract).items() if k.endswith("_ENV")]
    assert sorted(constants) == sorted(DECLARED)  # every constant registered, none twice
    codes = [contract.EXIT_OK, contract.EXIT_FAILED, contract.USAGE_ERROR_EXIT, contract.DUPLICATE_HANDLE_EXIT]
    assert len(set(codes)) == len(codes) and all(c < contract.SIGNAL_EXIT_BASE for c in codes)
    assert contract.signal_exit(15) == 143
    assert contract.worker_status_file(3) == contract.goodput_worker_file(3) == "worker-3.json"
    assert contract.heartbeat_file(3) == "rank-3" and contract.heartbeat_file(3).startswith(contract.HEARTBEAT_PREFIX)


# (module, attribute, contract attribute): the agent's side first, then the worker's.
SHARED = [
    ("agent.node_agent", "CONTROL_DIR_ENV", "CONTROL_DIR_ENV"),
    ("elastic.inplace.channel", "CONTROL_DIR_ENV", "CONTROL_DIR_ENV"),
    ("agent.node_agent", "TERM_GRACE_ENV", "TERM_GRACE_ENV"),
    ("elastic.trainer", "TERM_GRACE_ENV", "TERM_GRACE_ENV"),
    ("agent.node_agent", "GOODPUT_DIR_ENV", "GOODPUT_DIR_ENV"),
    ("elastic.goodput.recorder", "GOODPUT_DIR_ENV", "GOODPUT_DIR_ENV"),
    ("agent.node_agent", "RECOVERY_ENV", "GOODPUT_RECOVERY_ENV"),
    ("elastic.goodput.recorder", "RECOVERY_ENV", "GOODPUT_RECOVERY_ENV"),
    ("agent.node_agent", "MULTIPROC_ENV", "METRICS_DIR_ENV"),
    ("elastic.metrics.export", "MULTIPROC_ENV", "METRICS_DIR_ENV"),
    ("agent.node_agent", "AGENT_PID_ENV", "AGENT_PID_ENV"),
    ("agent.worker_boot", "AGENT_PID_ENV", "AGENT_PID_ENV"),
    ("agent.warm_start", "READY_FD_ENV", "STANDBY_READY_FD_ENV"),
    ("agent.warm_worker", "READY_FD_ENV", "STANDBY_READY_FD_ENV"),
    ("agent.warm_worker", "STARTED_AT_ENV", "WORKER_STARTED_AT_ENV"),
    ("elastic.metrics.worker", "STARTED_AT_ENV", "WORKER_STARTED_AT_ENV"),
    ("elastic.worker_env", "SETUP_WORLD_ENV", "SETUP_WORLD_ENV"),
    ("elastic.heartbeat", "HEARTBEAT_DIR_ENV", "HEARTBEAT_DIR_ENV"),
    ("elastic.inplace.channel", "OFFER_FILE", "OFFER_FILE"),
    ("elastic.inplace.channel", "WAKE_FIFO", "WAKE_FIFO"),
    ("elastic.goodput.files", "JOB_FILE", "GOODPUT_JOB_FILE"),
    ("agent.policy", "USER_ERROR_EXIT", "USAGE_ERROR_EXIT"),
    ("elastic.trainer", "USAGE_ERROR_EXIT", "USAGE_ERROR_EXIT"),
    ("elastic.inplace.membership", "DUPLICATE_HANDLE_EXIT", "DUPLICATE_HANDLE_EXIT"),
]


@pytest.mark.parametrize("module, attribute, name", SHARED, ids=[f"{m}.{a}" for m, a, _ in SHARED])
def test_both_sides_hold_the_contracts_own_object(module: str, attribute: str, name: str) -> None:
    assert getattr(importlib.import_module(module), attribute) is getattr(contract, name)


@pytest.mark.parametrize("module", ["agent.node_agent", "agent.policy", "agent.watchdog", "agent.worker_boot",
                                    "elastic.trainer", "elastic.heartbeat", "elastic.inplace.channel",
                                    "elastic.inplace.membership", "elastic.goodput.files"])
def test_both_sides_import_the_one_contract_module(module: str) -> None:
    """Identity of the module, not only of its (interned) strings: one source of truth."""
    assert vars(importlib.import_module(module))["contract"] is contract


def test_the_docs_table_is_the_contracts() -> None:
    text = (ROOT / "docs" / "agent.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- contract:env begin -->\n(.*?)<!-- contract:env end -->", text, re.DOTALL)
    assert found, "docs/agent.md lost its contract table markers"
    assert found.group(1) == contract.markdown_table(), (
        "docs/agent.md's contract table is stale: paste `python -m elastic.contract` between its markers")
