"""deploy/systemd: the units pass `systemd-analyze verify`, restart on failure, and read
their settings from the EnvironmentFile the guide installs."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "deploy" / "systemd"
UNITS = ("etcd.service", "elastic-agent.service")


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment, method-assign]  # configparser's way to keep case
    parser.read_string((SYSTEMD / name).read_text().replace("\\\n", " "))
    return parser


@pytest.mark.slow  # starts processes
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """verify also checks that ExecStart's binary exists, and the units name install paths
    (/usr/local/bin/etcd, /opt/elastic/bin/elastic). The copies verified here differ only
    in those paths, pointed at this checkout's etcd and elastic; every other line is the
    shipped one. Warnings (unknown keys, bad values) go to stderr with exit 0, so stderr
    must be empty too."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    from agent.etcd import find_etcd_binary

    venv_bin = Path(shutil.which("elastic") or REPO / ".venv" / "bin" / "elastic")
    assert venv_bin.exists(), "pip install -e . puts the `elastic` console script on PATH"
    swaps = {"/usr/local/bin/etcd": str(find_etcd_binary()), "/opt/elastic/bin/elastic": str(venv_bin)}
    copies = []
    for name in UNITS:
        text = (SYSTEMD / name).read_text()
        for old, new in swaps.items():
            text = text.replace(old + " ", new + " ")
        (tmp_path / name).write_text(text)
        copies.append(str(tmp_path / name))
    done = subprocess.run([analyze, "verify", *copies], capture_output=True, text=True, timeout=60)
    problems = [line for line in done.stderr.splitlines() if any(n in line for n in UNITS)]
    assert done.returncode == 0 and not problems, done.stderr


def test_agent_unit_restarts_on_failure_from_its_environment_file() -> None:
    service = unit("elastic-agent.service")["Service"]
    assert service["Restart"] == "on-failure"
    assert service["EnvironmentFile"] == "/etc/elastic/agent.env"
    assert service["ExecStart"].split()[:2] == ["/opt/elastic/bin/elastic", "agent"]
    assert service["User"] != "root"
    # torchrun puts workers in their own sessions: only cgroup-wide kills reach them.
    assert service.get("KillMode", "control-group") == "control-group"


def test_etcd_unit_is_tls_with_client_certs_and_restarts() -> None:
    service = unit("etcd.service")["Service"]
    assert service["Restart"] == "on-failure"
    assert service["EnvironmentFile"] == "/etc/etcd/etcd.env"
    assert service["Type"] == "notify" and service["User"] == "etcd"
    flags = dict(a.removeprefix("--").split("=", 1) for a in service["ExecStart"].split()[1:])
    assert flags["client-cert-auth"] == "true" and flags["peer-client-cert-auth"] == "true"
    assert all(u.startswith("https://") for u in flags["listen-client-urls"].split(","))
    assert flags["listen-peer-urls"].startswith("https://")
    assert flags["listen-metrics-urls"] == "http://127.0.0.1:2381", "plain-HTTP health on loopback only"


def test_agent_env_is_plain_assignments_for_the_agent() -> None:
    lines = [line for line in (SYSTEMD / "agent.env").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    pairs = dict(line.split("=", 1) for line in lines)
    assert all(key.isidentifier() and key.isupper() for key in pairs)
    assert pairs["ELASTIC_METRICS_ADDR"] not in {"0.0.0.0", "::"}, "metrics stay off public interfaces"
    assert "password" not in pairs["ELASTIC_RDZV_CONF"].split("password_file")[0]
    assert "ELASTIC_RDZV_HMAC_KEY_FILE" in pairs
    exec_start = unit("elastic-agent.service")["Service"]["ExecStart"]
    assert "$TRAINING_ARGS" in exec_start and "TRAINING_ARGS" in pairs
