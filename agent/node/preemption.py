"""The node agent told to stop (a pre-emption): pass SIGTERM on and restart nothing.

Contract: :func:`terminate` once, from the agent's ``run`` when a stop signal ended its
loop; it returns when no local worker is left. The agent's registry record and lease
stay as they are until then (its peers form the next round once these workers left at
their step boundary); the caller leaves the job afterwards.
"""

from __future__ import annotations

import logging
import signal
import time
from agent.node.metrics import AgentMetrics
from agent.node.node_run import Group
from agent.node.states import AgentState
from agent.node.workers import LocalWorkers

log = logging.getLogger("elastic.agent")

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def terminate(group: Group, node: str, workers: LocalWorkers, metrics: AgentMetrics, grace: float,
              signum: int) -> None:
    """The agent was told to stop (Kubernetes evicting the pod, a spot VM reclaimed,
    ``systemctl stop``): pass SIGTERM on to the workers and restart nothing.

    ``ElasticRun`` workers finish the step in flight, write a snapshot of it and exit
    with 143; a plain script does what its SIGTERM handler does. The agent stays in the
    job (its lease held) until they are out, so that its peers form the next round once
    they left at their step boundary rather than in the middle of it, and SIGKILLs
    whatever still runs when ``--term-grace`` is up. A second signal ends the wait at once.
    """
    started = time.monotonic()
    name = signal.Signals(signum).name
    running = [rank for rank, code in workers.exits().items() if code is None]
    metrics.set_state(AgentState.STOPPED)
    if not running:
        log.warning("[%s] got %s: no local worker is running; exiting", node, name)
        group.stop(signal.SIGKILL, 0.0)
        return
    log.warning("[%s] got %s: passing SIGTERM to local rank(s) %s, which stop at a step boundary "
                "(ElasticRun: after a snapshot of the last step); restarting nothing; SIGKILL in %g s "
                "(--term-grace)", node, name, running, grace)
    hurry: list[int] = []
    previous = {sig: signal.signal(sig, lambda got, _frame: hurry.append(got)) for sig in _SIGNALS}
    try:
        workers.terminate(signal.SIGTERM)
        deadline = started + grace
        while not hurry and time.monotonic() < deadline and workers.running():
            time.sleep(0.02)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    left = workers.running()
    waited = time.monotonic() - started
    if left and hurry:
        log.warning("[%s] got %s again: SIGKILL to local rank(s) %s now, %.1f s after the first", node,
                    signal.Signals(hurry[0]).name, left, waited)
    elif left:
        log.warning("[%s] local rank(s) %s still running %.1f s after SIGTERM (--term-grace %g s): SIGKILL. "
                    "A snapshot they were still writing is lost, and the job resumes from the newest durable "
                    "one; give them longer with --term-grace (ELASTIC_TERM_GRACE), and on Kubernetes a "
                    "terminationGracePeriodSeconds a few seconds above it", node, left, waited, grace)
    else:
        codes = {rank: code for rank, code in workers.exits().items() if rank in running}
        log.info("[%s] local workers stopped %.1f s after %s (exit codes %s); leaving the job", node,
                 waited, name, ", ".join(f"rank {r}: {c}" for r, c in sorted(codes.items())))
    group.stop(signal.SIGKILL, 0.0)  # what is left, and each worker's whole session (data loaders...)


__all__ = ["terminate"]
