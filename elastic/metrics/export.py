"""Where this worker's metrics go: the agent's multiprocess directory, its own port, or nowhere.

1. ``PROMETHEUS_MULTIPROC_DIR`` set (our agent sets it): prometheus_client writes every value
   to mmap files there and the agent serves them all from its one endpoint.
2. Else ``ELASTIC_METRICS_PORT=BASE`` (plain torchrun): this worker serves ``/metrics`` on
   ``BASE + LOCAL_RANK`` at ``ELASTIC_METRICS_ADDR`` (default 127.0.0.1, loopback on purpose:
   opening it to the network is the user's explicit choice).
3. Neither: values are still kept in process (a few locked adds per step) and not served.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .. import contract, worker_env

DEFAULT_ADDR = "127.0.0.1"

ExportMode = Literal["multiprocess", "port", "none"]

log = logging.getLogger(__name__)


class MetricsConfigError(RuntimeError):
    """A metrics setting the user can fix; the message names it."""


@dataclass(frozen=True)
class Export:
    mode: ExportMode
    where: str = ""  # the directory, or host:port being served


@functools.cache
def start_export(local_rank: int) -> Export:
    """Decide the mode from the environment once per process; serve the port in mode 2."""
    directory = worker_env.read().node.metrics_dir
    if directory:
        path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MetricsConfigError(
                f"{contract.METRICS_DIR_ENV}={directory}: cannot create it ({e.strerror or e}); point it at a writable "
                "directory or unset it"
            ) from None
        return Export("multiprocess", str(path))
    port_text = os.environ.get(contract.METRICS_PORT_ENV)
    if not port_text:
        return Export("none")
    try:
        base = int(port_text)
    except ValueError:
        raise MetricsConfigError(f"{contract.METRICS_PORT_ENV}={port_text!r} is not a port number; set it to e.g. 10400") from None
    port = base + local_rank
    if not 0 < port < 65536:
        raise MetricsConfigError(f"{contract.METRICS_PORT_ENV}={base} + local rank {local_rank} = {port} is not a valid port")
    addr = os.environ.get(contract.METRICS_ADDR_ENV) or DEFAULT_ADDR
    from prometheus_client import start_http_server

    from .catalogue import families

    try:
        start_http_server(port, addr=addr, registry=families().registry)
    except OSError as e:
        # Metrics are a side channel: a busy port must not stop training. One clear line instead.
        log.warning("metrics not served: cannot listen on %s:%d (%s); free the port or change %s",
                    addr, port, e.strerror or e, contract.METRICS_PORT_ENV)
        return Export("none")
    return Export("port", f"{addr}:{port}")
