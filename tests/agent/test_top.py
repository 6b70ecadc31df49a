"""``elastic top``: the numbers from real text exposition, and ``--once`` against real HTTP.

Most node endpoints here are STAND-INS (tests/support/metrics_standin.py): real
prometheus_client registries served over real HTTP, with made-up steps so the expected
figures are exact. The registry entries are real, in a real etcd.

``test_once_against_a_real_two_node_run`` has no stand-in: two real ``elastic agent``
nodes train the mlp job on gloo, and ``elastic top --once`` finds them through the etcd
registry, as a user would run it next to the job.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import pytest
from rich.console import Console

from agent.tools.top import main
from agent.tools.top import render
from agent.tools.top_model import (SPARE_NOTE, Exposition, NodeScrape, build_view, fmt_rate, fmt_seconds, goodput_lines,
                             quantile)
from elastic.goodput import Account, Interval, extend
from agent.etcd import EmbeddedEtcd, EtcdClient, free_port
from agent.local.local_node import AUTO_METRICS_PORT
from agent.rendezvous.registry import NodeLease, NodeRecord
from agent.rendezvous.signing import StateSigner
from tests.support.metrics_standin import BATCH, StandinNode
from tests.support.nodes import TorchrunNode
from tests.support.waiting import wait_until

KEY = b"0123456789abcdef0123456789abcdef"


def scrape(node: str, standin: StandinNode, at: float) -> NodeScrape:
    return NodeScrape(node, "healthy", at, Exposition.parse(standin.exposition()))


def test_quantile_matches_prometheus() -> None:
    # The same buckets as the p50 case in deploy/prometheus/rules/tests.yml: 0.1875 there too.
    assert quantile(0.5, [(0.125, 0), (0.25, 1), (0.5, 1), (math.inf, 1)]) == 0.1875
    assert quantile(0.99, [(0.1, 0), (0.2, 0), (math.inf, 4)]) == 0.2  # in +Inf: highest finite bound
    assert quantile(0.5, [(0.1, 0), (math.inf, 0)]) is None  # nothing observed in the window


def test_view_from_two_scrapes() -> None:
    a = StandinNode({0: 0.08, 1: 0.08}, world_size=4)
    b = StandinNode({2: 0.4, 3: 0.08}, world_size=4)  # rank 2 is five times slower
    a.step(5), b.step(5)
    before = {"a": scrape("a", a, 100.0), "b": scrape("b", b, 100.0)}
    a.step(20), b.step(20)
    a.durable.set(70.0)
    after = {"a": scrape("a", a, 102.0), "b": scrape("b", b, 102.0)}

    view = build_view(after, before)
    rows = {(r.node, r.rank): r for n in view.nodes for r in n.ranks}
    assert sorted(rows) == [("a", "0"), ("a", "1"), ("b", "2"), ("b", "3")]
    assert rows["a", "0"].samples_per_s == 20 * BATCH / 2.0
    assert view.samples_per_s == 4 * 20 * BATCH / 2.0
    assert rows["a", "0"].steps == 25
    # 0.08 s falls in (0.05, 0.1]: p50 interpolates to 0.075; 0.4 in (0.25, 0.5]: 0.375.
    assert rows["a", "0"].step_p50 == pytest.approx(0.075)
    assert rows["b", "2"].step_p50 == pytest.approx(0.375)
    assert rows["b", "2"].straggler and not rows["b", "3"].straggler
    assert view.stragglers == ("b/2",)
    # 4 MB in 10 ms per rank and step: algbw 400 MB/s; busbw at n=4 is 1.5x that.
    assert rows["a", "0"].busbw == pytest.approx(600e6)
    assert rows["a", "0"].allreduce_s_per_step == pytest.approx(0.01)
    assert rows["a", "0"].snapshot_age_s == 32.0 and rows["b", "2"].snapshot_age_s is None
    assert view.snapshot_age_s == 32.0 and view.world_size == 4


def test_first_scrape_has_no_rates_and_a_restarted_node_counts_from_zero() -> None:
    a = StandinNode({0: 0.08}, world_size=1)
    a.step(3)
    first = build_view({"a": scrape("a", a, 10.0)}, {})
    assert first.nodes[0].ranks[0].samples_per_s is None and first.nodes[0].ranks[0].step_p50 is None

    fresh = StandinNode({0: 0.08}, world_size=1)  # the agent restarted: counters start again
    fresh.step(2)
    view = build_view({"a": scrape("a", fresh, 12.0)}, {"a": scrape("a", a, 10.0)})
    assert view.nodes[0].ranks[0].samples_per_s == 2 * BATCH / 2.0
    assert view.nodes[0].ranks[0].busbw == 0.0  # a world of one moves nothing over a bus


def test_a_spare_shows_in_the_title_and_its_row_says_what_it_is_for() -> None:
    scrapes = {"a": NodeScrape("a", "running", 10.0, Exposition.parse("")),
               "c": NodeScrape("c", "spare", 10.0, Exposition.parse("")),
               "d": NodeScrape("d", "kept_out", 10.0, Exposition.parse(""), note="kept out: back-off 5 s")}
    view = build_view(scrapes, {})
    assert view.spares == ("c",)
    assert {n.node: n.note for n in view.nodes} == {"a": "", "c": SPARE_NOTE, "d": "kept out: back-off 5 s"}
    console = Console(width=240, record=True)
    console.print(render(view, "r1"))
    text = console.export_text()
    assert "3 nodes (1 spare)" in text and "spare: takes the next lost node" in text
    assert build_view({"a": scrapes["a"]}, {}).spares == ()


def test_a_node_kept_out_is_named_for_why_even_while_its_last_pace_flags_it_a_straggler() -> None:
    """Seen under load: a node kept out (unreachable) whose last scrape still made it the
    straggler showed only "straggler 1.74x", and the keep-out's back-off was not said."""
    a = StandinNode({0: 0.08}, world_size=3)
    b = StandinNode({1: 0.08}, world_size=3)
    c = StandinNode({2: 0.4}, world_size=3)
    for n in (a, b, c):
        n.step(5)
    before = {name: scrape(name, n, 100.0) for name, n in (("a", a), ("b", b), ("c", c))}
    for n in (a, b, c):
        n.step(20)
    after = {name: scrape(name, n, 102.0) for name, n in (("a", a), ("b", b))}
    after["c"] = NodeScrape("c", "kept_out", 102.0, Exposition.parse(c.exposition()),
                            note="kept out: back-off 5 s (strike 1); cannot reach a, b")
    view = build_view(after, before)
    assert view.stragglers == ("c/2",)
    console = Console(width=300, record=True)
    console.print(render(view, "r1"))
    row = next(line for line in console.export_text().splitlines() if line.startswith("│ c "))
    assert "kept out: back-off 5 s (strike 1); cannot reach a, b · straggler" in row, row


