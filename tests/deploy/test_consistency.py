"""The deploy files and docs/deploy.md use only what the agent accepts, so they cannot drift.

Every `elastic agent` command line in compose, Kubernetes (both overlays, Kubeflow Trainer
v2's TrainJob and the legacy PyTorchJob), systemd and the guide is parsed by the agent's own
parser (`agent.cli.build_agent_parser`) with the environment it would run under, including
the PET_* variables the Kubeflow operators inject. Every ELASTIC_* variable named anywhere under
deploy/ or in the guide is either `ELASTIC_<FLAG>` for a flag the parser has, or one the
rendezvous reads itself (job key, etcd password). Each ELASTIC_<FLAG>=value a deploy file
sets must mean the same as `--flag value`. Every `--rdzv-conf` key is one the etcd-v3
backend knows, and a password is never among them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.deploy.test_compose import resolved as compose_resolved
from tests.deploy.test_k8s import LEGACY_PYTORCHJOB, RUNTIME, TRAINJOB, load_all, pod_spec, render

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
GUIDE = REPO / "docs" / "deploy.md"
ENV_NAME = re.compile(r"\bELASTIC_[A-Z0-9_]*[A-Z0-9]\b")
K8S_VAR = re.compile(r"\$\((\w+)\)")
# What the files expect of the agent, beyond torchrun's parser (docs/deploy.md's table).
EXPECTED_DEFAULTS = {"--rdzv-backend": "etcd-v3", "--metrics-port": "10400", "--metrics-addr": "127.0.0.1",
                     "--lease-ttl": "3", "--hang-timeout": "auto"}


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """Exactly ``env`` on top of a copy without ELASTIC_*/PET_* (the parser may read env
    when it is built or when it parses; both happen inside)."""
    saved = dict(os.environ)
    try:
        for key in list(os.environ):
            if key.startswith(("ELASTIC_", "PET_", "TORCHELASTIC_")):
                del os.environ[key]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def build_parser() -> argparse.ArgumentParser:
    try:
        from agent.cli import build_agent_parser
    except ImportError as exc:
        pytest.fail(f"agent.cli.build_agent_parser is the agent's parser the deploy files are checked against: {exc}")
    return build_agent_parser()


def agent_parse(args: list[str], env: dict[str, str] | None = None, where: str = "") -> argparse.Namespace:
    with environment(env or {}):
        parser = build_parser()
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                return parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{where}: `elastic agent {shlex.join(args)}` is refused: {err.getvalue().strip().splitlines()[-1]}")


def flag_env_names() -> dict[str, str]:
    """ELASTIC_<FLAG> -> the long option, for every long option of the agent's parser."""
    with environment({}):
        parser = build_parser()
    names = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                names["ELASTIC_" + option[2:].upper().replace("-", "_")] = option
    return names


def library_env_names() -> set[str]:
    from elastic.contract import ETCD_PASSWORD_ENV, ETCD_PASSWORD_FILE_ENV, HMAC_KEY_ENV, HMAC_KEY_FILE_ENV

    return {ETCD_PASSWORD_ENV, ETCD_PASSWORD_FILE_ENV, HMAC_KEY_ENV, HMAC_KEY_FILE_ENV}


# --- where the agent is started --------------------------------------------------------


def compose_invocations() -> Iterator[tuple[str, list[str], dict[str, str]]]:
    compose = compose_resolved({})
    for name, service in compose["services"].items():
        entry = service.get("entrypoint") or []
        if entry[:2] == ["sh", "-c"] and "exec elastic agent" in entry[2]:
            env = {k: str(v) for k, v in service["environment"].items()}
            for assignment in re.findall(r"export (ELASTIC_\w+)=", entry[2]):
                env[assignment] = "172.18.0.5"  # set from `hostname -i` at start
            yield f"compose service {name}", list(service["command"]), env


