"""The Helm chart, rendered by real Helm (helm-python-sdk embeds Helm v4) and checked against
the Kubernetes schemas, the operator's settings model and the security baseline."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

import k8s_schemas
from lora_operator.settings import OperatorSettings, load_settings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "lora-operator"
RELEASE, NAMESPACE = "lora-operator", "lora-system"

#: Values a platform team would plausibly set: namespaced mode, Kueue, Workload Identity, a mirror.
CUSTOM_VALUES: dict[str, Any] = {
    "image": {"repository": "us-docker.pkg.dev/acme/ml/lora-operator", "tag": "0.1.0-acme1", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "watchNamespaces": ["team-a", "team-b"],
    "trainer": {
        "image": "us-docker.pkg.dev/acme/ml/lora-trainer:0.1.0",
        "allowedImages": ["us-docker.pkg.dev/acme/ml/lora-trainer", "ghcr.io/lora-operator/lora-trainer"],
    },
    "defaultTpuType": "v6e",
    "defaultQueueName": "tpu-v6e",
    "allowHostNetwork": False,
    "logLevel": "DEBUG",
    "progressPollSeconds": 10,
    "jobTtlSecondsAfterFinished": 3600,
    "serviceAccount": {"gcpServiceAccount": "lora-operator@acme-ml.iam.gserviceaccount.com", "annotations": {"team": "ml-platform"}},
    "healthPort": 9090,
    "resources": {"requests": {"cpu": "200m", "memory": "300Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}},
    "priorityClassName": "platform-critical",
    "nodeSelector": {"cloud.google.com/gke-nodepool": "system"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
    "replicaCount": 2,
    "leaderElection": {"leaseDurationSeconds": 20, "renewDeadlineSeconds": 12, "retryPeriodSeconds": 3},
    "metrics": {"port": 9464},
    "topologyAwareScheduling": {"mode": "required", "level": "cloud.google.com/gce-topology-block"},
    "podTemplateOverlay": {
        "nodeSelector": {"cloud.google.com/gke-nodepool": "tpu-v6e"},
        "volumes": [{"name": "gcs-cache", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": {"bucketName": "acme"}}}],
        "volumeMounts": [{"name": "gcs-cache", "mountPath": "/gcs", "readOnly": True}],
        "annotations": {"gke-gcsfuse/volumes": "true"},
        "labels": {"team": "ml"},
    },
}

VALUE_SETS = {"default": {}, "custom": CUSTOM_VALUES}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object `helm template` would print for these values (NOTES.txt excluded)."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return [doc for path, text in sorted(out.items()) if path.endswith(".yaml") for doc in k8s_schemas.load_all(text)]


def notes(values: dict[str, Any]) -> str:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


def only(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(VALUE_SETS[request.param])


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_helm_lint_is_clean(values: str) -> None:
    report = helm.lint(CHART, VALUE_SETS[values], strict=True, namespace=NAMESPACE, kube_version="v1.33.0")
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); warnings and errors fail.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_every_rendered_object_matches_the_kubernetes_schema(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objs = rendered
    assert {o["kind"] for o in objs} >= {"Deployment", "ServiceAccount", "ConfigMap", "ClusterRole", "ClusterRoleBinding"}
    for obj in objs:
        for version in k8s_schemas.KUBE_VERSIONS:
            k8s_schemas.validate(obj, version)


def test_the_schema_check_catches_misspelt_and_misplaced_fields() -> None:
    deployment = only(render({}), "Deployment")
    misspelt = copy.deepcopy(deployment)
    misspelt["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = misspelt["spec"]["template"]["spec"]["containers"][0].pop("livenessProbe")
    misplaced = copy.deepcopy(deployment)
    misplaced["spec"]["template"]["spec"]["readOnlyRootFilesystem"] = True
    for bad, field in ((misspelt, "livenessprobe"), (misplaced, "readOnlyRootFilesystem")):
        with pytest.raises(k8s_schemas.ManifestInvalid, match=field):
            k8s_schemas.validate(bad)


def test_chart_crds_are_the_generated_crds() -> None:
    committed = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert committed, "crds/ is empty: run `lora-operator crds --out crds --out charts/lora-operator/crds`"
    with helm.Chart.load(CHART) as chart:
        chart_crds = {c["filename"].rsplit("/", 1)[-1]: c["data"] for c in chart.crds}
    assert sorted(chart_crds) == committed
    for name in committed:
        assert chart_crds[name] == (ROOT / "crds" / name).read_text(), (
            f"charts/lora-operator/crds/{name} differs from crds/{name}: "
            "run `lora-operator crds --out crds --out charts/lora-operator/crds`"
        )
        k8s_schemas.validate(yaml.safe_load(chart_crds[name]))


def test_deployment_runs_one_hardened_operator(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, objs = rendered
    values = VALUE_SETS[name]
    deployment = only(objs, "Deployment")
    spec = deployment["spec"]
    replicas = values.get("replicaCount", 1)
    assert spec["replicas"] == replicas
    if replicas == 1:  # alone: never two pods reconciling at once
        assert spec["strategy"] == {"type": "Recreate"}
        assert "affinity" not in spec["template"]["spec"] and not [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    else:  # a leader and standbys: replaced one at a time, spread over nodes, never all drained
        assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
        anti = spec["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
        assert only(objs, "PodDisruptionBudget")["spec"] == {"minAvailable": 1, "selector": spec["selector"]}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["serviceAccountName"] == only(objs, "ServiceAccount")["metadata"]["name"]
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"] and container["resources"]["limits"]

    port = values.get("healthPort", 8080)
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": port, "protocol": "TCP"} in container["ports"]
    assert f"--liveness=http://0.0.0.0:{port}/healthz" in container["args"]
    metrics_port = values.get("metrics", {}).get("port", 8081)
    assert f"--metrics-port={metrics_port}" in container["args"]
    assert {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"} in container["ports"]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    service = only(objs, "Service")
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [{"name": "metrics", "port": metrics_port, "targetPort": "metrics", "protocol": "TCP"}]
    assert [a for a in container["args"] if a.startswith("--namespace=")] == [
        f"--namespace={ns}" for ns in values.get("watchNamespaces", [])
    ]
    image = values.get("image", {})
    assert container["image"] == f"{image.get('repository', 'ghcr.io/lora-operator/lora-operator')}:{image.get('tag', '0.1.0')}"

    # The settings file is mounted where --settings points.
    settings_arg = next(a for a in container["args"] if a.startswith("--settings="))
    mount = next(m for m in container["volumeMounts"] if m["name"] == "settings")
    assert settings_arg == f"--settings={mount['mountPath']}/settings.yaml"
    volume = next(v for v in pod["volumes"] if v["name"] == "settings")
    assert volume["configMap"]["name"] == only(objs, "ConfigMap")["metadata"]["name"]


def test_settings_configmap_is_what_the_operator_parses(rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    name, objs = rendered
    values = VALUE_SETS[name]
    path = tmp_path / "settings.yaml"
    path.write_text(only(objs, "ConfigMap")["data"]["settings.yaml"])
    settings = load_settings(path)
    if not values:
        assert settings == OperatorSettings(), "chart defaults must equal the operator's own defaults"
        return
    assert settings.trainer_image == values["trainer"]["image"]
    assert settings.allowed_images == values["trainer"]["allowedImages"]
    assert settings.default_tpu_type == values["defaultTpuType"]
    assert settings.default_queue_name == values["defaultQueueName"]
    assert settings.allow_host_network is values["allowHostNetwork"]
    assert settings.watch_namespaces == values["watchNamespaces"]
    assert settings.log_level == values["logLevel"]
    assert settings.progress_poll_seconds == values["progressPollSeconds"]
    assert settings.job_ttl_seconds_after_finished == values["jobTtlSecondsAfterFinished"]
    assert settings.topology_aware_scheduling.to_wire() == values["topologyAwareScheduling"]
    assert settings.leader_election.to_wire() == {"enabled": True, "leaseName": RELEASE, "leaseNamespace": NAMESPACE,
                                                  **values["leaderElection"]}
    assert settings.pod_template_overlay.to_wire() == {"tolerations": [], **values["podTemplateOverlay"]}


def test_service_account_carries_the_workload_identity_annotation() -> None:
    assert "annotations" not in only(render({}), "ServiceAccount")["metadata"]
    annotations = only(render(CUSTOM_VALUES), "ServiceAccount")["metadata"]["annotations"]
    assert annotations == {"iam.gke.io/gcp-service-account": "lora-operator@acme-ml.iam.gserviceaccount.com", "team": "ml-platform"}


def _rules(objs: list[dict[str, Any]], kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
    return [r for o in objs if o["kind"] == kind and o["metadata"].get("namespace") == namespace for r in o["rules"]]


def test_rbac_is_cluster_wide_only_when_watching_every_namespace() -> None:
    cluster_wide = render({})
    assert not [o for o in cluster_wide if o["kind"] in ("Role", "RoleBinding")]
    assert any("jobsets" in r["resources"] for r in _rules(cluster_wide, "ClusterRole"))

    namespaced = render(CUSTOM_VALUES)
    cluster_rules = _rules(namespaced, "ClusterRole")
    # Only the CRD discovery kopf needs stays cluster-wide, and it is read-only.
    assert {res for r in cluster_rules for res in r["resources"]} == {"customresourcedefinitions"}
    assert {v for r in cluster_rules for v in r["verbs"]} == {"list", "watch"}
    for ns in CUSTOM_VALUES["watchNamespaces"]:
        assert any("jobsets" in r["resources"] for r in _rules(namespaced, "Role", ns))
        binding = next(o for o in namespaced if o["kind"] == "RoleBinding" and o["metadata"]["namespace"] == ns)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": RELEASE}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]
    assert _rules(namespaced, "Role", "team-a") == _rules(cluster_wide, "ClusterRole")[len(cluster_rules):]


def test_rbac_has_no_wildcards(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objs = rendered
    for obj in objs:
        for rule in obj.get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], (obj["kind"], rule)
            assert "nonResourceURLs" not in rule and "resourceNames" not in rule


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"watchNamespace": ["team-a"]}, "watchNamespace"),
        ({"defaultTpuType": "v5"}, "defaultTpuType"),
        ({"watchNamespaces": ["Team_A"]}, "watchNamespaces"),
        ({"logLevel": "verbose"}, "logLevel"),
        ({"trainer": {"image": "x", "allowedImages": []}}, "allowedImages"),
        ({"serviceAccount": {"gcpServiceAccount": "not-an-email"}}, "gcpServiceAccount"),
        ({"resources": {"request": {"cpu": "1"}}}, "request"),
        ({"topologyAwareScheduling": {"mode": "required"}}, "topologyAwareScheduling"),
        ({"podTemplateOverlay": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}, "podTemplateOverlay"),
        ({"podTemplateOverlay": {"securityContext": {"privileged": True}}}, "securityContext"),
        ({"replicaCount": 0}, "replicaCount"),
        ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "interval"),
    ],
)
def test_values_schema_rejects_bad_values(values: dict[str, Any], needle: str) -> None:
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError, match=needle):
            chart.validate_schema(values)
        chart.validate_schema(CUSTOM_VALUES)


def test_notes_tell_the_user_what_to_do_next() -> None:
    default = notes({})
    assert "all namespaces" in default and "kubectl get lft -w" in default
    assert "serviceAccount.gcpServiceAccount" in default  # operator cannot read progress.json without it
    custom = notes(CUSTOM_VALUES)
    assert "team-a, team-b" in custom and 'LocalQueue "tpu-v6e"' in custom
    assert "serviceAccount.gcpServiceAccount" not in custom
    assert "Service lora-operator-metrics on port 8081" in default and "get lease" not in default
    assert "get lease lora-operator" in custom  # two replicas: where to see who leads


def test_chart_version_tracks_the_project_version() -> None:
    """One release number: the chart, its default operator image tag and the default trainer image."""
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    with helm.Chart.load(CHART) as chart:
        meta, values = chart.metadata, chart.values
    assert meta["version"] == meta["appVersion"] == version
    assert values["trainer"]["image"].endswith(f":{version}")
    assert only(render({}), "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"].endswith(f":{version}")


def test_existing_service_account_and_no_rbac() -> None:
    """A platform that manages identities and RBAC itself: the chart creates neither."""
    objs = render({"serviceAccount": {"create": False, "name": "platform-operator"}, "rbac": {"create": False}, "replicaCount": 2})
    assert {o["kind"] for o in objs} == {"Deployment", "ConfigMap", "Service", "PodDisruptionBudget"}
    assert only(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "platform-operator"
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmRenderError, match="serviceAccount.name is required"):
        chart.render({"serviceAccount": {"create": False}}, name=RELEASE, namespace=NAMESPACE)


def test_a_service_monitor_scrapes_the_metrics_service_when_asked() -> None:
    assert not [o for o in render({}) if o["kind"] == "ServiceMonitor"]
    objs = render({"metrics": {"serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kube-prometheus"}}}})
    monitor, service = only(objs, "ServiceMonitor"), only(objs, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert service["spec"]["ports"][0]["name"] == "metrics"


def test_leader_election_rights_are_the_lease_in_the_release_namespace_only() -> None:
    assert not [o for o in render({}) if o["metadata"]["name"].endswith("leader-election")]
    objs = render({"replicaCount": 2})
    role = next(o for o in objs if o["kind"] == "Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "patch"]}]
    binding = next(o for o in objs if o["kind"] == "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"] and binding["metadata"]["namespace"] == NAMESPACE