def test_formatting() -> None:
    assert fmt_seconds(0.0754) == "75.4 ms" and fmt_seconds(None) == "-" and fmt_seconds(4000) == "66.7 min"
    assert fmt_rate(600e6, "B/s") == "600.00 MB/s" and fmt_rate(1280.0) == "1.28k/s"


@pytest.fixture
def standins() -> Iterator[list[StandinNode]]:
    made: list[StandinNode] = []
    try:
        yield made
    finally:
        for s in made:
            s.close()


def test_once_against_live_endpoints(etcd_server: EmbeddedEtcd, etcd_client: EtcdClient, run_id: str,
                                     tmp_path: Path, standins: list[StandinNode],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    a = StandinNode({0: 0.08, 1: 0.08}, world_size=4)
    b = StandinNode({2: 0.4, 3: 0.08}, world_size=4)
    standins += [a, b]
    urls = {"node-a": a.serve(steps_per_second=20), "node-b": b.serve(steps_per_second=20),
            "node-c": f"http://127.0.0.1:{free_port()}/metrics"}  # registered, but its endpoint is gone
    # ("node-c": free_port: nothing must listen there, so no bind race to lose (issue 40))
    leases = [NodeLease(etcd_client, "/elastic", run_id,
                        NodeRecord(node=n, host="127.0.0.1", pid=1, metrics_url=u, state="healthy"),
                        StateSigner(KEY), ttl=5).start() for n, u in urls.items()]
    key_file = tmp_path / "job.key"
    key_file.write_bytes(KEY)
    try:
        code = main(["--once", "--interval", "1", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id,
                     "--rdzv-conf", f"hmac_key_file={key_file}"])
    finally:
        for lease in leases:
            lease.close()
    out = capsys.readouterr().out
    assert code == 0, out
    print(out)  # shown on failure: the table as a user sees it
    lines = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip()[1:-1].split("│")]
        if cells and cells[0].startswith("node-"):
            lines[cells[0], cells[1]] = cells
    assert sorted(lines) == [("node-a", "0"), ("node-a", "1"), ("node-b", "2"), ("node-b", "3"), ("node-c", "-")]
    assert all(c[2] == "healthy" for c in lines.values())
    assert lines["node-b", "2"][-1].startswith("straggler") and lines["node-b", "3"][-1] == ""
    assert lines["node-a", "0"][9] == "600.00 MB/s"  # busbw: 4 MB per 10 ms, x1.5 at n=4
    assert lines["node-a", "0"][4] != "-" and lines["node-a", "0"][5] == "75.0 ms"
    assert "scrape failed" in lines["node-c", "-"][-1]
    assert f"run {run_id} · world 4 · 3 nodes" in out
    assert "stragglers (compute, else step p50, ≥ ratio × median): node-b/2" in out


