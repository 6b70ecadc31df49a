"""``elastic agent``: torchrun, with our rendezvous by default and a node agent that judges.

The parser is torchrun's own (``torch.distributed.run.get_args_parser``) plus a few flags,
and launching is torchrun's own ``run``; only the agent class torch builds is swapped for
:class:`agent.node_agent.NodeAgent`. Every flag ``--foo-bar`` may also come from the
environment as ``ELASTIC_FOO_BAR`` (torchrun's ``PET_FOO_BAR`` still works too), which is
what container and systemd deployments want.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import socket
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Sequence

from elastic.rendezvous.registry import DEFAULT_LEASE_TTL, default_node_name

from .etcd_args import DEFAULT_ENDPOINT
from .nnodes import apply_nnodes, environment_nnodes

ENV_PREFIX = "ELASTIC_"
DEFAULT_METRICS_PORT = 9400
DEFAULT_MAX_RESTARTS = 3


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
                      default=DEFAULT_METRICS_PORT, help=f"Prometheus /metrics port (default {DEFAULT_METRICS_PORT}; 0 = off)")
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
    ours.add_argument("--snapshot-dir", "--snapshot_dir", dest="snapshot_dir", default=None,
                      help="shared snapshot directory, passed to workers as ELASTIC_SNAPSHOT_DIR")
    ours.add_argument("--warm-start", "--warm_start", dest="warm_start", action=argparse.BooleanOptionalAction,
                      default=True,
                      help="keep one pre-imported standby process per local rank, so a restarted worker "
                           "skips importing torch (default on; --no-warm-start for cold starts)")
    # torchrun's PET_* variables (what Kubeflow sets) keep precedence over our defaults
    own = {"rdzv_backend": "etcd-v3", "rdzv_endpoint": DEFAULT_ENDPOINT, "max_restarts": DEFAULT_MAX_RESTARTS}
    parser.set_defaults(**{k: v for k, v in own.items() if f"PET_{k.upper()}" not in os.environ})
    _defaults_from_env(parser, os.environ)
    parser.set_defaults(nnodes=environment_nnodes(os.environ))  # --nnodes > ELASTIC_NNODES > PET_NNODES
    return parser


def _defaults_from_env(parser: argparse.ArgumentParser, env: "os._Environ[str] | dict[str, str]") -> None:
    """``ELASTIC_FOO_BAR`` sets the default of ``--foo-bar`` (a flag given still wins)."""
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        value = env.get(ENV_PREFIX + action.dest.upper())
        if value is None:
            continue
        if action.nargs == 0:  # a switch
            parser.set_defaults(**{action.dest: value.strip().lower() in ("1", "true", "yes", "on")})
        else:
            parser.set_defaults(**{action.dest: value})  # argparse applies `type` to string defaults
        action.required = False


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535; 0 turns metrics off)")
    return value


def _lease_ttl(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value} s is below etcd's minimum lease TTL of 2 s")
    return value


def _hang_timeout(text: str) -> float | None:
    if text.strip().lower() == "auto":
        return None
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive seconds, or auto")
    return value


def package_version() -> str:
    try:
        return version("elastic-trainer")
    except PackageNotFoundError:
        return "0+unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_agent_parser()
    args = parser.parse_args(argv)
    node = args.node_name or default_node_name()
    _configure_logging(node)
    args.nnodes = apply_nnodes(parser, args.nnodes, os.environ)
    if args.snapshot_dir:
        snapshot_dir = Path(args.snapshot_dir)
        try:
            snapshot_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.exit(2, f"error: --snapshot-dir {snapshot_dir}: cannot create it ({exc.strerror}); "
                           "pass a writable shared directory\n")
        if not os.access(snapshot_dir, os.W_OK):
            parser.exit(2, f"error: --snapshot-dir {snapshot_dir} is not writable; pass a writable shared directory\n")

    from elastic.metrics.multiprocess import prepare_dir

    from .metrics import AgentMetrics  # imports prometheus_client before the env below
    from .node_agent import NodeAgent
    from .settings import AgentSettings

    work = Path(tempfile.mkdtemp(prefix=f"elastic-agent-{os.getpid()}-"))
    settings = AgentSettings(
        node_name=node, metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
        lease_ttl=args.lease_ttl, hang_timeout=args.hang_timeout, warm_start=args.warm_start,
        snapshot_dir=Path(args.snapshot_dir) if args.snapshot_dir else None,
        heartbeat_dir=work / "heartbeat", metrics_dir=prepare_dir(work / "metrics"),
    )
    settings.heartbeat_dir.mkdir()
    metrics = AgentMetrics(node, package_version(), settings.metrics_dir)
    if settings.metrics_port:
        try:
            metrics.serve(settings.metrics_addr, settings.metrics_port, _advertised(settings.metrics_addr))
        except OSError as exc:
            parser.exit(2, f"error: --metrics-port {settings.metrics_port} on {settings.metrics_addr}: "
                           f"{exc.strerror}; pick a free port or 0 to turn metrics off\n")

    # Read by our rendezvous handler (in this process) and inherited by the workers.
    os.environ.update({
        "ELASTIC_NODE_NAME": node,
        "ELASTIC_LEASE_TTL": str(settings.lease_ttl),
        "ELASTIC_HEARTBEAT_DIR": str(settings.heartbeat_dir),
        "PROMETHEUS_MULTIPROC_DIR": str(settings.metrics_dir),
    })
    if settings.snapshot_dir:
        os.environ["ELASTIC_SNAPSHOT_DIR"] = str(settings.snapshot_dir)

    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    launcher_api.LocalElasticAgent = functools.partial(NodeAgent, settings=settings, metrics=metrics)  # type: ignore[misc]
    try:
        run(args)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return 1
    return 0


def _advertised(bind: str) -> str:
    if bind in ("0.0.0.0", "::", ""):
        return socket.getfqdn()
    return bind


def _configure_logging(node: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [{node}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
