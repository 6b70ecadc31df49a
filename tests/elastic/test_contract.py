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
DECLARED = {*contract.AGENT_TO_WORKER, *contract.TORCHRUN, *contract.SETTINGS, *contract.AGENT_FLAG_TWINS}

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
    sections = [set(contract.AGENT_TO_WORKER), set(contract.TORCHRUN), set(contract.SETTINGS)]
    assert sum(map(len, sections)) == len(set().union(*sections)), "a name in two sections"
    for name in DECLARED - set(contract.TORCHRUN) - {contract.METRICS_DIR_ENV}:  # prometheus_client's, torch's
        assert name.startswith(contract.ENV_PREFIX) and _NAME.fullmatch(name), name
    constants = [v for k, v in vars(contract).items() if k.endswith("_ENV")]
    assert sorted(constants) == sorted(set().union(*sections))  # every constant registered, none twice
    codes = [contract.EXIT_OK, contract.EXIT_FAILED, contract.USAGE_ERROR_EXIT, contract.FINAL_SNAPSHOT_LOST_EXIT,
             contract.DUPLICATE_HANDLE_EXIT, contract.LEFT_BEHIND_EXIT]
    assert len(set(codes)) == len(codes) and all(c < contract.SIGNAL_EXIT_BASE for c in codes)
    assert contract.signal_exit(15) == 143
    assert contract.worker_status_file(3) == contract.goodput_worker_file(3) == "worker-3.json"
    assert contract.heartbeat_file(3) == "rank-3" and contract.heartbeat_file(3).startswith(contract.HEARTBEAT_PREFIX)


# ---------------------------------------------------------------- no copies of the contract's names

# Modules that still hold a module-level copy of a contract name, and why.
ALIASES_ALLOWED = {
    # Its two exit-code copies go with its rewrite into one pure decision (issue 38, item 2),
    # which another change owns; they are the contract's own objects meanwhile.
    "agent/node/policy.py",
}


