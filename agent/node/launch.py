"""``elastic agent``: torchrun's flags and rendezvous backends, our node agent's judgement.

The parser is torchrun's own (``torch.distributed.run.get_args_parser``) plus a few flags,
and torchrun's ``config_from_args`` turns it into a launch config; the agent then runs
its own loop (:mod:`agent.node.node_agent`) instead of torch's ``LocalElasticAgent``. Every flag
``--foo-bar`` may also come from the environment as ``ELASTIC_FOO_BAR`` (torchrun's
``PET_FOO_BAR`` still works too), which is what container and systemd deployments want.
Settings reach the agent and the rendezvous handler as explicit objects: nothing is
passed through this process's environment.

Bad input ends the agent before anything starts (no etcd connection, no worker) with one
line, ``error: --flag VALUE: what is wrong; what to pass``, and exit 2: every value is
checked as it is parsed, whether it came from the command line or from the environment.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import logging
import os
import re
import shlex
import signal
import socket
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

from elastic import contract
from elastic.atomic_file import write_atomically
from agent.rendezvous.keepout import BACKOFF_BASE_S, BACKOFF_CAP_S
from agent.rendezvous.registry import DEFAULT_LEASE_TTL, default_node_name

from agent.node.agent_dir import (LOGS, MARKER, AgentDir, AgentDirError, claim_agent_dir, claim_memory_dir,
                                  release_memory_dir)
from agent.tools.etcd_args import DEFAULT_ENDPOINT
from agent.node.nnodes import apply_nnodes, environment_nnodes
from agent.node.preflight import target_problem
from agent.node.settings import AgentSettings
from agent.node.states import DEFAULT_TERM_GRACE_S

if TYPE_CHECKING:
    from agent.node.metrics import AgentMetrics
    from agent.node.rendezvous_api import HandlerSide

# Outside 9100-9999, which Prometheus' default-port list has filled (9400 is NVIDIA's DCGM
# exporter, on the very GPU nodes we run on), and clear of Kubernetes' 10249-10259, Zabbix's
# 10050-10051 and Ray's 10001.
DEFAULT_METRICS_PORT = 10400
AUTO_PORT = -1  # --metrics-port auto: bind port 0 and say the port the kernel picked
METRICS_PORT_FILE = "metrics.port"  # in --agent-dir: the port /metrics is bound to
DEFAULT_MAX_RESTARTS = 3
# A run id becomes an etcd key segment and a directory name (snapshots, logs), so no '/',
# no '..', nothing a shell or a path would read differently.
RUN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
RUN_ID_RULE = "1-128 letters, digits, '.', '_' or '-', not starting with '.'"
NPROC_KINDS = ("auto", "cpu", "gpu", "xpu")  # torchrun counts these itself


def build_agent_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "elastic agent"
    parser.description = (
        "Run torchrun's elastic agent with etcd-v3 rendezvous, peer-loss detection in seconds, "
        "a hang watchdog and a Prometheus endpoint. Every --flag can also be set as ELASTIC_FLAG."
    )
    ours = parser.add_argument_group("elastic agent (beyond torchrun)")
    ours.add_argument("--node-name", "--node_name", dest="node_name", default=None,
                      help="this node's name in the registry and logs (default: hostname-pid)")
    ours.add_argument("--metrics-port", "--metrics_port", dest="metrics_port", type=_port,
                      default=DEFAULT_METRICS_PORT, help=f"Prometheus /metrics port (default {DEFAULT_METRICS_PORT}; 0 = off; "
                           f"auto = a free port the kernel picks, written to {METRICS_PORT_FILE} in --agent-dir "
                           "and to the node registry)")
    ours.add_argument("--metrics-addr", "--metrics_addr", dest="metrics_addr", default="127.0.0.1",
                      help="address to bind /metrics to (default 127.0.0.1; use the node's private IP "
                           "for a scraper, never 0.0.0.0 on a public interface)")
    ours.add_argument("--lease-ttl", "--lease_ttl", dest="lease_ttl", type=_lease_ttl, default=DEFAULT_LEASE_TTL,
                      help=f"seconds a silent node stays in the registry (default {DEFAULT_LEASE_TTL}, min 2): "
                           "how fast a frozen or cut-off node is written off")
    ours.add_argument("--hang-timeout", "--hang_timeout", dest="hang_timeout", type=_hang_timeout, default=None,
                      metavar="SECONDS|auto",
                      help="restart workers when no local rank finished a step for this long "
                           "(default auto: 20x the median step time, at least 60 s)")
    ours.add_argument("--snapshot-dir", "--snapshot_dir", dest="snapshot_dir", type=_snapshot_location, default=None,
                      help="shared snapshot directory (or s3://bucket/prefix, or DIR,s3://... for two tiers), "
                           "passed to workers as ELASTIC_SNAPSHOT_DIR")
    ours.add_argument("--warm-start", "--warm_start", dest="warm_start", action=argparse.BooleanOptionalAction,
                      default=True,
                      help="fork every worker from one pre-imported template per node, so a started or "
                           "restarted worker skips importing torch (default on; --no-warm-start for cold starts)")
    ours.add_argument("--in-place", "--in_place", dest="in_place", action=argparse.BooleanOptionalAction,
                      default=True,
                      help="let ElasticRun workers survive a peer lost or a node joining, in their own "
                           "processes and from memory (default on, with --rdzv-backend etcd-v3 and a torch "
                           "that can reconfigure a process group; --no-in-place restarts them instead)")
    ours.add_argument("--agent-dir", "--agent_dir", dest="agent_dir", default=None, metavar="DIR",
                      help="where the agent keeps its run-time files: heartbeats, worker metrics, the in-place "
                           "channel and status.json (round, ranks) for tools; a new or empty directory, or one "
                           f"an earlier agent marked with {MARKER} (default: a temporary directory, removed "
                           "at exit)")
    ours.add_argument("--hang-startup-timeout", "--hang_startup_timeout", dest="hang_startup_timeout",
                      type=_positive_seconds, default=600.0, metavar="SECONDS",
                      help="once this node has seen the job make progress, how long a new worker group may "
                           "take to make its first (imports, restore, compilation; default 600)")
    ours.add_argument("--keep-out-s", "--keep_out_s", dest="keep_out_s", type=_positive_seconds,
                      default=BACKOFF_BASE_S, metavar="SECONDS",
                      help="how long a node is kept out of the job's rounds the first time it is (a crash loop, a "
                           "straggler, suspect hardware named by the replica vote, a failed health check), "
                           f"doubled at each strike after, up to {BACKOFF_CAP_S:g} (default {BACKOFF_BASE_S:g}; raise it "
                           "where a node kept out needs a person's look before it takes part again)")
    ours.add_argument("--term-grace", "--term_grace", dest="term_grace", type=_positive_seconds,
                      default=DEFAULT_TERM_GRACE_S, metavar="SECONDS",
                      help="when the agent gets SIGTERM (a pre-emption), how long its workers have to finish the "
                           "step in flight and write a snapshot before it SIGKILLs them (default "
                           f"{DEFAULT_TERM_GRACE_S:g}: inside Kubernetes' 30 s terminationGracePeriodSeconds)")
    _check_torchrun_flags(parser)
    # torchrun's PET_* variables (what Kubeflow sets) keep precedence over our defaults
    own = {"rdzv_backend": "etcd-v3", "rdzv_endpoint": DEFAULT_ENDPOINT, "max_restarts": DEFAULT_MAX_RESTARTS}
    parser.set_defaults(**{k: v for k, v in own.items() if f"PET_{k.upper()}" not in os.environ})
    _defaults_from_env(parser, os.environ)
    _name_env_defaults(parser, os.environ)
    parser.set_defaults(nnodes=environment_nnodes(os.environ))  # --nnodes > ELASTIC_NNODES > PET_NNODES
    return one_line_errors(parser)


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse's errors as the project's one line and exit 2: no usage block (``--help``
    has it), and the flag named first, as in ``error: --lease-ttl 1: ...``."""
    def error(message: str) -> NoReturn:
        flag = re.match(r"argument (-[^/:\s]+)(?:/[^:\s]+)*: ", message)
        line = f"{flag[1]} {message[flag.end():]}" if flag else f"{message}; see {parser.prog} --help"
        parser.exit(2, f"error: {line}\n")

    parser.error = error  # type: ignore[method-assign]  # argparse has no hook for its error line
    return parser


