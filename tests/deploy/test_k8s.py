"""deploy/k8s: every manifest validates offline against the Kubernetes API schemas, the
kustomize overlays render, the pieces fit together (selectors, Secrets, ports, policies),
and the RBAC bootstrap script really limits the trainer to its prefix on a real etcd.

Schemas: `kubernetes-validate` (PyPI) bundles the OpenAPI-derived JSON schemas of every
Kubernetes minor release; we validate strictly (unknown fields are errors) against the
oldest release the manifests target and the newest bundled one. Kubeflow Trainer v2's
TrainJob and ClusterTrainingRuntime (with the JobSet spec inside) are validated just as
strictly against `kubeflow-trainer-api`'s models (tests/deploy/crd_schemas.py), and the Job
template inside a runtime against kubernetes-validate too. Rendering: kustomize as built
into kubectl (`kubectl kustomize`), or a standalone `kustomize`.
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
OVERLAYS = ("cpu", "gpu", "s3")
# Elastic Indexed Jobs (changing completions with parallelism) need 1.27; 1.29 is the oldest
# release still common in managed clusters.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CRD_KINDS = {"PodMonitor", "PyTorchJob", "TrainJob", "ClusterTrainingRuntime"}
KUBEFLOW = K8S / "kubeflow"
LEGACY_PYTORCHJOB = KUBEFLOW / "legacy" / "pytorchjob.yaml"
RUNTIME = KUBEFLOW / "elastic-runtime.yaml"
TRAINJOB = KUBEFLOW / "trainjob.yaml"
TRAINER_STEP = {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}  # Trainer finds its nodes by it
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


def trainer_job(runtime: Doc) -> Doc:
    """The replicatedJob of a training runtime whose pods are the training nodes."""
    (job,) = [r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]
              if r["template"].get("metadata", {}).get("labels", {}).items() >= TRAINER_STEP.items()]
    return job


def pod_template(doc: Doc) -> Doc:
    if doc["kind"] == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    if doc["kind"] == "ClusterTrainingRuntime":
        return trainer_job(doc)["template"]["spec"]["template"]
    return doc["spec"]["template"]


def pod_spec(doc: Doc) -> Doc:
    return pod_template(doc)["spec"]


def pod_labels(doc: Doc) -> dict[str, str]:
    return pod_template(doc)["metadata"]["labels"]


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
        if doc["apiVersion"].startswith("trainer.kubeflow.org/"):
            from tests.deploy.crd_schemas import validate_crd  # skips without kubeflow-trainer-api

            validate_crd(doc)
        elif doc["kind"] in CRD_KINDS:
            continue  # no bundled schema: checked structurally below
        else:
            validate(doc)


@pytest.mark.slow  # starts processes
def test_rendered_overlays_validate(rendered: dict[str, list[Doc]]) -> None:
    for docs in rendered.values():
        for doc in docs:
            if doc["kind"] not in CRD_KINDS:
                validate(doc)


@pytest.mark.slow  # starts processes
def test_base_renders_on_its_own() -> None:
    kinds = sorted({d["kind"] for d in render(K8S / "base")})
    assert kinds == sorted(
        ["ConfigMap", "Job", "Namespace", "NetworkPolicy", "PersistentVolumeClaim",
         "PodDisruptionBudget", "Service", "StatefulSet"]
    )


@pytest.mark.slow  # starts processes
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
        # Kubeflow Trainer v2's pods too (their run_id comes from JobSet's label, tested below).
        (runtime,) = load_all(RUNTIME)
        assert matches(monitor["spec"]["selector"]["matchLabels"], pod_labels(runtime))
        assert {p["name"] for c in pod_spec(runtime)["containers"] for p in c["ports"]} >= {
            e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}


def prometheus_label(name: str) -> str:
    """How Kubernetes service discovery exposes pod label ``name`` to relabeling."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


