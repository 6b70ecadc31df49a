"""``elastic``: one command for the node agent, the one-machine cluster and the tools."""

from __future__ import annotations

import sys
from typing import Callable, Sequence

USAGE = """\
usage: elastic COMMAND [ARGS]

  agent   run this node's agent: torchrun's flags, etcd-v3 rendezvous, fast peer-loss
          detection, hang watchdog, /metrics   (elastic agent --help)
  local   a whole cluster on this machine: embedded etcd, N agents, a job, kills,
          a live view and a recovery summary   (elastic local --help)
  kill    kill (or --freeze) a node of a running job, found through etcd
  inject-sdc  flip one bit of a node's live training state (silent data corruption)
  check   have a running job check its replicas now, and print what it found
  etcd    run an embedded etcd in the foreground, for one-machine setups
  top     live terminal dashboard of a running job
  sd      Prometheus http_sd endpoint listing the job's live nodes

Every agent flag --foo-bar can also be set as ELASTIC_FOO_BAR.
"""


def _agent(argv: Sequence[str]) -> int:
    from agent.node.fork_server import fork_early

    fork_early()  # first: before anything starts a thread, the template shares the agent's torch import
    from agent.node.launch import main

    return main(argv)


def _local(argv: Sequence[str]) -> int:
    from agent.local.local_cluster import main

    return main(argv)


def _kill(argv: Sequence[str]) -> int:
    from agent.tools.kill import main

    return main(argv)


def _inject_sdc(argv: Sequence[str]) -> int:
    from agent.tools.inject_sdc import main

    return main(argv)


def _check(argv: Sequence[str]) -> int:
    from agent.tools.check_cmd import main

    return main(argv)


def _etcd(argv: Sequence[str]) -> int:
    from agent.tools.etcd_cmd import main

    return main(argv)


def _top(argv: Sequence[str]) -> int:
    from agent.tools.top import main

    return main(list(argv))


def _sd(argv: Sequence[str]) -> int:
    from agent.tools.sd import main

    return main(list(argv))


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "agent": _agent,
    "local": _local,
    "kill": _kill,
    "inject-sdc": _inject_sdc,
    "check": _check,
    "etcd": _etcd,
    "top": _top,
    "sd": _sd,
}


def build_agent_parser():
    """The ``elastic agent`` parser (deploy-file consistency tests read it)."""
    from agent.node.launch import build_agent_parser as build

    return build()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"error: unknown command {args[0]!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    from agent.etcd import EtcdConfigError, EtcdError
    from agent.rendezvous.signing import HmacKeyError

    try:
        return command(args[1:])
    except (EtcdConfigError, EtcdError, HmacKeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