def _aliases(path: Path) -> list[str]:
    """Module-level ``X = contract.Y`` (or ``= elastic.contract.Y``) and ``from ...contract
    import Y as X``: a second name for a contract name, which a rename would leave behind."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for value in values:
                if isinstance(value, ast.Attribute) and ast.unparse(value.value) in ("contract", "elastic.contract"):
                    found.append(f"{node.lineno}: {ast.unparse(node).splitlines()[0]}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("contract"):
            found += [f"{node.lineno}: {a.name} as {a.asname}" for a in node.names if a.asname not in (None, a.name)]
    return found


def test_no_module_keeps_its_own_name_for_a_contract_name() -> None:
    found = [f"{path.relative_to(ROOT).as_posix()}:{line}" for path in _sources()
             if path.relative_to(ROOT).as_posix() not in ALIASES_ALLOWED for line in _aliases(path)]
    assert not found, "import the contract and use its name (contract.FOO) instead:\n" + "\n".join(found)
    for rel in ALIASES_ALLOWED:
        assert _aliases(ROOT / rel), f"{rel} keeps no alias any more: take it off ALIASES_ALLOWED"


# ---------------------------------------------------------------- every read of the environment

# Variables that are neither ours nor torchrun's: read where they are needed, by their own name.
FOREIGN = {
    "OMP_NUM_THREADS",  # the workers' thread count (agent.local.local_cluster, agent.worker.warm_worker)
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",  # which GPUs a worker sees (elastic.metrics)
    "NODE_NAME",  # DCGM exporter's hostname label, as Kubernetes sets it (elastic.metrics.rank_info)
    "COLUMNS",  # the console's width (agent.local.local_cluster)
    "XDG_STATE_HOME",  # where `elastic etcd` keeps its data by default (agent.tools.etcd_cmd)
    "GRPC_VERBOSITY",  # grpc's own log level, quieted by default (agent.etcd)
    "GLOO_SOCKET_IFNAME",  # gloo's own interface setting (agent.node.netif sets it, agent.node.health_watch checks it)
}

# Files that read a variable of the worker's contract from their *own* environment, not a
# worker's, or read one whose name is computed; each says why. Any other read of a
# contract variable goes through elastic.worker_env (WorkerEnv), so that it has one parser.
READS_ALLOWED = {
    "agent/node/health.py": "its thresholds, each read by its contract name (contract.HEALTH_*) through one helper",
    "elastic/worker_env.py": "the one parser of what a worker reads",
    "agent/node/node_agent.py": "passes its own TORCH_NCCL_ASYNC_ERROR_HANDLING on to its workers",
    "agent/node/launch.py": "its own job key file and every flag's ELASTIC_/PET_ twin (names computed)",
    "agent/worker/warm_worker.py": "the standby's ready pipe, popped before it becomes a worker",
    "agent/worker/fork_template.py": "the template's reply pipe, popped at its start",
    "agent/rendezvous/registry.py": "the agent's own node name (--node-name's twin), in the agent",
    "agent/rendezvous/options.py": "the rendezvous' options by name (computed)",
    "agent/node/nnodes.py": "--nnodes' twins, ELASTIC_NNODES and torchrun's PET_NNODES (computed)",
    "checkpoints/signing.py": "the job key (checkpoints does not import elastic)",
    "agent/node/netif.py": "gloo's and NCCL's *_SOCKET_IFNAME, which a user may set, by their own names",
    "agent/local/zygote.py": "what the loader and the interpreter read at a start (LD_PRELOAD, PYTHONPATH...), "
                             "by their own names, to tell a process it can fork from one it must exec",
}

_ENVIRONS = ("os.environ", "environ", "env")


def _env_key(node: ast.AST) -> ast.AST | None:
    """The key of an environment read (``os.environ.get(k)``, ``environ[k]``, ``k in env``,
    ``os.getenv(k)``), or None if ``node`` is no such read."""
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if ast.unparse(func) == "os.getenv":
            return node.args[0]
        if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") \
                and ast.unparse(func.value).endswith(_ENVIRONS):
            return node.args[0]
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
            and ast.unparse(node.value).endswith(_ENVIRONS):
        return node.slice
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
            and ast.unparse(node.comparators[0]).endswith(_ENVIRONS):
        return node.left
    return None


def _env_reads(path: Path) -> list[tuple[int, str]]:
    """(line, what) for every environment read in ``path`` that bypasses the contract."""
    worker_names = {k for k, v in vars(contract).items()
                    if isinstance(v, str) and (v in contract.AGENT_TO_WORKER or v in contract.TORCHRUN)}
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        key = _env_key(node)
        if key is None:
            continue
        text = ast.unparse(key)
        if isinstance(key, ast.Constant):
            if key.value not in FOREIGN:
                found.append((node.lineno, f"{text}: declare it in elastic.contract"))
        elif isinstance(key, ast.Attribute) and ast.unparse(key.value) == "contract":
            if key.attr in worker_names:
                found.append((node.lineno, f"{text}: a worker reads it through elastic.worker_env.read()"))
        else:
            found.append((node.lineno, f"{text}: a name the contract does not declare"))
    return found


def test_every_read_of_the_environment_goes_through_the_contract() -> None:
    """A new ``os.environ.get("FOO")`` fails here: declare FOO in the contract, and if a
    worker reads what its agent sets, read it through ``elastic.worker_env``."""
    found = [f"{path.relative_to(ROOT).as_posix()}:{line}: {what}" for path in _sources()
             if path.relative_to(ROOT).as_posix() not in {*READS_ALLOWED, *ALLOWED}
             for line, what in _env_reads(path)]
    assert not found, "\n".join(found)
    for rel in READS_ALLOWED:
        assert _env_reads(ROOT / rel), f"{rel} reads nothing the rule flags: take it off READS_ALLOWED"


def test_the_rule_sees_the_reads_it_is_meant_to_catch(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom elastic import contract\n"
                   "a = os.environ.get('MY_KNOB')\nb = os.environ[contract.RANK_ENV]\nc = 'FOO' in os.environ\n"
                   "d = os.getenv(contract.HEARTBEAT_DIR_ENV)\ne = os.environ.get(contract.LOG_LEVEL_ENV)\n")
    assert [line for line, _ in _env_reads(bad)] == [3, 4, 5, 6]  # a setting (line 7) is read where used


# ---------------------------------------------------------------- the agent's flags and their twins


def test_every_agent_flag_has_its_declared_twin_and_every_twin_a_flag() -> None:
    from agent.node.launch import build_agent_parser, flag_actions

    flags = {contract.flag_twin(action.dest): action.dest for action in flag_actions(build_agent_parser())}
    assert not flags.keys() - contract.AGENT_FLAG_TWINS.keys(), "declare these twins in elastic.contract"
    assert not contract.AGENT_FLAG_TWINS.keys() - flags.keys(), "no agent flag has these twins any more"
    assert flags == contract.AGENT_FLAG_TWINS
    assert contract.flag_twin("nproc_per_node") == "ELASTIC_NPROC_PER_NODE"
    assert {contract.NODE_NAME_ENV, contract.SNAPSHOT_DIR_ENV, contract.TERM_GRACE_ENV, contract.NNODES_ENV,
            contract.METRICS_PORT_ENV} <= contract.AGENT_FLAG_TWINS.keys()  # names that are twins and more


def test_worker_states_are_str_enums_whose_values_are_the_wire_format() -> None:
    import json

    from elastic.inplace.channel import WorkerStatus

    assert [m.value for m in contract.WorkerMode] == ["in_place", "restart"]
    assert [s.value for s in contract.WorkerState] == ["starting", "joining", "training", "reforming"]
    typed = WorkerStatus(pid=1, mode=contract.WorkerMode.IN_PLACE, state=contract.WorkerState.JOINING).to_json()
    assert typed == WorkerStatus(pid=1, mode="in_place", state="joining").to_json()
    assert json.loads(WorkerStatus(pid=1).to_json())["state"] == "starting"
    assert WorkerStatus.from_json(typed).state == contract.WorkerState.JOINING and f"{contract.WorkerMode.RESTART}" == "restart"


@pytest.mark.parametrize("module", ["agent.node.node_agent", "agent.node.policy", "agent.node.watchdog", "agent.worker.worker_boot",
                                    "agent.node.workers", "agent.node.channel", "elastic.trainer", "elastic.heartbeat",
                                    "elastic.inplace.channel", "elastic.inplace.membership", "elastic.goodput.files",
                                    "elastic.worker_env"])
def test_both_sides_import_the_one_contract_module(module: str) -> None:
    """Identity of the module, not only of its (interned) strings: one source of truth."""
    assert vars(importlib.import_module(module))["contract"] is contract


def test_the_docs_table_is_the_contracts() -> None:
    text = (ROOT / "docs" / "agent.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- contract:env begin -->\n(.*?)<!-- contract:env end -->", text, re.DOTALL)
    assert found, "docs/agent.md lost its contract table markers"
    assert found.group(1) == contract.markdown_table(), (
        "docs/agent.md's contract table is stale: paste `python -m elastic.contract` between its markers")
