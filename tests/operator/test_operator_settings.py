"""Operator settings: the contract with the Helm chart (camelCase names, defaults, clear errors)."""

import pytest
import yaml

from lora_operator.settings import SettingsError, load_settings


def test_defaults_match_the_documented_contract():
    s = load_settings(None)
    wire = s.to_wire()
    assert wire["trainerImage"] == "ghcr.io/lora-operator/lora-trainer:0.1.0"
    assert wire["allowedImages"] == ["ghcr.io/lora-operator/lora-trainer"]
    assert wire["defaultTpuType"] == "v5p"
    assert "defaultQueueName" not in wire
    assert wire["allowHostNetwork"] is True
    assert wire["watchNamespaces"] == []
    assert wire["logLevel"] == "INFO"
    assert wire["progressPollSeconds"] == 20
    assert wire["jobTtlSecondsAfterFinished"] == 86400
    assert set(wire["exportResources"]) == {"requests", "limits"}


def test_yaml_file_with_camel_case_fields(tmp_path):
    p = tmp_path / "settings.yaml"
    p.write_text(
        "trainerImage: europe-docker.pkg.dev/acme/ml/lora-trainer:1.2\n"
        "allowedImages: [europe-docker.pkg.dev/acme/ml/]\n"
        "defaultQueueName: tpu-queue\nallowHostNetwork: false\nwatchNamespaces: [ml, research]\n"
        "progressPollSeconds: 5\nexportResources: {requests: {cpu: '1', memory: 4Gi}}\n"
    )
    s = load_settings(p)
    assert s.default_queue_name == "tpu-queue"
    assert s.allow_host_network is False
    assert s.watch_namespaces == ["ml", "research"]
    assert s.progress_poll_seconds == 5
    assert s.image_allowed("europe-docker.pkg.dev/acme/ml/lora-trainer:9")
    assert not s.image_allowed("docker.io/evil/miner:latest")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("trainerImage: docker.io/x/y:1\n", "allowedImages"),
        ("progressPollSeconds: 0\n", "progressPollSeconds"),
        ("trainerImag: x\n", "trainerImag"),
        ("watchNamespaces: [Bad_NS]\n", "watchNamespaces"),
        ("- a\n- b\n", "mapping"),
        # Allowlist entries are parsed: a tag pins nothing, a bare name has no registry.
        ("allowedImages: [ghcr.io/lora-operator/lora-trainer:0.1.0]\n", "allowedImages.*names a tag"),
        ("allowedImages: [trainer]\n", "allowedImages.*names no registry"),
        ("requireImageDigest: true\n", "trainerImage.*no digest"),
        ("allowedLocalPaths: [data]\n", "allowedLocalPaths"),
        ("allowedServiceAccounts: [Not_A_Name]\n", "allowedServiceAccounts"),
    ],
)
def test_bad_settings_name_the_file_and_field(tmp_path, text, needle):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    with pytest.raises(SettingsError, match=needle) as e:
        load_settings(p)
    assert str(p) in str(e.value)


def test_missing_file_says_so(tmp_path):
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(tmp_path / "nope.yaml")



@pytest.mark.parametrize(
    ("overlay", "needles"),
    [
        ({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}, ["podTemplateOverlay.volumes[0].hostPath", "node's filesystem"]),
        ({"securityContext": {"privileged": True}},
         ["podTemplateOverlay.securityContext is not allowed", "podTemplateOverlay.securityContext.privileged"]),
        ({"hostPID": True, "hostIPC": True}, ["podTemplateOverlay.hostPID", "podTemplateOverlay.hostIPC"]),
        ({"capabilities": {"add": ["SYS_ADMIN"]}}, ["podTemplateOverlay.capabilities"]),
        ({"runAsUser": 0}, ["podTemplateOverlay.runAsUser", "never be root"]),
        ({"volumeMounts": [{"name": "v", "mountPath": "/x", "mountPropagation": "Bidirectional"}],
          "volumes": [{"name": "v", "emptyDir": {}}]}, ["volumeMounts.0.mountPropagation"]),
        ({"annotations": {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}}, ["confinement"]),
        ({"labels": {"jobset.sigs.k8s.io/jobset-name": "other"}}, ["labels.jobset.sigs.k8s.io/jobset-name is reserved"]),
        ({"nodeSelector": {"cloud.google.com/gke-spot": "true"}}, ["nodeSelector.cloud.google.com/gke-spot is set by the operator"]),
        ({"nodeSelector": {"cloud.google.com/gke-tpu-topology": "8x8"}}, ["gke-tpu-topology is set by the operator"]),
        ({"volumes": [{"name": "dshm", "emptyDir": {}}]}, ["the trainer pod's own volume"]),
        ({"volumes": [{"name": "two", "emptyDir": {}, "csi": {"driver": "x"}}]}, ["exactly one source"]),
        ({"volumeMounts": [{"name": "ghost", "mountPath": "/g"}]}, ["volumes ['ghost']"]),
        ({"containers": [{"name": "sidecar"}]}, ["podTemplateOverlay.containers"]),
    ],
)
def test_the_pod_overlay_refuses_what_would_weaken_the_pod(tmp_path, overlay, needles):
    """Every refused field is named with its path, and the settings do not load."""
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"podTemplateOverlay": overlay}))
    with pytest.raises(SettingsError) as e:
        load_settings(p)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_topology_aware_scheduling_settings(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("topologyAwareScheduling: {level: cloud.google.com/gce-topology-block}\n")
    assert load_settings(p).topology_aware_scheduling.mode == "preferred"
    p.write_text("topologyAwareScheduling: {mode: strict, level: 'not a label'}\n")
    with pytest.raises(SettingsError, match="topologyAwareScheduling.mode.*topologyAwareScheduling.level"):
        load_settings(p)
