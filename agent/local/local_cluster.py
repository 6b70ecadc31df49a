"""``elastic local``: a whole elastic cluster on one machine, with faults on a schedule.

An embedded etcd, N ``elastic agent`` nodes (each its own process tree), a training job,
and a live view. Faults land on a schedule or on a keypress (k = kill, f = freeze, q = quit);
killed nodes come back later, so scale-up shows too. A worker that crashes (or hangs) is a
fault too, read from its node's log. At the end: one line per fault with the seconds to
recovery and the steps rolled back, the final loss, and one line with the job's outcome.

Workers run where ``elastic local`` was started, as under torchrun. The run directory holds
only what the tool writes: the nodes' logs and agent directories, etcd's data, the
rendezvous key and ``snapshots/`` (every worker's ``ELASTIC_SNAPSHOT_DIR``).

This module is the command: its flags, starting etcd and the nodes, landing faults until
the job ends, cleaning up. The cluster and its fault kinds are :mod:`agent.local.local_faults`,
the live view and plain lines :mod:`agent.local.local_view`, the end summary
:mod:`agent.local.local_summary`; their public names are importable from here too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import signal
import select
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from rich.console import Console
from rich.text import Text

from checkpoints.location import MisspeltLocationError, check_spelling, is_remote, split_tiers, uses_object_store
from elastic import contract
from agent.etcd import EmbeddedEtcd
from agent.rendezvous.registry import DEFAULT_LEASE_TTL
from agent.rendezvous.signing import HmacKeyError, StateSigner, load_hmac_key

from agent.local.local_faults import (  # noqa: F401  (re-exported: bench/chaos_soak.py and tests import them from here)
    ALL_KINDS, ETCD_OUTAGE, ETCD_TARGET, FREEZE, KILL, KILL_SNAPSHOT, KINDS, SDC, Cluster, ClusterNode, Fault,
    kill_during_snapshot,
)
from agent.local.local_node import AUTO_METRICS_PORT, LocalNode
from agent.local.zygote import Zygote
from agent.local.local_summary import job_goodput, summary  # noqa: F401
from agent.local.local_view import STATUS_EVERY_S, Display, say, status_line, view  # noqa: F401
from agent.node.launch import shown
from agent.node.signal_flag import SignalFlag

SDC_CHECK_EVERY = 10  # --chaos sdc: the job's replica check interval unless ELASTIC_CHECK_EVERY_STEPS says

KEY_FILE = "rdzv.key"  # the run's rendezvous key, in its run directory
DEFAULT_MAX_RESTARTS = 20


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _ctrl_c_sets(event: SignalFlag) -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP set ``event`` instead of ending the tool, for the duration.

    The tool owns its process tree (etcd, the agents, their workers): SIGTERM (what
    ``timeout``, systemd and a CI cancel send) killed it at once and left all of that
    running, reparented to init. Now each stops it as ``q`` does: clean up, then the summary.

    A KeyboardInterrupt is raised at whatever bytecode the main thread is on, and this loop
    spends its time inside rich's Live, whose refresh thread shares locks with it: raised
    between a lock's acquire and the ``try`` that releases it, it would leave the refresh
    thread blocked and Live's exit waiting on it forever. Once in CI, Ctrl-C left ``elastic
    local`` running with its nodes training for 30 s. A flag the loop checks stops it at a
    known point, and a second Ctrl-C cannot cut the clean-up short.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; elsewhere nothing to change
        return
    previous = {sig: signal.signal(sig, event.set) for sig in STOP_SIGNALS}  # not an Event: agent/node/signal_flag.py
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _keys(stop: threading.Event, pressed: list[str]) -> None:
    """Single keypresses without Enter, when stdin is a terminal."""
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        while not stop.is_set():
            if select.select([sys.stdin], [], [], 0.2)[0]:
                pressed.append(sys.stdin.read(1))
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    job_args: list[str] = []
    if "--" in argv:
        job_args, argv = argv[argv.index("--") + 1:], argv[: argv.index("--")]
    p = argparse.ArgumentParser(
        prog="elastic local", description=__doc__.splitlines()[0].replace("``", ""),
        usage="elastic local [options] [--job mlp|resnet|resnet50 [-- job args] | SCRIPT [args] | -m MODULE [args]]",
        epilog="With no SCRIPT or -m, an example job runs (python -m elastic.train; arguments after -- go to "
               "it). SCRIPT or -m MODULE runs your own training script on every node, as torchrun takes it: in "
               "the directory elastic local was started from, with ELASTIC_SNAPSHOT_DIR set to the run "
               "directory's snapshots/. Logs (node-N.log: the agent's lines and the workers' output) stay in the "
               "run directory. Without a terminal, progress is printed as plain lines. A script reports the "
               "job's step with elastic.report_progress(step) (then steps rolled back are counted), and its "
               "loss and samples/s with report_progress(step, loss=..., samples=...). More: docs/agent.md, "
               "section elastic local.")
    p.add_argument("--nodes", type=int, default=3, help="local nodes (default 3)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    p.add_argument("--job", choices=("mlp", "resnet", "resnet50"), default="mlp", help="example job (default mlp)")
    p.add_argument("--steps", type=int, default=600, help="example job: steps to train (default 600)")
    p.add_argument("-m", "--module", dest="as_module", action="store_true",
                   help="SCRIPT is a module to run with python -m, as in torchrun")
    p.add_argument("--netns", action="store_true",
                   help="give each node its own network namespace and address, etcd on a bridge (root only)")
    p.add_argument("--chaos", default="kill,freeze",
                   help=f"fault kinds to cycle through, comma-separated, from {', '.join(ALL_KINDS)} "
                        "(default kill,freeze; bench/chaos_soak.py adds random timing and end-of-run checks)")
    p.add_argument("--faults", type=int, default=2, help="scheduled faults (default 2; 0 = only on keypress)")
    p.add_argument("--first-fault-after", type=float, default=10.0,
                   help="seconds of training before the first scheduled fault (default 10)")
    p.add_argument("--fault-every", type=float, default=20.0,
                   help="seconds between scheduled faults, each once the last one is recovered from (default 20)")
    p.add_argument("--back-after", type=float, default=15.0,
                   help="seconds until a killed node restarts or a frozen one thaws (default 15)")
    p.add_argument("--lease-ttl", type=int, default=DEFAULT_LEASE_TTL,
                   help=f"node lease TTL, seconds: how fast a frozen node is written off (default {DEFAULT_LEASE_TTL})")
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                   help="per node: restarts for its own workers' crashes and hangs before the job fails "
                        f"(default {DEFAULT_MAX_RESTARTS}; a peer lost or a node joining does not count)")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop after this many seconds (default: none; the job runs until it ends, q or Ctrl-C)")
    p.add_argument("--snapshot-dir", default=None, metavar="DIR_OR_S3_URL",
                   help="where the job's snapshots go: a directory, or s3://bucket/prefix with credentials and "
                   "endpoint from the standard AWS variables (default: the run directory's snapshots/)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="logs, snapshots, etcd data and the rendezvous key (default runs/local-TIME)")
    p.add_argument("script", nargs="?", default=None, metavar="SCRIPT",
                   help="your training script (or module, with -m); runs under elastic agent on every node")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="the script's arguments")
    args = p.parse_args(argv)
    if args.as_module and not args.script:
        p.error("-m needs a MODULE to run, e.g. elastic local -m my_pkg.train")
    if args.script and job_args:
        p.error("arguments after -- go to the example job; give your script's arguments after it instead")
    if args.script and not args.as_module and not Path(args.script).is_file():
        p.error(f"{args.script}: no such file; give the path of your training script (or -m MODULE)")
    if args.netns:
        from agent.local.netns import unavailable_reason

        reason = unavailable_reason()
        if reason:
            p.exit(2, f"error: --netns: {reason}; or run without --netns\n")
    if args.nodes < 2:
        p.error("--nodes must be at least 2: a fault needs survivors")
    if args.timeout is not None and not args.timeout > 0:
        p.error(f"--timeout {args.timeout:g}: give positive seconds, or leave it out to run until the job ends")
    if args.max_restarts < 0:
        p.error(f"--max-restarts {args.max_restarts}: give 0 or more")
    problem = bad_value(args)
    if problem:
        p.error(problem)
    kinds, problem = chaos_kinds(args.chaos)
    if problem:
        p.exit(2, f"error: --chaos {shown(args.chaos)}: {problem}\n")
    if args.snapshot_dir:
        try:  # s3:/x would be a directory ./s3:/x (exit 0, the bucket never written)
            check_spelling(args.snapshot_dir)
        except MisspeltLocationError as exc:
            p.exit(2, f"error: --snapshot-dir {exc.location}: {exc.why}\n")
    if args.snapshot_dir and uses_object_store(args.snapshot_dir):
        if KILL_SNAPSHOT in kinds:
            p.error(f"--chaos {KILL_SNAPSHOT} watches a snapshot directory's temp dirs; not with an s3:// "
                    "--snapshot-dir")
        from checkpoints import SnapshotError
        from checkpoints.stores import open_store

        try:  # a missing bucket, refused credentials or a silent endpoint: one line, before any node
            open_store(args.snapshot_dir, create=True, key=None)
        except SnapshotError as exc:
            p.exit(2, f"error: --snapshot-dir {exc}\n")
    if args.script and KILL_SNAPSHOT in kinds:
        p.error(f"--chaos {KILL_SNAPSHOT} needs to know where the job writes snapshots; it works with the "
                "example jobs only")
    args.kinds = kinds
    return args, job_args


def chaos_kinds(text: str) -> tuple[list[str], str]:
    """``--chaos``'s kinds, and why they cannot be used ('' if they can): an empty entry
    (``kill,,freeze``, a trailing comma) is a typo whose missing kind would silently never
    run, and an unknown one a kind that does not exist."""
    kinds = [k.strip() for k in text.split(",")]
    fix = f"give a comma-separated list of {', '.join(ALL_KINDS)}"
    if any(not k for k in kinds):
        return [], f"an empty entry; {fix}, without empty entries"
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown:
        return [], f"unknown kind{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; {fix}"
    return kinds, ""


def bad_value(args: argparse.Namespace) -> str:
    """The first flag whose value cannot mean anything, as ``--flag VALUE: why``; '' if none.
    Refused up front: once started, a negative count ran as 0 and a non-positive TTL or
    worker count failed on every node, after etcd and the nodes had started."""
    checks: list[tuple[str, float, bool, str]] = [
        ("--faults", args.faults, args.faults >= 0, "give 0 or more (0: faults only on a keypress)"),
        ("--first-fault-after", args.first_fault_after, args.first_fault_after >= 0, "give 0 or more seconds"),
        ("--fault-every", args.fault_every, args.fault_every >= 0, "give 0 or more seconds"),
        ("--back-after", args.back_after, args.back_after >= 0, "give 0 or more seconds"),
        ("--steps", args.steps, args.steps >= 1, "give 1 or more"),
        ("--lease-ttl", args.lease_ttl, args.lease_ttl >= 2, "give at least 2 (etcd's minimum lease TTL)"),
        ("--nproc-per-node", args.nproc_per_node, args.nproc_per_node >= 1, "give 1 or more workers"),
    ]
    for flag, value, ok, fix in checks:
        if not ok or value != value:  # NaN is no number of seconds either
            return f"{flag} {value:g}: {fix}"
    return ""


def _snapshot_every(module_args: Sequence[str]) -> int:
    """The job's last --snapshot-every-steps (arguments after -- override ours)."""
    flags = [i for i, a in enumerate(module_args) if a == "--snapshot-every-steps"]
    return int(module_args[flags[-1] + 1]) if flags and flags[-1] + 1 < len(module_args) else 100


