"""deploy/compose: the compose file parses, names only pinned images and paths that exist
(or that init.sh makes), and its services, ports and secrets agree with each other, with
the Dockerfile and with Prometheus' config. No docker daemon is needed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "deploy" / "compose"
COMPOSE = COMPOSE_DIR / "docker-compose.yml"
DOCKERFILE = COMPOSE_DIR / "Dockerfile"
MIN_ETCD = (3, 5, 26)
_VAR = re.compile(r"\$\{(\w+)(?:(:?-)([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default}; $$ is a literal $."""
    def sub(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if name in env and (op != ":-" or env[name]):
            return env[name]
        if op is None:
            raise AssertionError(f"${{{name}}} has no default and is not in .env.example")
        return default
    return _VAR.sub(sub, text).replace("$$", "$")


def resolved(env: dict[str, str]) -> dict[str, Any]:
    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return interpolate(node, env)
        if isinstance(node, list):
            return [walk(n) for n in node]
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node
    return walk(yaml.safe_load(COMPOSE.read_text()))


def env_example() -> dict[str, str]:
    pairs = {}
    for line in (COMPOSE_DIR / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return resolved({})


@pytest.fixture(scope="module")
def made_secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("secrets")
    done = subprocess.run([str(COMPOSE_DIR / "init.sh"), str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return out


def bind_sources(service: dict[str, Any]) -> list[str]:
    sources = []
    for volume in service.get("volumes", []):
        source = volume.split(":")[0] if isinstance(volume, str) else volume["source"]
        if source.startswith((".", "/")):
            sources.append(source)
    return sources


def test_env_example_has_the_same_defaults_as_the_compose_file() -> None:
    env = env_example()
    used = {m[0] for m in _VAR.findall(COMPOSE.read_text())}
    assert used <= set(env), f"not in .env.example: {sorted(used - set(env))}"
    assert resolved(env) == resolved({}), ".env.example must show the defaults docker-compose.yml has"


def test_every_image_is_pinned_and_etcd_is_recent(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        image = service["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin {image}"
    etcd = compose["services"]["etcd"]["image"]
    version = tuple(int(x) for x in re.search(r":v(\d+)\.(\d+)\.(\d+)$", etcd).groups())
    assert version >= MIN_ETCD, f"{etcd}: etcd 3.5.0-3.5.2 lose data; use >= 3.5.26"


def test_images_we_build_come_from_the_dockerfile_that_exists(compose: dict[str, Any]) -> None:
    built = {n: s for n, s in compose["services"].items() if "build" in s}
    assert {"trainer", "trainer-gpu", "etcd-rbac", "sd"} <= set(built)
    for name, service in built.items():
        context = (COMPOSE_DIR / service["build"]["context"]).resolve()
        assert context == REPO, f"{name}: the build context is the repository root"
        assert (context / service["build"]["dockerfile"]).resolve() == DOCKERFILE
        assert service["image"].startswith("elastic-trainer:")
    # The etcd image that the Dockerfile copies etcdctl from is the one compose runs.
    assert compose["services"]["trainer"]["build"]["args"]["ETCD_IMAGE"] == compose["services"]["etcd"]["image"]
    assert f"ARG ETCD_IMAGE={compose['services']['etcd']['image']}" in DOCKERFILE.read_text()


def test_dockerfile_installs_this_project_from_paths_that_exist() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert "download.pytorch.org/whl/cpu" in text, "the cpu image takes torch's CPU wheels"
    copied = [src for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M) for src in line.split()[:-1]]
    assert {"pyproject.toml", "elastic", "agent", "checkpoints"} <= set(copied)
    for src in copied:
        assert (REPO / src).exists(), f"Dockerfile copies {src}, which is not in the repo"
    ignore = (COMPOSE_DIR / "Dockerfile.dockerignore").read_text().split()
    for src in copied:
        assert f"!{src}" in ignore or f"!{src}/" in ignore, f"Dockerfile.dockerignore drops {src}"
    assert re.search(r"^RUN pip install '\.\[s3\]'", text, re.M)  # boto3, for s3:// snapshot locations
    assert re.search(r"^USER 10001$", text, re.M), "the image runs unprivileged (as the k8s pods do)"


def test_bind_mounts_name_repo_paths_that_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for source in bind_sources(service):
            path = (COMPOSE_DIR / source).resolve()
            assert path.exists(), f"{name} mounts {source}, which does not exist ({path})"
            assert REPO in path.parents, f"{name} mounts {source} from outside the repo"


@pytest.mark.slow  # starts processes
def test_secrets_are_all_made_by_init_sh(compose: dict[str, Any], made_secrets: Path) -> None:
    defined = compose["secrets"]
    for name, secret in defined.items():
        relative = Path(secret["file"])
        assert relative.parts[0] == "secrets", f"{name}: secrets live in deploy/compose/secrets/ (gitignored)"
        assert (made_secrets / relative.name).is_file(), f"init.sh does not make {relative.name}"
    for name, service in compose["services"].items():
        assert set(service.get("secrets", [])) <= set(defined), f"{name} uses an undefined secret"
    assert "/secrets/" in (COMPOSE_DIR / ".gitignore").read_text().split()


def test_published_ports_are_loopback_only(compose: dict[str, Any]) -> None:
    published = {}
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            host_ip, host_port, container_port = str(port).split(":")
            assert host_ip == "127.0.0.1", f"{name} publishes {port} beyond this host"
            published[name] = int(container_port)
    assert published == {"etcd": 2379, "prometheus": 9090, "grafana": 3000}
    for name in ("trainer", "trainer-gpu"):
        assert "ports" not in compose["services"][name], "--scale needs trainers without host ports"


def test_trainers_use_tls_hmac_and_their_metrics_port(compose: dict[str, Any]) -> None:
    for name in ("trainer", "trainer-gpu"):
        service = compose["services"][name]
        env = service["environment"]
        assert env["ELASTIC_RDZV_ENDPOINT"].split(":")[0] in compose["services"]
        conf = dict(item.split("=", 1) for item in env["ELASTIC_RDZV_CONF"].split(","))
        for key in ("cacert", "cert", "key"):
            assert Path(conf[key]).name in service["secrets"]
        assert Path(env["ELASTIC_RDZV_HMAC_KEY_FILE"]).name in service["secrets"]
        assert service["expose"] == [env["ELASTIC_METRICS_PORT"]]
        assert service["depends_on"]["etcd-rbac"]["condition"] == "service_completed_successfully"
        assert service["entrypoint"][:2] == ["sh", "-c"] and "exec elastic agent" in service["entrypoint"][2]
        assert "ELASTIC_METRICS_ADDR" in service["entrypoint"][2], "metrics bind the container's own address"
    assert compose["services"]["trainer"]["profiles"] == ["cpu"]
    assert "gloo" in compose["services"]["trainer"]["command"]
    assert compose["services"]["trainer-gpu"]["profiles"] == ["gpu"]


def test_etcd_runs_tls_with_client_certs_a_health_check_and_a_volume(compose: dict[str, Any]) -> None:
    etcd = compose["services"]["etcd"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in etcd["command"][1:])
    assert flags["client-cert-auth"] == "true"
    assert flags["listen-client-urls"].startswith("https://")
    assert flags["listen-peer-urls"].startswith("http://127.0.0.1:"), "a single member keeps peers on loopback"
    for flag in ("trusted-ca-file", "cert-file", "key-file"):
        assert Path(flags[flag]).name in etcd["secrets"]
    assert etcd["healthcheck"]["test"][0] == "CMD"
    volume = etcd["volumes"][0].split(":")
    assert volume[0] in compose["volumes"] and flags["data-dir"].startswith(volume[1])
    rbac = compose["services"]["etcd-rbac"]
    assert rbac["depends_on"]["etcd"]["condition"] == "service_healthy"


def test_prometheus_reaches_elastic_sd_where_prometheus_yml_looks(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    mounted = {v.split(":")[1]: (COMPOSE_DIR / v.split(":")[0]).resolve()
               for v in prometheus["volumes"] if v.startswith(".")}
    config_path = mounted["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(config_path.read_text())
    urls = [sd["url"] for job in config["scrape_configs"] for sd in job.get("http_sd_configs", [])]
    sd = compose["services"]["sd"]
    assert sd["network_mode"] == "service:prometheus", "sd shares Prometheus' loopback"
    args = sd["command"]
    port, bind = args[args.index("--port") + 1], args[args.index("--bind") + 1]
    assert f"http://{bind}:{port}/targets" in urls
    assert "monitor.pem" in args[args.index("--rdzv-conf") + 1], "sd reads etcd with the read-only user"
    for rule_file in config.get("rule_files", []):
        assert (config_path.parent / rule_file).exists()
        assert any(str(Path("/etc/prometheus") / rule_file).startswith(target) for target in mounted)


def test_depends_on_and_profiles_name_real_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dependency in service.get("depends_on", []):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        mode = service.get("network_mode", "")
        if mode.startswith("service:"):
            assert mode.split(":", 1)[1] in services
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in compose["volumes"], f"{name} uses undeclared volume {source}"


def test_grafana_finds_prometheus_and_the_dashboards_where_provisioning_says(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = {v.split(":")[1]: (COMPOSE_DIR / v.split(":")[0]).resolve() for v in grafana["volumes"] if v.startswith(".")}
    provisioning = mounts["/etc/grafana/provisioning"]
    for path in (provisioning / "datasources").glob("*.y*ml"):
        for source in yaml.safe_load(path.read_text())["datasources"]:
            host, port = re.match(r"https?://([^:/]+):(\d+)", source["url"]).groups()
            assert host in compose["services"], f"{path.name}: {host} is no compose service"
            ports = [p.split(":")[-1] for p in compose["services"][host].get("ports", [])]
            assert port in ports
    for path in (provisioning / "dashboards").glob("*.y*ml"):
        for provider in yaml.safe_load(path.read_text())["providers"]:
            target = provider["options"]["path"]
            assert target in mounts and list(mounts[target].glob("*.json")), f"no dashboards at {target}"