@pytest.mark.slow  # starts processes
def test_podmonitor_gives_each_pod_its_run_id_in_a_real_prometheus(tmp_path: Path) -> None:
    """The PodMonitor's relabelings, as the Prometheus Operator writes them into Prometheus's
    config, applied by a real Prometheus to targets that carry what Kubernetes discovery
    would: a base Job pod (elastic/run-id), a TrainJob pod (only JobSet's label), and a pod
    with both (our label wins). Only the discovery is stood in for: static targets with the
    same __meta_* labels."""
    from agent.etcd import free_port
    from tests.support.prometheus import PrometheusServer, ensure_prometheus
    from tests.support.waiting import wait_until

    ensure_prometheus()
    (monitor,) = load_all(K8S / "components" / "prometheus-operator" / "podmonitor.yaml")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label", "regex": "regex",
            "replacement": "replacement", "action": "action"}
    relabel = [{keys[k]: v for k, v in rule.items()} for rule in endpoint["relabelings"]]
    run_id = prometheus_label("elastic/run-id")
    jobset = prometheus_label(JOBSET_NAME_LABEL)
    pods = {
        "trainer-0-abcde": {run_id: "resnet-demo"},
        "resnet-trainjob-node-0-1-xyz": {jobset: "resnet-trainjob"},
        "both-0": {run_id: "ours", jobset: "theirs"},
    }
    # free_port: nothing must listen there, so no bind race to lose (issue 40) (only the relabelled pod names are checked)
    static = [{"targets": [f"127.0.0.1:{free_port()}"],
               "labels": {"__meta_kubernetes_pod_name": name, **labels}} for name, labels in pods.items()]
    config = {"global": {"scrape_interval": "1h"},
              "scrape_configs": [{"job_name": "podmonitor", "static_configs": static, "relabel_configs": relabel}]}
    server = PrometheusServer(tmp_path / "prom", yaml.safe_dump(config)).start()
    try:
        found = wait_until(lambda: len(server.targets("podmonitor")) == 3 and server.targets("podmonitor"),
                           30, "prometheus to list the three targets", on_timeout=server.tail)
        assert [(node, rid) for node, rid, _ in found] == [
            ("both-0", "ours"), ("resnet-trainjob-node-0-1-xyz", "resnet-trainjob"), ("trainer-0-abcde", "resnet-demo")]
    finally:
        server.stop()


def test_legacy_pytorchjob_points_kubeflow_at_etcd_v3() -> None:
    (job,) = load_all(LEGACY_PYTORCHJOB)
    assert LEGACY_PYTORCHJOB.read_text().startswith("# LEGACY"), "say so before anything else"
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


# --- Kubeflow Trainer v2: a TrainJob on the elastic-agent runtime ---------------------

# JobSet v1alpha2's failure policy: the actions its CRD's enum admits and the rule-name
# pattern its webhook checks (kubernetes-sigs/jobset, api/jobset/v1alpha2/jobset_types.go).
# The generated models carry neither, so they are checked here.
JOBSET_ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts", "RestartJob",
                  "RestartJobAndIgnoreMaxRestarts"}
JOBSET_RULE_NAME = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")
# Trainer's torch plugin injects these, and its webhook refuses them in a TrainJob's env
# (kubeflow/trainer, pkg/constants TorchRunReservedEnvNames).
TORCHRUN_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
# JobSet labels every pod with its JobSet's name, which Trainer gives the TrainJob's.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"


def kubeflow_v2() -> tuple[Doc, Doc]:
    (runtime,) = load_all(RUNTIME)
    (trainjob,) = load_all(TRAINJOB)
    return runtime, trainjob


def node_container(runtime: Doc) -> Doc:
    (container,) = pod_spec(runtime)["containers"]
    return container


def test_trainer_v2_recipe_validates_against_the_trainer_and_jobset_schemas() -> None:
    from tests.deploy.crd_schemas import validate_crd

    runtime, trainjob = kubeflow_v2()
    validate_crd(runtime)
    validate_crd(trainjob)
    # The child Job as Trainer makes it (parallelism = completions = numNodes), against the
    # Kubernetes releases we target: backoffLimitPerIndex and podReplacementPolicy are beta
    # and on by default in 1.29.
    template = trainer_job(runtime)["template"]
    nodes = trainjob["spec"]["trainer"]["numNodes"]
    validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "resnet-trainjob-node-0"},
              "spec": {**template["spec"], "parallelism": nodes, "completions": nodes}})


def test_trainer_v2_has_no_elastic_policy_which_is_why_the_agent_brings_its_own() -> None:
    """Trainer v2 dropped ElasticPolicy (kubeflow/trainer PR 3235). Should it come back, this
    fails, and the recipe should be reconsidered."""
    from tests.deploy.crd_schemas import validate_crd

    runtime, _ = kubeflow_v2()
    runtime["spec"]["mlPolicy"]["torch"]["elasticPolicy"] = {"minNodes": 1, "maxNodes": 4}
    with pytest.raises(AssertionError, match="elasticPolicy"):
        validate_crd(runtime)