@contextlib.contextmanager
def _network(nodes: int, netns: bool) -> Iterator[Any]:
    """With --netns, nodes node-0... on their own network (removed on the way out)."""
    if not netns:
        yield None
        return
    from agent.local.netns import NodeNetwork

    with NodeNetwork([f"node-{i}" for i in range(nodes)]) as net:
        yield net


def snapshots_of(args: argparse.Namespace, run_dir: Path) -> str:
    """The job's snapshot location: ``--snapshot-dir`` (a directory, s3://, or two tiers with
    the local one made absolute, as a lone directory is), else the run's snapshots/."""
    if args.snapshot_dir:
        tiers = split_tiers(args.snapshot_dir)
        if tiers is not None:
            return f"{Path(tiers[0]).resolve()},{tiers[1]}"
        return args.snapshot_dir if is_remote(args.snapshot_dir) else str(Path(args.snapshot_dir).resolve())
    return str(run_dir / "snapshots")


def _job(args: argparse.Namespace, job_args: list[str], run_dir: Path) -> tuple[dict[str, Any], str]:
    """What every node runs (LocalNode fields) and how the header names it."""
    if args.script:
        if args.as_module:
            return {"module": args.script, "module_args": args.script_args}, f"-m {args.script}"
        return ({"script": str(Path(args.script).resolve()), "module_args": args.script_args},
                Path(args.script).name)
    module_args = ["--job", args.job, "--steps", str(args.steps), "--snapshot-dir", snapshots_of(args, run_dir),
                   "--snapshot-every-steps", "20", "--step-sleep", "0.03", "--progress", "{progress}", *job_args]
    return {"module": "elastic.train", "module_args": module_args}, f"job {args.job}"