def shown(text: str) -> str:
    """``text`` as an error line quotes it: shell-quoted, so it can be pasted back, unless it
    holds a character that would break the one line (a newline, U+2028...) or not show
    (a control character); then Python's escaped form, which keeps it on one line."""
    return shlex.quote(text) if text.isprintable() else repr(text)


class _Refused(argparse.ArgumentTypeError):
    """A value a flag cannot take; ``why`` reads after the value and says what to pass."""

    def __init__(self, text: str, why: str) -> None:
        super().__init__(f"{shown(text)}: {why}")
        self.why = why


class _FromEnv(str):
    """A flag's default read from the environment, so that a refusal names the variable."""

    variable: str

    def __new__(cls, value: str, variable: str) -> "_FromEnv":
        text = super().__new__(cls, value)
        text.variable = variable
        return text


def flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The agent's flags that an ``ELASTIC_<FLAG>`` variable may set (all but ``--help``);
    ``elastic.contract.AGENT_FLAG_TWINS`` declares each one's twin."""
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _defaults_from_env(parser: argparse.ArgumentParser, env: "os._Environ[str] | dict[str, str]") -> None:
    """``ELASTIC_FOO_BAR`` sets the default of ``--foo-bar`` (a flag given still wins)."""
    for action in flag_actions(parser):
        value = env.get(contract.flag_twin(action.dest))
        if value is None:
            continue
        if action.nargs == 0:  # a switch
            parser.set_defaults(**{action.dest: value.strip().lower() in ("1", "true", "yes", "on")})
        else:
            parser.set_defaults(**{action.dest: value})  # argparse applies `type` to string defaults
        action.required = False