def test_the_runtime_is_what_trainers_torch_plugin_looks_for() -> None:
    runtime, _ = kubeflow_v2()
    assert "namespace" not in runtime["metadata"], "ClusterTrainingRuntime is cluster-scoped"
    assert runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    assert "torch" in runtime["spec"]["mlPolicy"]
    assert trainer_job(runtime)["name"] == "node", "Trainer's PET_MASTER_ADDR and pod names assume it"
    container = node_container(runtime)
    assert container["name"] == "node", "Trainer injects PET_* and the TrainJob's image/args/env here"
    assert container["command"] == ["elastic", "agent"]
    assert not {e["name"] for e in container["env"]} & TORCHRUN_RESERVED


def test_a_failure_replaces_only_the_failed_pod() -> None:
    runtime, _ = kubeflow_v2()
    spec = trainer_job(runtime)["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert pod_spec(runtime)["restartPolicy"] == "Never", "backoffLimitPerIndex and podFailurePolicy need it"
    assert spec["backoffLimitPerIndex"] >= 1
    assert "backoffLimit" not in spec, "with backoffLimitPerIndex it defaults to 2^31-1: per index it is"
    assert "maxFailedIndexes" not in spec, "an index that gives up must not stop the others"
    assert spec["podReplacementPolicy"] == "Failed", "the only value a podFailurePolicy allows"
    rules = spec["podFailurePolicy"]["rules"]
    # First: preemption, eviction and node loss are not the job's failures.
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    # The agent's exit code for bad configuration (one line, exit 2) fails the Job at once.
    assert [r for r in rules if "onExitCodes" in r] == [
        {"action": "FailJob", "onExitCodes": {"containerName": "node", "operator": "In", "values": [2]}}]
    # If the child Job fails anyway, the JobSet does not recreate every pod.
    policy = runtime["spec"]["template"]["spec"]["failurePolicy"]
    assert policy.get("maxRestarts", 0) == 0
    assert policy["rules"]
    for rule in policy["rules"]:
        assert JOBSET_RULE_NAME.fullmatch(rule["name"]) and rule["action"] in JOBSET_ACTIONS
        assert rule["action"] == "FailJobSet" and not rule.get("onJobFailureReasons"), rule


def test_the_trainjob_is_elastic_within_our_own_range() -> None:
    from agent.node.nnodes import parse_nnodes

    runtime, trainjob = kubeflow_v2()
    assert trainjob["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": runtime["metadata"]["name"]}
    trainer = trainjob["spec"]["trainer"]
    assert "command" not in trainer, "it would replace `elastic agent`"
    assert not {e["name"] for e in trainer["env"]} & TORCHRUN_RESERVED, "Trainer's webhook refuses these"
    container = node_container(runtime)
    env = {e["name"]: e for e in container["env"]} | {e["name"]: e for e in trainer["env"]}  # Trainer upserts by name
    low, high = parse_nnodes(env["ELASTIC_NNODES"]["value"], "ELASTIC_NNODES")
    assert low < high, "MIN:MAX, or the job is not elastic"
    for nodes in (runtime["spec"]["mlPolicy"]["numNodes"], trainer["numNodes"]):
        assert low <= nodes <= high, f"numNodes {nodes} outside ELASTIC_NNODES {low}:{high}"
    assert trainer["numProcPerNode"] >= 1, "else Trainer derives PET_NPROC_PER_NODE from the CPU request"
    # One run, and one snapshot directory, per TrainJob.
    rdzv_id = env["ELASTIC_RDZV_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rdzv_id == f"metadata.labels['{JOBSET_NAME_LABEL}']"
    names = [e["name"] for e in container["env"]]
    snapshot_dir = env["ELASTIC_SNAPSHOT_DIR"]["value"]
    assert "$(ELASTIC_RDZV_ID)" in snapshot_dir
    assert names.index("ELASTIC_RDZV_ID") < names.index("ELASTIC_SNAPSHOT_DIR"), "$(VAR) sees only earlier ones"
    # ... on the ReadWriteMany volume every node mounts.
    (mount,) = [m for m in container["volumeMounts"] if snapshot_dir.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod_spec(runtime)["volumes"] if v["name"] == mount["name"]]
    claims = [d for p in (K8S / "base").glob("*.yaml") if p.name != "kustomization.yaml" for d in load_all(p)]
    claim = one(claims, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


# --- how the pieces fit ----------------------------------------------------------------


@pytest.mark.slow  # starts processes
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


@pytest.mark.slow  # starts processes
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


@pytest.mark.slow  # starts processes
def test_gpu_overlay_requests_gpus(rendered: dict[str, list[Doc]]) -> None:
    (agent,) = pod_spec(one(rendered["gpu"], "Job", "trainer"))["containers"]
    gpus = agent["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) >= 1 and agent["resources"]["requests"]["nvidia.com/gpu"] == gpus
    (cpu_agent,) = pod_spec(one(rendered["cpu"], "Job", "trainer"))["containers"]
    assert "nvidia.com/gpu" not in cpu_agent["resources"].get("limits", {})


@pytest.mark.slow  # starts processes
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
    for path in (LEGACY_PYTORCHJOB, RUNTIME):
        (kubeflow,) = load_all(path)
        assert any(matches(sel, pod_labels(kubeflow)) for sel in allowed[2379]), path.name


@pytest.mark.slow  # starts processes
def test_nothing_runs_privileged_and_secrets_stay_out_of_the_repo(rendered: dict[str, list[Doc]]) -> None:
    kubeflow = [d for p in sorted(KUBEFLOW.rglob("*.yaml")) for d in load_all(p)]
    for docs in [*rendered.values(), kubeflow]:
        assert not [d for d in docs if d["kind"] == "Secret"], "Secrets are made outside the repo"
        for doc in docs:
            if doc["kind"] not in {"Job", "StatefulSet", "PyTorchJob", "ClusterTrainingRuntime"}:
                continue
            spec = pod_spec(doc)
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert spec.get("automountServiceAccountToken") is False
            assert not spec.get("hostNetwork")
            for container in spec["containers"]:
                assert container["securityContext"]["allowPrivilegeEscalation"] is False
                assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


@pytest.mark.slow  # starts processes
def test_every_secret_the_manifests_mount_is_made_in_the_deploy_guide(rendered: dict[str, list[Doc]]) -> None:
    guide = (REPO / "docs" / "deploy.md").read_text()
    docs = rendered["gpu"] + load_all(LEGACY_PYTORCHJOB) + load_all(RUNTIME)
    used: dict[str, set[str]] = {}
    for doc in docs:
        if doc["kind"] not in {"Job", "StatefulSet", "PyTorchJob", "ClusterTrainingRuntime"}:
            continue
        spec = pod_spec(doc)
        volumes = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        for container in spec["containers"]:
            text = " ".join(container.get("args", []) + [str(e.get("value", "")) for e in container.get("env", [])])
            for mount in container["volumeMounts"]:
                if mount["name"] in volumes:
                    mounted = re.findall(re.escape(mount["mountPath"]) + r"/([\w.-]+)", text)
                    used.setdefault(volumes[mount["name"]], set()).update(mounted)
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


@pytest.mark.slow  # starts processes
def test_rbac_script_gives_trainer_its_prefix_and_nothing_else(tmp_path: Path) -> None:
    """The same etcd-rbac.sh the Job runs, against a real TLS etcd with client-cert auth:
    users log in by certificate CN, trainer may write only under /elastic/, monitor may
    only read, and a second run changes nothing."""
    from agent.etcd import EmbeddedEtcd, EtcdClient, ServerTLS, find_etcd_binary, settings_from_options
    from agent.etcd.client import EtcdError

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


@pytest.mark.slow  # starts processes (kubectl renders the overlays)
def test_s3_overlay_takes_snapshots_to_a_bucket_with_credentials_from_a_secret(
        rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["s3"]
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"], "no shared volume with S3"
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("trainer-config"))
    assert config["data"]["ELASTIC_SNAPSHOT_DIR"].startswith("s3://")
    trainer = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "trainer")
    spec = pod_spec(trainer)
    assert "snapshots" not in {v["name"] for v in spec["volumes"]}
    agent = spec["containers"][0]
    assert "snapshots" not in {m["name"] for m in agent["volumeMounts"]}
    creds = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in agent["env"] if e["name"].startswith("AWS_")}
    assert set(creds) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    guide = (REPO / "docs" / "deploy.md").read_text()
    made = re.search(r"kubectl -n elastic create secret generic trainer-s3\b([^\n]*)", guide)
    assert made and all(f"--from-literal={ref['key']}=" in made.group(1) for ref in creds.values())
