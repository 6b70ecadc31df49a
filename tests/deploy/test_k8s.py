"""deploy/k8s: every manifest validates offline against the Kubernetes API schemas, the
kustomize overlays render, the pieces fit together (selectors, Secrets, ports, policies),
and the RBAC bootstrap script really limits the trainer to its prefix on a real etcd.

Schemas: `kubernetes-validate` (PyPI) bundles the OpenAPI-derived JSON schemas of every
Kubernetes minor release; we validate strictly (unknown fields are errors) against the
oldest release the manifests target and the newest bundled one. Rendering: kustomize as
built into kubectl (`kubectl kustomize`), or a standalone `kustomize`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install -e '.[dev]' (kubernetes-validate bundles the API schemas)"
)

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
# Elastic Indexed Jobs (changing completions with parallelism) need 1.27; 1.29 is the oldest
# release still common in managed clusters.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CRD_KINDS = {"PodMonitor", "PyTorchJob"}
MIN_ETCD = (3, 5, 26)

Doc = dict[str, Any]


def load_all(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def kustomize_cmd() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def render(directory: Path) -> list[Doc]:
    cmd = kustomize_cmd()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl (whose `kubectl kustomize` renders) is installed")
    done = subprocess.run(cmd + [str(directory)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(cmd)} {directory.relative_to(REPO)} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    return {name: render(K8S / "overlays" / name) for name in OVERLAYS}


def validate(doc: Doc) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            raise AssertionError(
                f"{doc['kind']} {doc['metadata'].get('name')}: {where}: {exc.message} (Kubernetes {version})"
            ) from None


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_spec(doc: Doc) -> Doc:
    if doc["kind"] == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return doc["spec"]["template"]["spec"]


def pod_labels(doc: Doc) -> dict[str, str]:
    if doc["kind"] == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"]
    return doc["spec"]["template"]["metadata"]["labels"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


# --- schemas -------------------------------------------------------------------------


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_validates_against_the_api_schemas(path: Path) -> None:
    docs = load_all(path)
    assert docs, f"{path} holds no manifest"
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue  # no bundled schema: checked structurally below
        validate(doc)


def test_rendered_overlays_validate(rendered: dict[str, list[Doc]]) -> None:
    for docs in rendered.values():
        for doc in docs:
            if doc["kind"] not in CRD_KINDS:
                validate(doc)


def test_base_renders_on_its_own() -> None:
    kinds = sorted({d["kind"] for d in render(K8S / "base")})
    assert kinds == sorted(
        ["ConfigMap", "Job", "Namespace", "NetworkPolicy", "PersistentVolumeClaim",
         "PodDisruptionBudget", "Service", "StatefulSet"]
    )


def test_podmonitor_is_well_formed_and_selects_the_trainers(rendered: dict[str, list[Doc]]) -> None:
    for docs in rendered.values():
        monitor = one(docs, "PodMonitor", "trainer")
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["namespace"] == "elastic"
        job = one(docs, "Job", "trainer")
        assert matches(monitor["spec"]["selector"]["matchLabels"], pod_labels(job))
        ports = {p["name"] for c in pod_spec(job)["containers"] for p in c.get("ports", [])}
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] in ports
            assert endpoint["path"] == "/metrics"
            assert set(endpoint) <= {"port", "path", "interval", "relabelings", "metricRelabelings", "scheme"}
            for rule in endpoint.get("relabelings", []):
                assert set(rule) <= {"sourceLabels", "targetLabel", "regex", "replacement", "action"}
                assert {"node", "run_id"} >= {rule["targetLabel"]}
            # as in deploy/prometheus: the series' own copy of the node (renamed exported_node) goes
            assert endpoint.get("metricRelabelings") == [{"action": "labeldrop", "regex": "exported_node"}]
        # The run_id relabel reads the pod label Kubernetes exposes under this name.
        sources = [r["sourceLabels"][0] for e in monitor["spec"]["podMetricsEndpoints"] for r in e["relabelings"]]
        label = next(s for s in sources if "label" in s)
        assert label == "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", "elastic/run-id")
        assert "elastic/run-id" in pod_labels(job)


def test_pytorchjob_points_kubeflow_at_etcd_v3() -> None:
    (job,) = load_all(K8S / "kubeflow" / "pytorchjob.yaml")
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    spec = job["spec"]
    assert set(spec) <= {"elasticPolicy", "pytorchReplicaSpecs", "runPolicy", "nprocPerNode"}
    policy = spec["elasticPolicy"]
    assert set(policy) <= {"minReplicas", "maxReplicas", "rdzvBackend", "rdzvPort", "rdzvHost", "rdzvId",
                           "rdzvConf", "standalone", "nProcPerNode", "maxRestarts", "metrics"}
    assert policy["rdzvBackend"] == "etcd-v3"
    assert policy["rdzvPort"] == 2379 and not policy.get("standalone")
    assert 1 <= policy["minReplicas"] <= spec["pytorchReplicaSpecs"]["Worker"]["replicas"] <= policy["maxReplicas"]
    assert policy["maxRestarts"] > 0, "with 0 the first node loss ends the job"
    assert all(set(item) == {"key", "value"} and isinstance(item["value"], str) for item in policy["rdzvConf"])
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] in {"OnFailure", "Always", "ExitCode", "Never"}
    # The operator injects its env into the container named "pytorch".
    assert [c["name"] for c in pod_spec(job)["containers"]] == ["pytorch"]
    # The pod template is a core PodTemplateSpec: validate it as one.
    validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "worker"},
              "template": worker["template"]})
    # rdzvHost is a name the etcd server certificate covers and a Service that exists.
    base = [d for p in (K8S / "base").glob("*.yaml") if p.name != "kustomization.yaml" for d in load_all(p)]
    one(base, "Service", policy["rdzvHost"])


# --- how the pieces fit ----------------------------------------------------------------


def test_etcd_is_three_members_with_tls_everywhere(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["cpu"]
    sts = one(docs, "StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3
    headless = one(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    (etcd,) = pod_spec(sts)["containers"]
    version = tuple(int(x) for x in re.search(r":v(\d+)\.(\d+)\.(\d+)$", etcd["image"]).groups())
    assert version >= MIN_ETCD, f"{etcd['image']}: etcd 3.5.0-3.5.2 lose data; pin >= 3.5.26"
    flags = dict(a.removeprefix("--").split("=", 1) for a in etcd["args"])
    assert flags["client-cert-auth"] == "true" and flags["peer-client-cert-auth"] == "true"
    assert flags["listen-client-urls"].startswith("https://")
    assert flags["listen-peer-urls"].startswith("https://")
    assert all(url.split("=", 1)[1].startswith("https://") for url in flags["initial-cluster"].split(","))
    assert len(flags["initial-cluster"].split(",")) == 3
    mounts = {m["mountPath"]: m for m in etcd["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
    for flag in ("trusted-ca-file", "cert-file", "key-file", "peer-trusted-ca-file", "peer-cert-file", "peer-key-file"):
        directory = str(Path(flags[flag]).parent)
        assert mounts[directory].get("readOnly") is True, f"{flag} must come from a read-only mount"
        assert "secret" in volumes[mounts[directory]["name"]], f"{flag} must come from a Secret"


def test_trainers_run_elastic_agent_behind_a_headless_service(rendered: dict[str, list[Doc]]) -> None:
    for name, docs in rendered.items():
        job = one(docs, "Job", "trainer")
        assert job["spec"]["completionMode"] == "Indexed"
        assert job["spec"]["completions"] == job["spec"]["parallelism"]
        spec = pod_spec(job)
        service = one(docs, "Service", spec["subdomain"])
        assert service["spec"]["clusterIP"] == "None"
        assert matches(service["spec"]["selector"], pod_labels(job))
        (agent,) = spec["containers"]
        assert agent["command"] == ["elastic", "agent"]
        assert any(a.startswith("--nnodes=") and ":" in a for a in agent["args"])
        env = {e["name"]: e for e in agent["env"]}
        assert env["ELASTIC_METRICS_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        # rank info's hostname = DCGM exporter's Hostname: the node's name, as its DaemonSet sets it
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert env["ELASTIC_RDZV_HMAC_KEY_FILE"]["value"].startswith("/etc/elastic/hmac/")
        mounts = {m["name"]: m for m in agent["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        for secret in ("trainer-etcd-tls", "trainer-hmac-key"):
            (volume,) = [v for v in volumes.values() if v.get("secret", {}).get("secretName") == secret]
            assert mounts[volume["name"]]["readOnly"] is True
        # Scrape annotations agree with the metrics port.
        annotations = job["spec"]["template"]["metadata"]["annotations"]
        (port,) = [p["containerPort"] for p in agent["ports"] if p["name"] == "metrics"]
        assert annotations["prometheus.io/port"] == str(port)
        assert service["spec"]["ports"][0]["port"] == port
        config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("trainer-config"))
        assert agent["envFrom"][0]["configMapRef"]["name"] == config["metadata"]["name"], "kustomize renames refs"
        assert config["data"]["ELASTIC_METRICS_PORT"] == str(port)
        backend = "--backend=nccl" if name == "gpu" else "--backend=gloo"
        assert backend in agent["args"]


def test_gpu_overlay_requests_gpus(rendered: dict[str, list[Doc]]) -> None:
    (agent,) = pod_spec(one(rendered["gpu"], "Job", "trainer"))["containers"]
    gpus = agent["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) >= 1 and agent["resources"]["requests"]["nvidia.com/gpu"] == gpus
    (cpu_agent,) = pod_spec(one(rendered["cpu"], "Job", "trainer"))["containers"]
    assert "nvidia.com/gpu" not in cpu_agent["resources"].get("limits", {})


def test_network_policy_lets_only_trainers_reach_etcds_client_port(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["cpu"]
    policy = one(docs, "NetworkPolicy", "etcd")
    sts = one(docs, "StatefulSet", "etcd")
    assert matches(policy["spec"]["podSelector"]["matchLabels"], pod_labels(sts))
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    allowed: dict[int, list[dict[str, str]]] = {}
    for rule in policy["spec"]["ingress"]:
        assert rule["ports"], "every rule names its ports"
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, "pods of this namespace only"
            for port in rule["ports"]:
                allowed.setdefault(port["port"], []).append(peer["podSelector"]["matchLabels"])
    assert set(allowed) == {2379, 2380}
    trainer = pod_labels(one(docs, "Job", "trainer"))
    bootstrap = pod_labels(one(docs, "Job", "etcd-rbac"))
    assert any(matches(sel, trainer) for sel in allowed[2379])
    assert any(matches(sel, bootstrap) for sel in allowed[2379])
    assert allowed[2379] == [{"app.kubernetes.io/name": "trainer"}, {"app.kubernetes.io/name": "etcd-rbac"}]
    assert allowed[2380] == [{"app.kubernetes.io/name": "etcd"}]
    # Kubeflow's workers carry the trainer label, so the same policy admits them.
    (kubeflow,) = load_all(K8S / "kubeflow" / "pytorchjob.yaml")
    assert any(matches(sel, pod_labels(kubeflow)) for sel in allowed[2379])


def test_nothing_runs_privileged_and_secrets_stay_out_of_the_repo(rendered: dict[str, list[Doc]]) -> None:
    for docs in rendered.values():
        assert not [d for d in docs if d["kind"] == "Secret"], "Secrets are made outside the repo"
        for doc in docs:
            if doc["kind"] not in {"Job", "StatefulSet"}:
                continue
            spec = pod_spec(doc)
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert spec.get("automountServiceAccountToken") is False
            assert not spec.get("hostNetwork")
            for container in spec["containers"]:
                assert container["securityContext"]["allowPrivilegeEscalation"] is False
                assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_every_secret_the_manifests_mount_is_made_in_the_deploy_guide(rendered: dict[str, list[Doc]]) -> None:
    guide = (REPO / "docs" / "deploy.md").read_text()
    docs = rendered["gpu"] + load_all(K8S / "kubeflow" / "pytorchjob.yaml")
    used: dict[str, set[str]] = {}
    for doc in docs:
        if doc["kind"] not in {"Job", "StatefulSet", "PyTorchJob"}:
            continue
        spec = pod_spec(doc)
        volumes = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        for container in spec["containers"]:
            text = " ".join(container.get("args", []) + [str(e.get("value", "")) for e in container.get("env", [])])
            for mount in container["volumeMounts"]:
                if mount["name"] in volumes:
                    files = re.findall(re.escape(mount["mountPath"]) + r"/([\w.-]+)", text)
                    used.setdefault(volumes[mount["name"]], set()).update(files)
    assert set(used) == {"etcd-server-tls", "etcd-peer-tls", "etcd-root-tls", "trainer-etcd-tls", "trainer-hmac-key"}
    for secret, files in used.items():
        made = re.search(rf"kubectl -n elastic create secret generic {secret}\b([^\n]*)", guide)
        assert made, f"docs/deploy.md must show how to create Secret {secret}"
        for name in files:
            assert f"={name}" in made.group(1) or f"/{name}" in made.group(1), f"{secret} lacks {name}"


def test_etcd_flags_reference_files_in_their_secrets() -> None:
    guide = (REPO / "docs" / "deploy.md").read_text()
    (sts,) = [d for d in load_all(K8S / "base" / "etcd.yaml") if d["kind"] == "StatefulSet"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in pod_spec(sts)["containers"][0]["args"])
    for flag, secret in (("cert-file", "etcd-server-tls"), ("peer-cert-file", "etcd-peer-tls")):
        line = re.search(rf"create secret generic {secret}\b([^\n]*)", guide).group(1)
        assert Path(flags[flag]).name in line and Path(flags[flag.replace("cert", "key")]).name in line


# --- the RBAC bootstrap, for real ------------------------------------------------------


def test_rbac_script_gives_trainer_its_prefix_and_nothing_else(tmp_path: Path) -> None:
    """The same etcd-rbac.sh the Job runs, against a real TLS etcd with client-cert auth:
    users log in by certificate CN, trainer may write only under /elastic/, monitor may
    only read, and a second run changes nothing."""
    from elastic.etcd import EmbeddedEtcd, EtcdClient, ServerTLS, find_etcd_binary, settings_from_options
    from elastic.etcd.client import EtcdError

    certs = tmp_path / "certs"
    subprocess.run([str(REPO / "deploy" / "certs" / "make-certs.sh"), str(certs), "127.0.0.1",
                    "--client", "root", "--client", "trainer", "--client", "monitor"],
                   check=True, capture_output=True)
    tls = ServerTLS(certs / "ca.pem", certs / "server.pem", certs / "server-key.pem")
    with EmbeddedEtcd(data_dir=tmp_path / "etcd", tls=tls) as server:
        env = {**os.environ,
               "PATH": f"{find_etcd_binary().parent}{os.pathsep}{os.environ['PATH']}",
               "ETCDCTL_ENDPOINTS": server.url, "ETCDCTL_CACERT": str(certs / "ca.pem"),
               "ETCDCTL_CERT": str(certs / "root.pem"), "ETCDCTL_KEY": str(certs / "root-key.pem"),
               "RBAC_PREFIX": "/elastic/"}
        script = str(K8S / "base" / "etcd-rbac.sh")
        for attempt in range(2):
            done = subprocess.run(["sh", script], env=env, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"run {attempt + 1}: {done.stderr}"
        assert "already enabled" in done.stdout

        def client(user: str) -> EtcdClient:
            conf = {"cacert": str(certs / "ca.pem"), "cert": str(certs / f"{user}.pem"),
                    "key": str(certs / f"{user}-key.pem")}
            return EtcdClient(settings_from_options(server.url, conf, env={}), retry_deadline=2.0)

        trainer, monitor = client("trainer"), client("monitor")
        try:
            trainer.call(lambda c: c.put("/elastic/run1/probe", b"ok"))
            with pytest.raises(EtcdError, match="(?i)permission|role|prefix"):
                trainer.call(lambda c: c.put("/other/probe", b"no"))
            value, _ = monitor.call(lambda c: c.get("/elastic/run1/probe"))
            assert value == b"ok"
            with pytest.raises(EtcdError, match="(?i)permission|role|prefix"):
                monitor.call(lambda c: c.put("/elastic/run1/probe", b"no"))
        finally:
            trainer.close()
            monitor.close()