def container_env(container: dict[str, Any], config: dict[str, str],
                  fields: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet builds it: $(VAR) in a value expands to
    a variable defined earlier; the downward API gives ``fields[fieldPath]``, a pod IP, or
    a pod name."""
    env = dict(config)
    fields = {"status.podIP": "10.244.1.7", **(fields or {})}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = K8S_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), item["value"])
        else:
            env[item["name"]] = fields.get(item["valueFrom"]["fieldRef"]["fieldPath"], "trainer-0-abcde")
    return env


def k8s_invocations() -> Iterator[tuple[str, list[str], dict[str, str]]]:
    for overlay in ("cpu", "gpu"):
        docs = render(DEPLOY / "k8s" / "overlays" / overlay)
        configs = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
        for doc in docs:
            if doc["kind"] not in {"Job", "StatefulSet"}:
                continue
            for container in pod_spec(doc)["containers"]:
                if container.get("command", [])[:2] != ["elastic", "agent"]:
                    continue
                config: dict[str, str] = {}
                for source in container.get("envFrom", []):
                    config.update(configs[source["configMapRef"]["name"]])
                env = container_env(container, config)
                args = [K8S_VAR.sub(lambda m: env[m.group(1)], a) for a in container["command"][2:] + container["args"]]
                yield f"k8s overlay {overlay} {doc['kind']}/{doc['metadata']['name']}", args, env


def kubeflow_invocation() -> tuple[str, list[str], dict[str, str]]:
    """What Kubeflow's (legacy) training operator hands the container: torchrun's PET_* variables."""
    (job,) = load_all(LEGACY_PYTORCHJOB)
    policy = job["spec"]["elasticPolicy"]
    (container,) = pod_spec(job)["containers"]
    env = container_env(container, {})
    env.update({
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_RDZV_ENDPOINT": f"{policy['rdzvHost']}:{policy['rdzvPort']}",
        "PET_RDZV_ID": policy["rdzvId"],
        "PET_RDZV_CONF": ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"]),
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
    })
    return "kubeflow/legacy/pytorchjob.yaml", container["command"][2:] + container["args"], env


def trainjob_invocation() -> tuple[str, list[str], dict[str, str]]:
    """What Kubeflow Trainer v2 makes of trainjob.yaml on elastic-runtime.yaml: the runtime's
    `node` container with the TrainJob's args and env upserted (kubeflow/trainer, the jobset
    plugin's Trainer()), and the torch plugin's PET_* variables (its EnforceMLPolicy)."""
    (runtime,) = load_all(RUNTIME)
    (trainjob,) = load_all(TRAINJOB)
    trainer = trainjob["spec"]["trainer"]
    (container,) = pod_spec(runtime)["containers"]
    names = {e["name"] for e in trainer.get("env", [])}
    container = {**container, "env": [e for e in container["env"] if e["name"] not in names] + trainer.get("env", [])}
    name = trainjob["metadata"]["name"]
    pod = {"metadata.name": f"{name}-node-0-1-abcde",
           "metadata.labels['jobset.sigs.k8s.io/jobset-name']": name}
    env = container_env(container, {}, pod)
    env.update({
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
        "PET_MASTER_PORT": "29400",
    })
    args = trainer.get("args", container["args"])
    return "kubeflow/trainjob.yaml", trainer.get("command", container["command"])[2:] + args, env


def agent_env_file() -> dict[str, str]:
    lines = (DEPLOY / "systemd" / "agent.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def systemd_invocation() -> tuple[str, list[str], dict[str, str]]:
    env = agent_env_file()
    text = (DEPLOY / "systemd" / "elastic-agent.service").read_text()
    (exec_start,) = re.findall(r"^ExecStart=(.+)$", text, re.M)
    words = exec_start.split()
    assert words[:2] == ["/opt/elastic/bin/elastic", "agent"]
    args = [w for word in words[2:] for w in (env[word[1:]].split() if word.startswith("$") else [word])]
    return "systemd elastic-agent.service + agent.env", args, env


def guide_commands(program: str) -> Iterator[list[str]]:
    """Every `elastic PROGRAM ...` line in the guide's shell blocks, continuations joined."""
    for block in re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for i in range(len(words) - 1):
                if words[i].endswith("elastic") and words[i + 1] == program:
                    rest = words[i + 2:]
                    stop = next((j for j, w in enumerate(rest) if w in {"|", "&&", "||", ";", ">"}), len(rest))
                    yield rest[:stop]


def all_invocations() -> list[tuple[str, list[str], dict[str, str]]]:
    found = list(compose_invocations()) + list(k8s_invocations())
    found += [kubeflow_invocation(), trainjob_invocation(), systemd_invocation()]
    found += [("docs/deploy.md", args, {}) for args in guide_commands("agent")]
    return found


@pytest.fixture(scope="module")
def invocations() -> list[tuple[str, list[str], dict[str, str]]]:
    return all_invocations()


# --- the tests -------------------------------------------------------------------------


def test_the_agent_has_the_defaults_the_deploy_files_rely_on() -> None:
    defaults = vars(agent_parse(["train.py"]))
    for option, value in EXPECTED_DEFAULTS.items():
        dest = option[2:].replace("-", "_")
        given = vars(agent_parse([option, value, "train.py"]))[dest]
        assert defaults[dest] == given, f"{option} defaults to {defaults[dest]!r}, not {value}"
    for option in ("--node-name", "--metrics-port", "--metrics-addr", "--lease-ttl", "--hang-timeout",
                   "--snapshot-dir", "--nnodes", "--rdzv-conf", "--max-restarts"):
        assert "ELASTIC_" + option[2:].upper().replace("-", "_") in flag_env_names()


@pytest.mark.slow  # starts processes
def test_every_elastic_agent_command_line_parses(invocations: list[tuple[str, list[str], dict[str, str]]]) -> None:
    places = {w.split()[0] for w, _, _ in invocations}
    assert {"compose", "k8s", "kubeflow/legacy/pytorchjob.yaml", "kubeflow/trainjob.yaml", "systemd",
            "docs/deploy.md"} <= places
    for where, args, env in invocations:
        ns = agent_parse(args, env, where)
        assert ns.rdzv_backend == "etcd-v3", f"{where}: rendezvous backend {ns.rdzv_backend}"
        assert ns.rdzv_endpoint and ns.rdzv_id not in {None, "", "none"}, f"{where}: no etcd endpoint or run id"
        assert not str(ns.rdzv_endpoint).startswith("localhost"), f"{where}: etcd left at the default"
        assert re.fullmatch(r"\d+:\d+", str(ns.nnodes)), f"{where}: --nnodes {ns.nnodes} is not MIN:MAX"
        low, high = map(int, str(ns.nnodes).split(":"))
        assert 1 <= low <= high, where
        assert int(ns.max_restarts) > 0, f"{where}: with --max-restarts 0 the first node loss ends the job"
        assert ns.module and ns.training_script == "elastic.train", f"{where}: runs {ns.training_script}"
        for host_port in str(ns.rdzv_endpoint).split(","):
            assert host_port.rsplit(":", 1)[1] == "2379", f"{where}: etcd's client port is 2379"
        assert ns.metrics_addr not in {"0.0.0.0", "::"}, f"{where}: metrics on every interface"
        conf = dict(item.split("=", 1) for item in str(ns.rdzv_conf).split(",") if item)
        assert {"cacert", "cert", "key"} <= set(conf), f"{where}: etcd without TLS client certificates"
        assert conf.get("hmac_key_file") or env.get("ELASTIC_RDZV_HMAC_KEY_FILE") or where == "docs/deploy.md", \
            f"{where}: no HMAC job key"


def test_every_elastic_env_var_in_deploy_files_is_one_the_agent_reads() -> None:
    known = set(flag_env_names()) | library_env_names()
    files = [p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix not in {".pem", ".json"}] + [GUIDE]
    unknown: dict[str, list[str]] = {}
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for name in set(ENV_NAME.findall(text)) - known:
            unknown.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert not unknown, f"neither an agent flag's ELASTIC_<FLAG> nor read by the rendezvous: {unknown}"


def env_assignments() -> Iterator[tuple[str, str, str]]:
    for where, _, env in all_invocations():
        for name, value in env.items():
            yield where, name, value


@pytest.mark.slow  # starts processes
def test_each_elastic_flag_variable_means_what_the_flag_means() -> None:
    flags = flag_env_names()
    checked = set()
    for where, name, value in env_assignments():
        if name not in flags or (name, value) in checked:
            continue
        checked.add((name, value))
        from_env = agent_parse(["train.py"], {name: value}, f"{where} {name}={value}")
        from_flag = agent_parse([flags[name], value, "train.py"], {}, f"{where} {flags[name]} {value}")
        assert vars(from_env) == vars(from_flag), f"{where}: {name}={value} differs from {flags[name]} {value}"
    names = {name for name, _ in checked}
    assert {"ELASTIC_NNODES", "ELASTIC_RDZV_CONF", "ELASTIC_METRICS_ADDR", "ELASTIC_LEASE_TTL",
            "ELASTIC_HANG_TIMEOUT", "ELASTIC_SNAPSHOT_DIR", "ELASTIC_NODE_NAME"} <= names


def test_the_flag_table_in_the_guide_matches_the_parser() -> None:
    flags = flag_env_names()
    rows = re.findall(r"^\| `(--[a-z-]+)[^`]*` \(`(ELASTIC_[A-Z_]+)`\) \|([^|]*)\|", GUIDE.read_text(), re.M)
    assert len(rows) >= 9
    defaults = vars(agent_parse(["train.py"]))
    for option, env_name, default in rows:
        assert flags.get(env_name) == option or env_name == "ELASTIC_" + option[2:].upper().replace("-", "_")
        assert env_name in flags, f"the guide lists {option} ({env_name}), which the agent lacks"
        shown = default.strip()
        if re.fullmatch(r"`[^`]+`|[0-9.]+|auto", shown):  # a literal, not prose like "host name"
            dest = option[2:].replace("-", "_")
            given = vars(agent_parse([option, shown.strip("`"), "train.py"]))[dest]
            assert defaults[dest] == given, f"the guide says {option} defaults to {shown}; it is {defaults[dest]!r}"


def conf_strings() -> Iterator[tuple[str, str]]:
    for where, args, env in all_invocations():
        yield where, str(agent_parse(args, env, where).rdzv_conf)
    compose = compose_resolved({})
    sd = compose["services"]["sd"]["command"]
    yield "compose sd", sd[sd.index("--rdzv-conf") + 1]
    for match in re.finditer(r"--rdzv-conf[ =]([^\s`]+)", GUIDE.read_text()):
        yield "docs/deploy.md", match.group(1)
    for path in (DEPLOY / "k8s").rglob("*.yaml"):
        for match in re.finditer(r"rdzv-conf=([^\s\"']+)", path.read_text()):
            yield str(path.relative_to(REPO)), match.group(1)
    for path in [DEPLOY / "systemd" / "agent.env", DEPLOY / "compose" / "docker-compose.yml"]:
        for match in re.finditer(r"ELASTIC_RDZV_CONF[=:] ?([^\s\"']+)", path.read_text()):
            yield str(path.relative_to(REPO)), match.group(1)


@pytest.mark.slow  # starts processes
def test_rdzv_conf_keys_are_known_and_never_a_password() -> None:
    from agent.rendezvous.options import KNOWN_KEYS

    seen = set()
    for where, text in conf_strings():
        for item in filter(None, text.split(",")):
            key, sep, _ = item.partition("=")
            assert sep, f"{where}: {item!r} is not key=value"
            assert key in KNOWN_KEYS, f"{where}: unknown --rdzv-conf key {key!r} (known: {sorted(KNOWN_KEYS)})"
            assert key != "password", f"{where}: a password on the command line shows in ps"
            seen.add(key)
    assert {"cacert", "cert", "key", "key_prefix", "hmac_key_file"} <= seen


def test_elastic_sd_command_lines_parse() -> None:
    from agent.tools.sd import add_arguments

    commands = [("docs/deploy.md", args) for args in guide_commands("sd")]
    commands.append(("compose sd", compose_resolved({})["services"]["sd"]["command"][1:]))
    assert len(commands) >= 2
    for where, args in commands:
        parser = argparse.ArgumentParser(prog="elastic sd")
        add_arguments(parser)
        err = io.StringIO()
        with environment({}):
            try:
                with contextlib.redirect_stderr(err):
                    ns = parser.parse_args(args)
            except SystemExit:
                pytest.fail(f"{where}: `elastic sd {shlex.join(args)}` is refused: {err.getvalue().strip().splitlines()[-1]}")
        assert ns.bind == "127.0.0.1", f"{where}: the target list names every host; keep it on loopback"


def test_kubeflows_pet_variables_reach_the_agent() -> None:
    """The training operator configures torchrun only through PET_*; the agent's own
    defaults (etcd-v3, localhost:2379, its max-restarts) must not mask them."""
    where, args, env = kubeflow_invocation()
    ns = agent_parse(args, env, where)
    assert ns.nnodes == env["PET_NNODES"]
    assert ns.rdzv_backend == env["PET_RDZV_BACKEND"] == "etcd-v3"
    assert ns.rdzv_endpoint == env["PET_RDZV_ENDPOINT"], "PET_RDZV_ENDPOINT is masked by the agent's default"
    assert ns.rdzv_id == env["PET_RDZV_ID"]
    assert str(ns.max_restarts) == env["PET_MAX_RESTARTS"], "PET_MAX_RESTARTS is masked by the agent's default"
    assert ns.rdzv_conf == env["PET_RDZV_CONF"]


def test_trainer_v2s_fixed_pet_nnodes_does_not_pin_the_trainjob() -> None:
    """Trainer v2 sets PET_NNODES to numNodes; the runtime's ELASTIC_NNODES (MIN:MAX) wins,
    while the rest of what Trainer injects (PET_NPROC_PER_NODE) still reaches the agent."""
    where, args, env = trainjob_invocation()
    ns = agent_parse(args, env, where)
    assert ns.nnodes == env["ELASTIC_NNODES"] != env["PET_NNODES"]
    assert str(ns.nproc_per_node) == env["PET_NPROC_PER_NODE"]
    assert ns.rdzv_id == "resnet-trainjob" and ns.snapshot_dir == "/snapshots/resnet-trainjob", "one run per TrainJob"