def _name_env_defaults(parser: argparse.ArgumentParser, env: "os._Environ[str] | dict[str, str]") -> None:
    """Defaults from ``ELASTIC_*`` or torchrun's ``PET_*`` go through the flag's own check
    (argparse applies ``type`` to string defaults), and a refusal names the variable to fix:
    ``error: ELASTIC_NPROC_PER_NODE=0: ...``."""
    for action in parser._actions:
        if not callable(action.type) or not isinstance(action.default, str):
            continue  # (a str type names one of argparse's registry: this parser registers none)
        for variable in (contract.flag_twin(action.dest), "PET_" + action.dest.upper()):
            if env.get(variable) == action.default:
                parser.set_defaults(**{action.dest: _FromEnv(action.default, variable)})
                action.type = _naming_variable(parser, action.type)
                break


def _naming_variable(parser: argparse.ArgumentParser, check: Callable[[str], Any]) -> Callable[[str], Any]:
    @functools.wraps(check)
    def checked(text: str) -> Any:
        try:
            return check(str(text))  # a plain str from here on
        except (argparse.ArgumentTypeError, ValueError) as exc:
            if not isinstance(text, _FromEnv):
                raise
            why = getattr(exc, "why", f"is not a valid {getattr(check, '__name__', 'value')}")
            parser.exit(2, f"error: {text.variable}={shown(text)}: {why}\n")

    return checked


def _check_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    """torchrun's own flags, checked as they are parsed: torchrun would take these values
    and fail later with a traceback (or, for a run id, write odd etcd keys and paths)."""
    checks = {"nproc_per_node": _nproc_per_node, "max_restarts": _max_restarts,
              "rdzv_backend": _rdzv_backend, "rdzv_id": _run_id}
    for action in parser._actions:
        if action.dest in checks:
            action.type = checks[action.dest]