def run_key(run_dir: Path) -> Path:
    """The run's rendezvous key (0600), made once: a --run-dir used again keeps its key,
    since its etcd data was signed with it. Raises HmacKeyError for a key that cannot be used."""
    path = run_dir / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        StateSigner(load_hmac_key(str(path), {}))  # readable, and long enough
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def threads_per_worker(workers: int, cores: int | None) -> int:
    """Intra-op threads for each of ``workers`` sharing this machine's ``cores``.

    Every local node is one machine's worth of workers to torch, which by default runs one
    intra-op thread per core in each; with several nodes on one machine their OpenMP
    threads then spin against each other. torchrun sets 1 when it starts several workers;
    here the share is known. Measured on 2 cores (docs/BENCHMARKS.md): the three-node demo
    used 112 s of CPU with torch's default and 34 s with one thread each.
    """
    return max(1, (cores or 1) // max(1, workers))


def _worker_threads(args: argparse.Namespace) -> str:
    """OMP_NUM_THREADS for this run's workers: the user's, else their share of the cores."""
    return os.environ.get("OMP_NUM_THREADS") or str(threads_per_worker(args.nodes * args.nproc_per_node,
                                                                       os.cpu_count()))


def _nodes(args: argparse.Namespace, job: dict[str, Any], run_dir: Path, etcd: EmbeddedEtcd, net: Any,
           key: Path) -> list[ClusterNode]:
    """Every node runs in the user's directory, signs the rendezvous with the run's key and
    hands its workers the run's snapshot directory (ELASTIC_SNAPSHOT_DIR) and their share of
    the cores (OMP_NUM_THREADS, unless the user set it)."""
    agent_args = ["--lease-ttl", str(args.lease_ttl), "--snapshot-dir", snapshots_of(args, run_dir)]
    env = {contract.HMAC_KEY_FILE_ENV: str(key)}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = _worker_threads(args)
    if SDC in args.kinds and contract.CHECK_EVERY_STEPS_ENV not in os.environ:
        env[contract.CHECK_EVERY_STEPS_ENV] = str(SDC_CHECK_EVERY)  # a flip is caught within a short run
    zygote = Zygote()  # every node's agent a fork of one torch import (agent/local/zygote.py)
    return [ClusterNode(LocalNode(
        name=f"node-{i}", endpoint=etcd.endpoint, run_id="local", workdir=run_dir, cwd=Path.cwd(),
        nnodes=f"1:{args.nodes}", nproc_per_node=args.nproc_per_node, max_restarts=args.max_restarts,
        rdzv_conf={"last_call_timeout": "5"}, metrics_port=AUTO_METRICS_PORT, env=env,
        agent_args=agent_args, netns=net[f"node-{i}"] if net else None, zygote=zygote, **job,
    )) for i in range(args.nodes)]


def _header(console: Console, etcd: EmbeddedEtcd, args: argparse.Namespace, what: str, run_dir: Path,
            key: Path) -> None:
    console.print(f"etcd at [cyan]{etcd.url}[/cyan]; {args.nodes} nodes x {args.nproc_per_node} workers; "
                  f"{what}; logs in {run_dir}", soft_wrap=True)
    say(console, f"workers run in {Path.cwd()}; ELASTIC_SNAPSHOT_DIR={snapshots_of(args, run_dir)}; OMP_NUM_THREADS="
                 f"{_worker_threads(args)} ({args.nodes * args.nproc_per_node} workers share {os.cpu_count()} cores)")
    say(console, f"rendezvous signed with {key}; watch it with: elastic top --rdzv-endpoint {etcd.endpoint} "
                 f"--rdzv-id local --rdzv-conf hmac_key_file={key}")


def _drive(cluster: Cluster, args: argparse.Namespace, display: Display, ctrl_c: SignalFlag,
           pressed: list[str]) -> str:
    """Run the job to its end, landing faults; returns why it stopped: ended, q, timeout or signal."""
    started, trained_at = display.started, None
    next_fault, scheduled = None, 0
    while args.timeout is None or time.time() - started < args.timeout:
        if ctrl_c.wait(0.1):  # Ctrl-C (SIGTERM, SIGHUP) quits like q: clean up, then the summary
            return "signal"
        cluster.tick()
        display.update()
        if cluster.ended():
            return "ended"
        if trained_at is None and cluster.rows():
            trained_at = time.time()
            next_fault = trained_at + args.first_fault_after
        key = pressed.pop(0) if pressed else ""
        if key == "q":
            return "q"
        due = (next_fault is not None and scheduled < args.faults and time.time() >= next_fault
               and (args.script or cluster.step() < 0.8 * args.steps))  # room to recover in
        calm = cluster.quiet() and all(f.recovered_at is not None for f in cluster.crashes)
        candidates = [n for n in cluster.up() if n.node.progress()]
        if (((due and calm) or key in ("k", "f")) and len(candidates) >= 2
                and cluster.world() == len(cluster.up()) * cluster.nproc):
            kind = {"k": KILL, "f": FREEZE}.get(key) or args.kinds[scheduled % len(args.kinds)]
            cluster.inject(kind, random.choice(candidates), args.back_after)
            if due:
                scheduled += 1
                next_fault = time.time() + args.fault_every
    return "timeout"


def main(argv: Sequence[str]) -> int:
    args, job_args = parse_args(argv)
    # a log or a pipe has no width: wide enough that the tables' rows stay one line each
    console = Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=120)
    run_dir = (args.run_dir or Path("runs") / time.strftime("local-%Y%m%d-%H%M%S")).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        key = run_key(run_dir)
    except (OSError, HmacKeyError) as exc:
        print(f"error: --run-dir {run_dir}: {exc}; use a new --run-dir", file=sys.stderr)
        return 2
    job, what = _job(args, job_args, run_dir)
    pressed: list[str] = []  # keys read from the console (_keys), taken by _drive
    stop, ctrl_c = threading.Event(), SignalFlag()
    why = "signal"
    with _ctrl_c_sets(ctrl_c), _network(args.nodes, args.netns) as net, \
            EmbeddedEtcd(data_dir=run_dir / "etcd", host=net.central_addr if net else "127.0.0.1") as etcd:
        _header(console, etcd, args, what, run_dir, key)
        cluster = Cluster(_nodes(args, job, run_dir, etcd, net, key), run_dir, args.nproc_per_node, etcd=etcd,
                          snapshot_every=_snapshot_every(job["module_args"]) if not args.script else 0,
                          snapshots=snapshots_of(args, run_dir))
        if sys.stdin.isatty():
            threading.Thread(target=_keys, args=(stop, pressed), daemon=True).start()
        try:
            for n in cluster.nodes:
                if ctrl_c.is_set():
                    break
                n.node.start()
            with Display(console, cluster, time.time()) as display:
                why = _drive(cluster, args, display, ctrl_c, pressed)
        finally:
            stop.set()
            for n in cluster.nodes:
                n.node.cleanup()
    recovered = summary(console, cluster)
    return _verdict(console, cluster, args, why, recovered, ctrl_c.signum)