def table_rows(out: str) -> dict[tuple[str, str], list[str]]:
    """``elastic top``'s table rows by (node, rank): the cells as printed."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip()[1:-1].split("│")]
        if len(cells) == 13 and cells[0].startswith("node-"):
            rows[cells[0], cells[1]] = cells
    return rows


def rate_of(cell: str) -> float:
    """A printed rate (``533.3``, ``1.28k``, ``2.10 MB/s``) back to a number."""
    found = re.fullmatch(r"([\d.]+) ?([kMGT]?)(?:B/s)?", cell)
    assert found, f"not a rate: {cell!r}"
    return float(found[1]) * {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[found[2]]


def test_once_against_a_real_two_node_run(etcd_server: EmbeddedEtcd, run_id: str, tmp_path: Path,
                                          nodes: Callable[..., TorchrunNode],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    key_file = tmp_path / "job.key"
    key_file.write_bytes(KEY)
    snaps = tmp_path / "snaps"
    job = ["--job", "mlp", "--steps", "100000", "--snapshot-dir", str(snaps), "--snapshot-every-steps", "10",
           "--step-sleep", "0.02", "--progress", "{progress}"]
    a, b = (nodes(name=n, endpoint=etcd_server.endpoint, run_id=run_id, module="elastic.train", module_args=job,
                  metrics_port=AUTO_METRICS_PORT, agent_args=["--lease-ttl", "2"],
                  env={"ELASTIC_RDZV_HMAC_KEY_FILE": str(key_file)}) for n in ("node-a", "node-b"))
    wait_until(lambda: len(a.steps_at(2)) >= 20 and len(b.steps_at(2)) >= 20 and any(snaps.glob("step-*")),
               120, "two nodes to train 20 steps together and snapshot", on_timeout=lambda: a.log_tail() + b.log_tail())

    counted_before = {n.name: Counter(str(r["rank"]) for r in n.progress()) for n in (a, b)}
    code = main(["--once", "--interval", "1", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id,
                 "--rdzv-conf", f"hmac_key_file={key_file}"])
    counted_after = {n.name: Counter(str(r["rank"]) for r in n.progress()) for n in (a, b)}
    out = capsys.readouterr().out
    print(out)  # shown on failure: the table as a user sees it
    assert code == 0, out

    rows = table_rows(out)
    rank_of = {n.name: str(n.progress()[-1]["rank"]) for n in (a, b)}
    assert sorted(rows) == sorted(rank_of.items()) and sorted(rank_of.values()) == ["0", "1"], out
    assert f"run {run_id} · world 2 · 2 nodes" in out
    assert re.search(r"^goodput \d+\.\d % of [\d.]+ s since the first step \(productive ", out, re.M), out
    assert re.search(r"samples · newest snapshot [\d.]+ (ms|s) old", out), out
    for (node, rank), (_, _, state, steps, rate, p50, p99, compute, allreduce, busbw, age, restarts,
                       _note) in rows.items():
        where = f"{node}/{rank}: {rows[node, rank]}"
        assert state == "running", where
        # the step counter of that rank on that node: what its progress file counts, no more
        assert counted_before[node][rank] <= int(steps) <= counted_after[node][rank], (where, counted_after)
        assert int(steps) >= 20 and rate_of(rate) > 0, where
        assert all(re.fullmatch(r"[\d.]+ (µs|ms|s)", t) for t in (p50, p99, compute, allreduce)), where
        assert busbw.endswith("B/s") and rate_of(busbw) > 0, where
        assert restarts.isdigit(), where
        if rank == "0":  # rank 0 writes the snapshots: its node has the newest durable one
            assert re.fullmatch(r"[\d.]+ (ms|s)", age), where


def test_goodput_lines_show_the_share_the_causes_and_the_last_faults_phases() -> None:
    account = extend(Account(), [Interval(start=0, end=90, cause="productive", step=9),
                                 Interval(end=93, cause="detection", reason="peer_lost", nodes=("b",)),
                                 Interval(start=93, end=93.5, cause="rendezvous"),
                                 Interval(start=93.5, end=94, cause="restore"),
                                 Interval(start=94, end=100, cause="productive", step=10)])
    assert goodput_lines(account, now=110) == [
        "goodput 96.0 % of 100.0 s since the first step (productive 96.0 s; lost: detection 3.0 s, "
        "rendezvous 0.50 s, restore 0.50 s)",
        "last fault 20.00 s ago, peer_lost b: detection 3.0 s, rendezvous 0.50 s, restore 0.50 s (4.0 s)"]
    assert goodput_lines(None, now=0)[0].startswith("goodput: no record yet")


def test_unreachable_etcd_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    # free_port: nothing must listen there, so no bind race to lose (issue 40)
    code = main(["--once", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "r",
                 "--rdzv-conf", "connect_timeout=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: etcd at http://127.0.0.1:")
