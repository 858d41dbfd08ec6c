"""Bad CRs, each refused with the field named: by the CRD schema and CEL (as the API server would,
with the same models behind run-local and the operator), or, where only the platform admin's
settings decide, by the operator itself with a Failed condition and nothing created.

Classes (issue 22): reserved env names (credentials, endpoints, proxies, code loading), malformed
images, images/service accounts/priority classes/token Secrets outside the admin's allowlists,
URIs that escape (`..`, `.`, `//`, local paths in the cluster), oversized values, conversions that
convert nothing or overwrite their source.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from crdcheck import open_api_schema, validate
from k8s_harness import Harness, harness_settings
from pydantic import ValidationError

from lora_operator.api import AdapterConversionSpec, LoraFinetuneSpec
from lora_operator.images import BadImage, ImageRule, image_allowed, parse_image
from lora_operator.policy import compilation_cache_problems, local_path_problem
from lora_operator.settings import OperatorSettings
from lora_trainer.config import CompilationCacheSpec

GOOD_LFT: dict[str, Any] = {
    "model": {"source": "gs://models-bucket/llama"},
    "dataset": {"train": "gs://data-bucket/train.jsonl"},
    "output": {"uri": "gs://runs-bucket/run"},
    "tpu": {"type": "v5p", "topology": "2x2x2"},
    "training": {"steps": 10},
}
GOOD_ADC: dict[str, Any] = {
    "source": {"uri": "gs://runs-bucket/run/hf-adapter", "format": "hf-peft"},
    "target": {"uri": "gs://runs-bucket/run/orbax", "format": "orbax"},
    "model": {"source": "gs://models-bucket/llama"},
}
DIGEST = "sha256:" + "a" * 64


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in patch.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _env(name: str, value: str = "x") -> dict[str, Any]:
    return {"env": [{"name": "OK_VAR", "value": "1"}, {"name": name, "value": value}]}


#: Env names a CR could use to send the hub token elsewhere, redirect Google credentials or
#: storage, trust another CA, load other code, or break the distributed start-up.
RESERVED_ENV = [
    "HF_ENDPOINT", "hf_endpoint", "HF_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_CACHE",
    "HTTP_PROXY", "https_proxy", "No_Proxy", "ALL_PROXY", "ftp_proxy", "GRPC_PROXY",
    "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "GCE_METADATA_HOST", "gce_metadata_ip", "NO_GCE_CHECK",
    "CLOUDSDK_CONFIG", "GCLOUD_PROJECT", "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "FSSPEC_GS_TOKEN",
    "GCSFS_DEFAULT_PROJECT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "PYTHONPATH", "PYTHONSTARTUP", "LD_PRELOAD", "LD_LIBRARY_PATH", "PATH", "HOME", "BASH_ENV",
    "JAX_COORDINATOR_ADDRESS", "JAX_PLATFORMS", "MEGASCALE_SLICE_ID", "LORA_JOB_INDEX", "LORA_STORAGE_RETRY_DEADLINE_S",
    "TPU_WORKER_ID", "LIBTPU_INIT_ARGS", "XLA_FLAGS", "JOB_COMPLETION_INDEX", "KUBERNETES_SERVICE_HOST",
]
MALFORMED_IMAGES = [
    "ghcr.io/Lora/trainer:1", "ghcr.io//trainer", "ghcr.io/trainer:", "ghcr.io/trainer:a b", "ghcr.io/trainer@sha256:abc",
    "-ghcr.io/trainer", "ghcr.io/trainer:" + "t" * 129, "ghcr.io/" + "x" * 520,
]
#: (patch, field) of LoraFinetunes the schema refuses.
BAD_LFT: list[tuple[dict[str, Any], str]] = [
    *((_env(name), "spec.env[1].name") for name in RESERVED_ENV),
    *(({"image": image}, "spec.image") for image in MALFORMED_IMAGES),
    # URIs that escape or are not what they name.
    ({"model": {"source": "gs://models-bucket/llama/../other-team/model"}}, "spec.model.source"),
    ({"model": {"source": "gs://models-bucket/./llama"}}, "spec.model.source"),
    ({"model": {"source": "gs://models-bucket//llama"}}, "spec.model.source"),
    ({"model": {"source": "hf://meta-llama/../secret"}}, "spec.model.source"),
    ({"model": {"source": "hf://meta-llama/Llama-3.1-8B/../../x"}}, "spec.model.source"),
    ({"model": {"source": "file://relative/path"}}, "spec.model.source"),
    ({"dataset": {"train": "gs://data-bucket/a//train.jsonl"}}, "spec.dataset.train"),
    ({"dataset": {"eval": "gs://data-bucket/../eval.jsonl"}}, "spec.dataset.eval"),
    ({"dataset": {"train": "gs://data-bucket/train.jsonl\n"}}, "spec.dataset.train"),
    ({"lora": {"restoreFrom": "gs://runs-bucket/old/.."}}, "spec.lora.restoreFrom"),
    ({"output": {"uri": "gs://runs-bucket/run/../../victim"}}, "spec.output.uri"),
    ({"output": {"uri": "gs://runs-bucket/run//x"}}, "spec.output.uri"),
    ({"output": {"uri": "hf://org/model"}}, "spec.output.uri"),
    ({"output": {"uri": "s3://bucket/run"}}, "spec.output.uri"),
    # Oversized values.
    ({"env": [{"name": f"V{i}", "value": "x"} for i in range(65)]}, "spec.env"),
    ({"env": [{"name": "BIG", "value": "x" * 4097}]}, "spec.env[0].value"),
    ({"lora": {"targetModules": "a" * 1025}}, "spec.lora.targetModules"),
    ({"dataset": {"textField": "t" * 257}}, "spec.dataset.textField"),
    ({"output": {"uri": "gs://runs-bucket/" + "a" * 1100}}, "spec.output.uri"),
    ({"training": {"steps": 10**12}}, "spec.training.steps"),
    ({"training": {"globalBatchSize": 10**6}}, "spec.training.globalBatchSize"),
    ({"training": {"seed": 2**40}}, "spec.training.seed"),
    ({"training": {"learningRate": 1e30}}, "spec.training.learningRate"),
    ({"serviceAccountName": "a" * 254}, "spec.serviceAccountName"),
    ({"resources": {"limits": {"memory": "1" * 65}}}, "spec.resources.limits.memory"),
    ({"hfTokenSecretRef": {"name": "hf-token", "key": "../token"}}, "spec.hfTokenSecretRef.key"),
]
#: (patch, field) of AdapterConversions the schema refuses.
BAD_ADC: list[tuple[dict[str, Any], str]] = [
    ({"target": {"format": "hf-peft"}}, "spec.target.format"),
    ({"source": {"format": "orbax"}, "target": {"format": "orbax"}}, "spec.target.format"),
    ({"target": {"format": "hf-peft"}, "merged": True}, "spec.target.format"),
    ({"target": {"uri": "gs://runs-bucket/run/hf-adapter"}}, "spec.target.uri"),
    ({"target": {"uri": "gs://runs-bucket/run/hf-adapter/"}}, "spec.target.uri"),
    ({"target": {"uri": "gs://runs-bucket/run/hf-adapter/orbax"}}, "spec.target.uri"),
    ({"target": {"uri": "gs://runs-bucket/run"}}, "spec.target.uri"),
    ({"source": {"uri": "gs://runs-bucket/run/../other/hf-adapter"}}, "spec.source.uri"),
    ({"target": {"uri": "gs://runs-bucket//orbax"}}, "spec.target.uri"),
    ({"image": "Ghcr.io/x/Y"}, "spec.image"),
]


def _cr(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "lora-operator.dev/v1alpha1", "kind": kind, "metadata": {"name": "bad"}, "spec": spec}


def _names(errors: list[str], field: str) -> bool:
    flat = field.replace("[", ".").replace("]", "")
    return any(e.replace("[", ".").replace("]", "").startswith(flat) for e in errors)


@pytest.mark.parametrize(("plural", "kind", "good", "patch", "field"), [
    *(("lorafinetunes", "LoraFinetune", GOOD_LFT, p, f) for p, f in BAD_LFT),
    *(("adapterconversions", "AdapterConversion", GOOD_ADC, p, f) for p, f in BAD_ADC),
], ids=[f"{f}-{i}" for i, (_, f) in enumerate([*BAD_LFT, *BAD_ADC])])
def test_the_schema_and_the_models_refuse_it_naming_the_field(plural, kind, good, patch, field):
    spec = _merge(good, patch)
    _, errors = validate(plural, _cr(kind, spec))
    assert errors and _names(errors, field), errors
    model = LoraFinetuneSpec if kind == "LoraFinetune" else AdapterConversionSpec
    with pytest.raises(ValidationError) as e:
        model.model_validate(spec)
    # pydantic names the field too (model-level rules of an AdapterConversion name it in the message).
    text = str(e.value).replace("\n  ", ".").replace("\n", " ")
    leaf = field.split(".")[-1].split("[")[0]
    assert leaf in text, text


def test_the_corpus_is_large_and_every_good_spec_passes():
    assert len(BAD_LFT) + len(BAD_ADC) + len(OPERATOR_REFUSED) >= 90
    assert validate("lorafinetunes", _cr("LoraFinetune", GOOD_LFT))[1] == []
    assert validate("adapterconversions", _cr("AdapterConversion", GOOD_ADC))[1] == []
    # Names that merely contain a reserved word, a merge of hf-peft from orbax, and dots inside names pass.
    fine = _merge(GOOD_LFT, {"env": [{"name": "MY_HF_ENDPOINT_NOTE", "value": "x"}, {"name": "ENVIRONMENT", "value": "x"}],
                             "model": {"source": "hf://Qwen/Qwen3-8B@v1.0/config.json"},
                             "dataset": {"train": "gs://data-bucket/.hidden/..data/train.jsonl"}})
    assert validate("lorafinetunes", _cr("LoraFinetune", fine))[1] == []
    LoraFinetuneSpec.model_validate(fine)
    merge = _merge(GOOD_ADC, {"source": {"format": "orbax"}, "target": {"format": "hf-peft", "uri": "gs://runs-bucket/run/merged"},
                              "merged": True})
    assert validate("adapterconversions", _cr("AdapterConversion", merge))[1] == []
    AdapterConversionSpec.model_validate(merge)


def _nodes(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if "items" in node:
        yield from _nodes(node["items"], f"{path}[]")


@pytest.mark.parametrize("plural", ["lorafinetunes", "adapterconversions"])
def test_every_string_list_and_count_of_the_crds_is_bounded(plural):
    """maxLength on every string (or an enum), maxItems on every list, a maximum on every number
    of the spec; strings and lists of the status too (the operator cuts what it writes to fit). The
    CRD is generated from the models, so run-local and the trainer apply the same bounds."""
    unbounded = []
    for path, node in _nodes(open_api_schema(plural)):
        if path in (".apiVersion", ".kind", ".metadata"):
            continue
        if node.get("type") == "string" and "maxLength" not in node and "enum" not in node:
            unbounded.append(path)
        if node.get("type") == "array" and "maxItems" not in node:
            unbounded.append(path)
        if path.startswith(".spec") and node.get("type") in ("integer", "number") and "maximum" not in node:
            unbounded.append(path)
    assert unbounded == []


# --- images, parsed ----------------------------------------------------------------------------


def test_images_are_matched_by_registry_and_repository_not_by_prefix():
    rules = [ImageRule.parse(e) for e in ("gcr.io/allowed", "ghcr.io/lora-operator/lora-trainer",
                                           "europe-docker.pkg.dev/acme/ml/", f"us-docker.pkg.dev/x/pinned@{DIGEST}")]
    allowed = ["gcr.io/allowed:1", "gcr.io/allowed@" + DIGEST, "GCR.IO/allowed:2", "ghcr.io/lora-operator/lora-trainer:0.1.0",
               "europe-docker.pkg.dev/acme/ml/trainer:3", "europe-docker.pkg.dev/acme/ml/a/b:3", f"us-docker.pkg.dev/x/pinned@{DIGEST}",
               f"us-docker.pkg.dev/x/pinned:v1@{DIGEST}"]
    refused = ["gcr.io/allowed.evil.com/x", "gcr.io/allowed/sub", "gcr.io/allowedx:1", "ghcr.io/lora-operator/lora-trainer-evil:1",
               "europe-docker.pkg.dev/acme/mlx/trainer", "europe-docker.pkg.dev/acme/ml:1", "us-docker.pkg.dev/x/pinned:v1",
               "us-docker.pkg.dev/x/pinned@sha256:" + "b" * 64, "evil.io/gcr.io/allowed", "allowed"]
    assert [i for i in allowed if image_allowed(i, rules) is not None] == []
    assert [i for i in refused if image_allowed(i, rules) is None] == []
    assert "no digest" in image_allowed("gcr.io/allowed:1", rules, require_digest=True)
    assert parse_image("ubuntu:22.04") == parse_image("docker.io/library/ubuntu:22.04") == parse_image("index.docker.io/ubuntu:22.04")
    assert parse_image("localhost:5000/a/b:c").registry == "localhost:5000"
    for entry in ("ghcr.io/x/y:1", "trainer", "gcr.io/x/@" + DIGEST, f"gcr.io/x/@{DIGEST}/"):
        with pytest.raises(BadImage):
            ImageRule.parse(entry)


def test_local_paths_in_the_cluster_only_under_the_admins_directories():
    closed, data = OperatorSettings(), OperatorSettings(allowed_local_paths=["/data"])
    assert local_path_problem("gs://b/x", closed) is None and local_path_problem("hf://o/n", closed) is None
    assert "allows no local paths" in local_path_problem("/data/x", closed)
    assert local_path_problem("/data/x", data) is None and local_path_problem("file:///data/x/", data) is None
    for uri in ("/database/x", "/etc/passwd", "data/x", "/data/../etc", "file:///data/../x", "./x"):
        assert local_path_problem(uri, data) is not None, uri


def test_a_compilation_cache_only_under_the_runs_output_or_one_the_admin_shares():
    """A compilation cache is code the trainer runs: a CR may not point it at storage others write."""
    spec = LoraFinetuneSpec.model_validate(_merge(GOOD_LFT, {"output": {"uri": "gs://runs/a"}}))

    def problems(uri: str | None, shared: list[str]) -> list[tuple[str, str]]:
        cache = {"uri": uri} if uri else {}
        s = spec.model_copy(update={"training": spec.training.model_copy(update={"compilation_cache": CompilationCacheSpec(**cache)})})
        return compilation_cache_problems(s, OperatorSettings(shared_compilation_caches=shared))

    assert problems(None, []) == [] and problems("gs://runs/a/cache", []) == [] and problems("gs://runs/a", []) == []
    assert problems("gs://team/jax-cache/llama", ["gs://team/jax-cache"]) == []
    for uri, shared in (("gs://runs/ab/cache", []), ("gs://team/jax-cache", []), ("gs://team/jax-cachex", ["gs://team/jax-cache"])):
        [(field, message)] = problems(uri, shared)
        assert field == "spec.training.compilationCache.uri" and "sharedCompilationCaches" in message, uri


# --- refused by the operator: the admin's settings decide ---------------------------------------

PLATFORM = harness_settings(
    allowed_images=["gcr.io/allowed", "ghcr.io/lora-operator/lora-trainer", f"us-docker.pkg.dev/x/pinned@{DIGEST}"],
    allowed_local_paths=["/data"], allowed_priority_classes=["batch-high"],
)
#: (kind, patch, field) a schema cannot refuse: the operator's settings do, with a Failed condition.
OPERATOR_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("LoraFinetune", {"image": "gcr.io/allowed.evil.com/x:1"}, "spec.image"),
    ("LoraFinetune", {"image": "ghcr.io/lora-operator/lora-trainer-evil:1"}, "spec.image"),
    ("LoraFinetune", {"image": "docker.io/evil/miner:1"}, "spec.image"),
    ("LoraFinetune", {"image": "us-docker.pkg.dev/x/pinned:latest"}, "spec.image"),
    ("LoraFinetune", {"image": "us-docker.pkg.dev/x/pinned@sha256:" + "b" * 64}, "spec.image"),
    ("LoraFinetune", {"serviceAccountName": "cluster-admin-wi"}, "spec.serviceAccountName"),
    ("LoraFinetune", {"priorityClassName": "system-cluster-critical"}, "spec.priorityClassName"),
    ("LoraFinetune", {"hfTokenSecretRef": {"name": "db-password", "key": "password"}}, "spec.hfTokenSecretRef.name"),
    ("LoraFinetune", {"model": {"source": "tiny-llama"}}, "spec.model.source"),
    ("LoraFinetune", {"dataset": {"train": "/etc/shadow"}}, "spec.dataset.train"),
    ("LoraFinetune", {"dataset": {"eval": "/data/../etc/eval.jsonl"}}, "spec.dataset.eval"),
    ("LoraFinetune", {"lora": {"restoreFrom": "file:///var/run/secrets/adapter"}}, "spec.lora.restoreFrom"),
    ("LoraFinetune", {"output": {"uri": "/database/run"}}, "spec.output.uri"),
    ("LoraFinetune", {"output": {"uri": "output/run"}}, "spec.output.uri"),
    ("LoraFinetune", {"training": {"compilationCache": {"uri": "gs://someone-elses/cache"}}}, "spec.training.compilationCache.uri"),
    ("LoraFinetune", {"training": {"compilationCache": {"uri": "/tmp/cache"}}}, "spec.training.compilationCache.uri"),
    ("AdapterConversion", {"image": "gcr.io/allowedx:1"}, "spec.image"),
    ("AdapterConversion", {"serviceAccountName": "default-editor"}, "spec.serviceAccountName"),
    ("AdapterConversion", {"source": {"uri": "/tmp/adapter"}}, "spec.source.uri"),
    ("AdapterConversion", {"target": {"uri": "../escape"}}, "spec.target.uri"),
    ("AdapterConversion", {"model": {"source": "/root/model"}}, "spec.model.source"),
]


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_the_operator_refuses_what_the_admin_does_not_allow_and_creates_nothing():
    """Each CR passes the schema but ends Failed (InvalidSpec) with the field named, no child
    created; a CR within the same settings (an allowed image, a path under /data) runs."""
    async with Harness() as h:
        await h.start_operator(PLATFORM)
        names = []
        for i, (kind, patch, field) in enumerate(OPERATOR_REFUSED):
            name = f"bad-{i}"
            body = _cr(kind, _merge(GOOD_LFT if kind == "LoraFinetune" else GOOD_ADC, patch))
            body["metadata"]["name"] = name
            await h.create(body)
            names.append((kind, name, field))
        good = _cr("LoraFinetune", _merge(GOOD_LFT, {"image": "gcr.io/allowed@" + DIGEST, "output": {"uri": "/data/run"},
                                                     "priorityClassName": "batch-high", "serviceAccountName": "lora-trainer"}))
        good["metadata"]["name"] = "good"
        await h.create(good)
        for kind, name, field in names:
            cr = await h.wait_for_status(kind, name, lambda s: s.get("phase") == "Failed")
            failed = next(c for c in cr["status"]["conditions"] if c["type"] == "Failed")
            assert failed["reason"] == "InvalidSpec" and failed["message"].startswith(f"{field}: "), (name, failed)
        await h.wait_for(lambda: h.get("JobSet", "good"), what="the good run's JobSet")
        assert [o["metadata"]["name"] for o in await h.list("JobSet")] == ["good"]
        assert [o["metadata"]["name"] for o in await h.list("ConfigMap")] == ["good-config"]
        assert await h.list("Job") == []