def stop_reason(why: str, timeout: float | None, signum: int | None) -> str:
    """Why the tool stopped before the job ended, in the words of ``stopped before ... (why)``."""
    if why == "q":
        return "q"
    if why == "timeout":
        return f"--timeout {timeout:g} s" if timeout is not None else "timeout"
    if signum is None or signum == signal.SIGINT:
        return "Ctrl-C"
    return signal.Signals(signum).name


def _verdict(console: Console, cluster: Cluster, args: argparse.Namespace, why: str, recovered: bool,
             signum: int | None = None) -> int:
    """The last line: how the job ended (or why it was stopped), and the exit code to match:
    0 only for a job that finished; 128 + the signal for a stop by one (130 for Ctrl-C,
    143 for SIGTERM, as a shell reports it); 1 otherwise."""
    if why != "ended":
        target = "the script ended" if args.script else f"step {args.steps}"
        console.print(f"[yellow]stopped before {target}[/yellow] ({stop_reason(why, args.timeout, signum)})")
        return 128 + (signum or signal.SIGINT) if why == "signal" else 1
    ok, line = cluster.outcome(None if args.script else args.steps)
    if ok and not recovered:
        ok, line = False, "the job ended, but a fault above was never recovered from (recovery 'not seen')"
    console.print(Text(line, style="green" if ok else "red"), soft_wrap=True)
    return 0 if ok else 1