def _nproc_per_node(text: str) -> str:
    """torchrun's values, kept as text for its ``config_from_args``: a count, or a kind of
    device it counts itself (a renamed PrivateUse1 backend too)."""
    import torch

    try:
        count = int(text)
    except ValueError:
        if text in (*NPROC_KINDS, torch._C._get_privateuse1_backend_name()):
            return text
        count = 0
    if count < 1:
        raise _Refused(text, f"must be a positive integer or one of {', '.join(NPROC_KINDS)} "
                             "(workers on this node; auto: one per GPU, else per CPU)")
    return text


def _max_restarts(text: str) -> int:
    value = _number(int, text, "must be an integer >= 0 (restarts before the job fails; 0: none)")
    if value < 0:
        raise _Refused(text, "must be an integer >= 0 (restarts before the job fails; 0: none)")
    return value


def _rdzv_backend(text: str) -> str:
    known = _registered_backends()
    if known and text not in known:
        raise _Refused(text, f"is not a registered rendezvous backend; use one of {', '.join(known)}")
    return text


def _registered_backends() -> list[str]:
    """torch's registry (its own backends and the ``torchrun.handlers`` entry points, ours
    included); empty where a torch keeps it elsewhere, and then nothing is refused here."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    return sorted(getattr(rendezvous_handler_registry, "_registry", {}))


def _run_id(text: str) -> str:
    if not RUN_ID.fullmatch(text):
        raise _Refused(text, f"a run id names etcd keys and directories, so use {RUN_ID_RULE}")
    return text


def _snapshot_location(text: str) -> str:
    """A misspelt ``s3://`` (``s3:/x``, ``S3://x``) is refused as it is parsed: taken for a
    directory, the job snapshotted into ``./s3:/x/`` and exited 0."""
    from checkpoints.location import MisspeltLocationError, check_spelling

    try:
        check_spelling(text)
    except MisspeltLocationError as exc:
        raise _Refused(text, exc.why) from None
    return text


def _number(kind: Callable[[str], float], text: str, why: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise _Refused(text, why) from None


def _port(text: str) -> int:
    if text.strip().lower() == "auto":
        return AUTO_PORT
    value = _number(int, text, "is not a port (0-65535; 0 turns metrics off; auto picks a free one)")
    if not 0 <= value <= 65535:
        raise _Refused(text, "is not a port (0-65535; 0 turns metrics off)")
    return value


def _lease_ttl(text: str) -> int:
    value = _number(int, text, "must be whole seconds, at least 2 (etcd's minimum lease TTL)")
    if value < 2:
        raise _Refused(text, "is below etcd's minimum lease TTL of 2 s; give at least 2")
    return value


def _hang_timeout(text: str) -> float | None:
    if text.strip().lower() == "auto":
        return None
    value = _number(float, text, "must be positive seconds, or auto")
    if not value > 0:
        raise _Refused(text, "must be positive seconds, or auto")
    return value


def package_version() -> str:
    try:
        return version("elastic-trainer")
    except PackageNotFoundError:
        return "0+unknown"


def _positive_seconds(text: str) -> float:
    value = _number(float, text, "must be positive seconds")
    if not value > 0:
        raise _Refused(text, "must be positive seconds")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_agent_parser()
    args = parser.parse_args(argv)
    node = args.node_name or default_node_name()
    _configure_logging(node)
    args.nnodes = apply_nnodes(parser, args.nnodes, os.environ)
    if args.run_path:
        parser.exit(2, "error: --run-path is not supported by elastic agent (workers run as their own "
                       "processes); drop it and give the script as usual\n")
    if getattr(args, "virtual_local_rank", False):
        parser.exit(2, "error: --virtual-local-rank is not supported by elastic agent; drop it\n")
    _check_devices(parser, args.nproc_per_node)
    snapshot_dir = _checked_snapshot_dir(parser, args.snapshot_dir)
    work = _claimed_agent_dir(parser, args.agent_dir)
    memory = claim_memory_dir(work.path)  # the workers' own copies, outliving them (elastic.inplace.memory_copies)
    try:
        problem = target_problem(args.training_script, module=args.module, no_python=args.no_python)
        if problem:  # it would fail at every start, each with a traceback: say it once, start nothing
            parser.exit(2, f"error: {problem}\n")
        return _run(parser, args, node, snapshot_dir, work.path, memory)
    finally:
        release_memory_dir(memory)  # the copies end with the job: shared memory is the node's RAM
        work.release()  # a temporary directory goes; a given --agent-dir stays


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, node: str, snapshot_dir: Path | str | None,
         work: Path, memory: Path | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    from torch.distributed.run import config_from_args

    from elastic.metrics.multiprocess import prepare_dir
    from agent.rendezvous.ended import FAILED, SUCCEEDED
    from agent.rendezvous.handler import RendezvousStateError

    from agent.node.metrics import AgentMetrics
    from agent.node.node_agent import AgentSignal, AgentSpec, JobFinishedError, NodeAgent, exit_code_for
    from agent.rendezvous.agent_side import handler_side

    _standalone(args)
    _stacks_on_sigusr1()
    if not args.log_dir:  # torch would make a torchelastic_* directory in $TMPDIR and never remove it
        args.log_dir = str(work / LOGS)
    try:
        config, cmd, cmd_args = config_from_args(args)
    except ValueError as exc:  # torchrun's own checks, e.g. --rdzv-conf or --local-ranks-filter syntax
        parser.exit(2, f"error: {exc}\n")
    settings = AgentSettings(
        node_name=node, metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
        lease_ttl=args.lease_ttl, hang_timeout=args.hang_timeout, warm_start=args.warm_start,
        in_place=args.in_place, snapshot_dir=snapshot_dir, work_dir=work, memory_dir=memory,
        hang_startup_timeout=args.hang_startup_timeout, store_host=config.local_addr,
        graceful_stop=float(getattr(args, "shutdown_timeout", None) or 5.0), keep_out_s=args.keep_out_s,
    )
    settings.heartbeat_dir.mkdir(exist_ok=True)
    prepare_dir(settings.metrics_dir)
    metrics = AgentMetrics(node, package_version(), settings.metrics_dir)
    if settings.metrics_port:
        try:
            url = metrics.serve(settings.metrics_addr, max(0, settings.metrics_port), _advertised(settings.metrics_addr))
            _say_metrics_port(work, url)
        except OSError as exc:
            parser.exit(2, f"error: --metrics-port {settings.metrics_port} on {settings.metrics_addr}: "
                           f"{exc.strerror}; pick a free port or 0 to turn metrics off\n")

    # Our handler reads these from its config: explicit, not inherited through os.environ.
    rdzv_configs = dict(config.rdzv_configs)
    if config.rdzv_backend in ("etcd-v3", "etcd-v3-dynamic"):
        rdzv_configs.setdefault("node_name", node)
        rdzv_configs.setdefault("lease_ttl", settings.lease_ttl)
    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                  run_id=config.run_id, min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                  local_addr=config.local_addr, **rdzv_configs)
    handler = get_rendezvous_handler(params)
    side = handler_side(handler)  # what this launcher asks of it beyond torch's contract
    fenced = _start_rounds_above_the_fence(side, snapshot_dir, config.run_id, rdzv_configs.get("hmac_key_file"))
    if fenced:
        parser.exit(2, f"error: {fenced}\n")
    _export_spare(side, metrics)
    settings = _with_network(settings, config.rdzv_endpoint, config.local_addr, args.nnodes, rdzv_configs)
    command = _worker_command(cmd, cmd_args, with_python=not args.no_python, module=args.module)
    spec = AgentSpec(role=config.role, nproc=config.nproc_per_node, command=command,
                     max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
                     run_id=config.run_id, local_addr=config.local_addr, numa_options=config.numa_options,
                     log_line_prefix_template=config.log_line_prefix_template, term_grace=args.term_grace)
    agent = NodeAgent(spec, handler, settings, metrics, config.logs_specs)
    try:
        result = agent.run()
    except RendezvousClosedError as exc:
        ended = side.closed_outcome()
        side.leave()
        if isinstance(exc, JobFinishedError) or ended is None or not ended.failed:
            logging.getLogger("elastic.agent").info("[%s] %s: nothing to join; exiting", node,
                                                    ended.line() if ended is not None else exc)
            return 0 if ended is None or not ended.failed else 1
        print(f"error: [{node}] {ended.line()}", file=sys.stderr)  # the same cause on every node
        return 1
    except AgentSignal as exc:
        side.leave()  # leave now (peers notice), but keep the job open
        return exit_code_for(exc)
    except RendezvousStateError as exc:
        side.leave()  # this agent cannot join; the job itself goes on without it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:
        side.close_job(FAILED, f"the agent on {node} crashed: {type(exc).__name__}: {exc}")
        raise
    if not result.is_failed():
        side.close_job(SUCCEEDED, "")
        return 0
    side.close_job(FAILED, agent.failure_line or "a local worker failed")
    if agent.failure_line:  # the agent said it in one line (a script error, a crash loop): no torchrun box
        print(f"error: [{node}] the job failed: {agent.failure_line}", file=sys.stderr)
    else:
        print(ChildFailedError(name=" ".join(command[:6]), failures=result.failures).format_msg(), file=sys.stderr)
    codes = {f.exitcode for f in result.failures.values()}
    if codes == {contract.FINAL_SNAPSHOT_LOST_EXIT}:  # trained to the end; its final snapshot is missing
        return contract.FINAL_SNAPSHOT_LOST_EXIT
    return 2 if codes == {2} else 1  # a usage error stays one: restarting the pod cannot fix it


def _say_metrics_port(work: Path, url: str) -> None:
    """The port /metrics is bound to, in the agent directory: with ``--metrics-port auto`` the
    kernel picked it (no port chosen ahead can be taken by another process first)."""
    port = url.rsplit(":", 1)[1].split("/", 1)[0]
    write_atomically(work / METRICS_PORT_FILE, (port + "\n").encode())


def _claimed_agent_dir(parser: argparse.ArgumentParser, value: str | None) -> AgentDir:
    try:
        return claim_agent_dir(value)
    except AgentDirError as exc:
        parser.exit(2, f"error: --agent-dir {exc}\n")


def _export_spare(side: HandlerSide, metrics: AgentMetrics) -> None:
    """``elastic_agent_spare``: 1 while the rendezvous holds this node as a spare (a full
    world without it), so a dashboard shows how many nodes stand ready to replace a loss."""
    side.on_spare(lambda spare: metrics.spare.set(1 if spare else 0))


def _start_rounds_above_the_fence(side: HandlerSide, snapshot_dir: Path | str | None, run_id: str,
                                  key_file: object = None) -> str | None:
    """A job whose etcd lost its state starts its rounds again at 0, below the fence its
    snapshot directory holds, and every new group would be refused as stale: start them
    above it (a stale writer from before the loss holds a lower round and stays refused).

    A fence above the newest round etcd holds for this job was raised by no group of it
    (etcd's rounds only rise): every group would be refused at its first commit, and its
    workers restarted for nothing. Returns that one line (the caller exits 2), else None.
    With a job key a fence that does not verify is ignored (``checkpoints/fence.py``)."""
    from checkpoints.signing import load_key
    from checkpoints.stores import open_fence

    if snapshot_dir is None or not side.fences_rounds:
        return None
    fence = open_fence(snapshot_dir, key=load_key(str(key_file))[0]) if key_file else open_fence(snapshot_dir)
    token = fence.current()
    if token is None or token.run != run_id:
        return None
    newest = side.start_rounds_above(token.round)
    if newest is not None:
        return (f"the snapshot directory's fence {fence.path} stands at round {token.round} of run {run_id!r}, above "
                f"the newest round etcd holds for this job ({newest}): no group of this job raised it (the file was "
                f"edited or copied in), and it would refuse every snapshot; if no other group of this job runs, "
                f"delete {fence.path} and start again (a job key signs the fence: an edited one is then ignored)")
    return None


def _check_devices(parser: argparse.ArgumentParser, nproc: str) -> None:
    """``--nproc-per-node gpu`` (or ``xpu``) on a node without one: torchrun would raise
    while starting; say so before anything starts."""
    import torch

    probes = {"gpu": ("CUDA GPU", torch.cuda.is_available),
              "xpu": ("XPU", lambda: hasattr(torch, "xpu") and torch.xpu.is_available())}
    if nproc in probes and not probes[nproc][1]():
        parser.exit(2, f"error: --nproc-per-node {nproc}: this node has no {probes[nproc][0]} torch can use; "
                       "give a count, or auto (one worker per GPU, else per CPU)\n")


def _checked_snapshot_dir(parser: argparse.ArgumentParser, value: str | None) -> Path | str | None:
    if not value:
        return None
    from checkpoints.location import uses_object_store

    if uses_object_store(value):  # the bucket, credentials and endpoint are checked before any worker starts
        from checkpoints import SnapshotError
        from checkpoints.stores import open_store

        try:
            open_store(value, create=True, key=None)
        except SnapshotError as exc:
            parser.exit(2, f"error: --snapshot-dir {exc}\n")
        return value
    snapshot_dir = Path(value)
    try:
        snapshot_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.exit(2, f"error: --snapshot-dir {snapshot_dir}: cannot create it ({exc.strerror}); "
                       "pass a writable shared directory\n")
    if not os.access(snapshot_dir, os.W_OK):
        parser.exit(2, f"error: --snapshot-dir {snapshot_dir} is not writable; pass a writable shared directory\n")
    return snapshot_dir


def _standalone(args: argparse.Namespace) -> None:
    """torchrun's ``--standalone``: a one-node job with its own c10d store (no etcd)."""
    if args.standalone:
        import uuid

        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _worker_command(cmd: object, cmd_args: list[str], with_python: bool, module: bool) -> tuple[str, ...]:
    """torchrun's worker command, with Python targets run through :mod:`agent.worker.worker_boot`."""
    from agent.worker.worker_boot import boot_command

    args = [str(a) for a in cmd_args]
    if with_python and args and args[0] == "-u":
        rest = args[1:]
        if module and rest and rest[0] == "-m":
            return boot_command(str(cmd), rest[1], rest[2:], module=True)
        if rest:
            return boot_command(str(cmd), rest[0], rest[1:], module=False)
    return (str(cmd), *args)


def _with_network(settings: AgentSettings, endpoint: str, local_addr: str | None, nnodes: str,
                  rdzv_configs: dict[str, object] | None = None) -> AgentSettings:
    """Where peers reach this node (its round store), and the socket interface its workers'
    collectives must use when the hostname resolves to loopback (agent/node/netif.py). Workers also
    get the job key's file when the agent was given it as ``--rdzv-conf hmac_key_file=``, so
    their snapshot store signs and checks with it (docs/checkpoints.md)."""
    import dataclasses

    from agent.etcd.settings import EtcdConfigError, parse_endpoints

    from agent.node.netif import local_address, worker_env_for

    try:
        address = local_addr or local_address(parse_endpoints(endpoint))
    except EtcdConfigError:
        address = local_addr
    updates, line = worker_env_for(endpoint, local_addr, nnodes, os.environ)
    key_file = (rdzv_configs or {}).get("hmac_key_file")
    if key_file and not os.environ.get(contract.HMAC_KEY_FILE_ENV):
        updates = {**updates, contract.HMAC_KEY_FILE_ENV: os.path.abspath(os.path.expanduser(str(key_file)))}
    if line:
        logging.getLogger("elastic.agent").info("[%s] %s", settings.node_name, line)
    return dataclasses.replace(settings, store_host=settings.store_host or address, worker_env=updates)


def _advertised(bind: str) -> str:
    if bind in ("0.0.0.0", "::", ""):
        return socket.getfqdn()
    return bind


def _stacks_on_sigusr1() -> None:
    """``kill -USR1``: every thread's stack to the log, which says what an agent that does not
    end waits on (its workers do the same, agent.worker.worker_boot)."""
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (ValueError, OSError):  # io.UnsupportedOperation: no real stderr (main called in a process's tests)
        pass


def _configure_logging(node: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [{node}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
