"""How long N nodes take to form one rendezvous round: etcd-v3 beside torch's c10d.

Each simulated node is a rendezvous handler in its own thread with no workers; all call
``next_rendezvous`` together (min = max = N, so no last-call wait). We report the
seconds from the first join to every node holding the same round, the etcd requests
made (ours), and the ratio to c10d measured in the same run on the same machine.

    .venv/bin/python bench/rendezvous_scale.py [--nodes 8 32 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable

os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # no per-round TCPStore server

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters  # noqa: E402
from torch.distributed.elastic.rendezvous import dynamic_rendezvous  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend as c10d_backend  # noqa: E402

from elastic.etcd import EmbeddedEtcd, EtcdClient, free_port  # noqa: E402
from elastic.rendezvous import EtcdV3RendezvousHandler, create_handler  # noqa: E402


@dataclass
class Trial:
    seconds: float
    requests: int


class _Counter:
    """Counts etcd requests by wrapping EtcdClient.call for the duration of a trial."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._original = EtcdClient.call

    def __enter__(self) -> "_Counter":
        counter, original = self, self._original

        def counted(client, request, **kwargs):  # type: ignore[no-untyped-def]
            with counter._lock:
                counter.count += 1
            return original(client, request, **kwargs)

        EtcdClient.call = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        EtcdClient.call = self._original  # type: ignore[method-assign]


def _round_of(handler: RendezvousHandler) -> int:
    if isinstance(handler, EtcdV3RendezvousHandler):
        assert handler.round is not None
        return handler.round.round
    return handler._state_holder.state.round  # type: ignore[attr-defined]  # torch's dynamic handler


def _stop(handler: RendezvousHandler) -> None:
    if isinstance(handler, EtcdV3RendezvousHandler):
        handler.close()
    else:
        handler._stop_heartbeats()  # type: ignore[attr-defined]


def form(make_handler: Callable[[int], RendezvousHandler], n: int) -> float:
    handlers = [make_handler(i) for i in range(n)]
    rounds: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(n + 1)
    lock = threading.Lock()

    def join(handler: RendezvousHandler) -> None:
        barrier.wait()
        try:
            handler.next_rendezvous()
            with lock:
                rounds.append(_round_of(handler))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join(timeout=600)
    seconds = time.perf_counter() - started
    for handler in handlers:
        _stop(handler)
    if errors:
        raise RuntimeError(f"{len(errors)} nodes failed to join: {errors[0]!r}")
    if len(rounds) != n or len(set(rounds)) != 1:
        raise RuntimeError(f"nodes ended in different rounds: {sorted(set(rounds))}")
    return seconds


def etcd_trial(n: int, run: int) -> Trial:
    with EmbeddedEtcd() as etcd, _Counter() as counter:
        params = lambda i: RendezvousParameters(  # noqa: E731
            "etcd-v3", etcd.endpoint, f"scale{n}-{run}", n, n, join_timeout=600, node_name=f"node{i}"
        )
        seconds = form(lambda i: create_handler(params(i)), n)
        return Trial(seconds, counter.count)


def c10d_trial(n: int, run: int) -> Trial:
    endpoint = f"127.0.0.1:{free_port()}"
    stores = []

    def make(_node: int) -> RendezvousHandler:
        params = RendezvousParameters(
            "c10d", endpoint, f"scale{n}-{run}", n, n, join_timeout=600,
            last_call_timeout=1, keep_alive_interval=1, keep_alive_max_attempt=3,
        )
        backend, store = c10d_backend(params)
        stores.append(store)  # the first one hosts the TCPStore server; keep it alive
        return dynamic_rendezvous.create_handler(store, backend, params)

    return Trial(form(make, n), 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    print(f"{'nodes':>5}  {'etcd-v3 s':>10}  {'c10d s':>8}  {'ratio':>6}  {'etcd requests':>13}  {'req/node':>8}")
    for n in args.nodes:
        ours = [etcd_trial(n, r) for r in range(args.repeats)]
        theirs = [c10d_trial(n, r) for r in range(args.repeats)]
        ours_s = statistics.median(t.seconds for t in ours)
        theirs_s = statistics.median(t.seconds for t in theirs)
        requests = statistics.median(t.requests for t in ours)
        print(
            f"{n:>5}  {ours_s:>10.2f}  {theirs_s:>8.2f}  {ours_s / theirs_s:>6.2f}  "
            f"{requests:>13.0f}  {requests / n:>8.1f}",
            flush=True,
        )
    print(f"(medians of {args.repeats} trials; ratio = etcd-v3 / c10d, goal <= 1.5 and 64 nodes <= 10 s)")


if __name__ == "__main__":
    main()
