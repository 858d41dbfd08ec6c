"""kopf handlers: read the event, call the pure functions, write children/status. Thin on purpose.

Registered into a fresh `kopf.OperatorRegistry` by `build_registry(settings)` because the
progress timer's interval comes from the operator settings. Handlers are sync (kopf runs them
in its thread pool) and return None, so nothing lands in `status.<handler>`; kopf's own state
lives in annotations (see `configure`). Secrets are only checked for existence: their data is
never logged, posted or copied.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from lora_operator import status as st
from lora_operator.api import API_VERSION, GROUP, VERSION, AdapterConversionSpec, LoraFinetuneSpec
from lora_operator.kube import CannotCreate, Kube
from lora_operator.progress import progress_status, read_progress
from lora_operator.render import (
    ADC_LABEL,
    COMPONENT_LABEL,
    JOBSET_API,
    LFT_LABEL,
    ChildNames,
    InvalidSpec,
    Owner,
    conversion_job_name,
    output_uris,
    parse_spec,
    render_conversion_job,
    render_export_jobs,
    render_lora_finetune,
    resolve_tpu,
    tpu_summary,
)
from lora_operator.settings import OperatorSettings
from lora_operator.tpu import SliceShape

log = logging.getLogger(__name__)

LFT = "lorafinetunes"
ADC = "adapterconversions"
SECRET_RETRY_SECONDS = 30
#: Retry delay after an unexpected error (an API hiccup): kopf's default of 60 s is long for a user waiting.
RETRY_SECONDS = 5


def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """kopf bookkeeping in annotations (the status schema is pruned), one replica, quiet events."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 16
    # A sync timer cannot be cancelled mid-read (gs:// progress): kopf re-checks whether it has exited
    # this often, and a CR being deleted waits for that (its default, 60 s, held deletions for a minute).
    settings.background.cancellation_polling = 1


def _event(type: str, body: dict[str, Any], *, reason: str, message: str) -> None:
    """A Kubernetes Event on the CR (always posted; kopf's own log-derived events stay at WARNING+)."""
    kopf.event(body, type=type, reason=reason, message=message)


def _creation_event(body: dict[str, Any], status: dict[str, Any], created: str, recreated_reason: str, recreated: str) -> None:
    """After a reconcile created a resource's child: `Created`, or, if the resource had already
    started (the child went missing while the operator was away), the Warning `recreated_reason`."""
    if status.get("startTime"):
        _event("Warning", body, reason=recreated_reason, message=recreated)
    else:
        _event("Normal", body, reason="Created", message=created)


# --- LoraFinetune ------------------------------------------------------------------------------


def _fail(body: dict[str, Any], patch: kopf.Patch, status: dict[str, Any], reason: str, message: str, generation: int | None) -> None:
    obs = st.Observation("Failed", reason, message)
    patch.status.update(st.status_patch(dict(status), obs, generation, st.now_rfc3339()))
    _event("Warning", body, reason=reason, message=message)


def _check_secret(kube: Kube, namespace: str, spec: LoraFinetuneSpec) -> None:
    """Existence only (the data is never read out): a missing Secret or key is a TemporaryError
    naming the field and the fix, retried until someone creates it."""
    ref = spec.hf_token_secret_ref
    if ref is None:
        return
    secret = kube.get("v1", "Secret", namespace, ref.name)
    if secret is None or ref.key not in (secret.get("data") or {}) | (secret.get("stringData") or {}):
        what = f"Secret {ref.name!r}" if secret is None else f"key {ref.key!r} in Secret {ref.name!r}"
        raise kopf.TemporaryError(
            f"spec.hfTokenSecretRef: {what} not found in namespace {namespace}; create it "
            f"(kubectl -n {namespace} create secret generic {ref.name} --from-literal={ref.key}=<HF token>) "
            f"or fix hfTokenSecretRef; retrying every {SECRET_RETRY_SECONDS}s",
            delay=SECRET_RETRY_SECONDS,
        )


def _initial_status(spec: LoraFinetuneSpec, shape: SliceShape, names: ChildNames, status: dict[str, Any],
                    generation: int | None) -> dict[str, Any]:
    """Pending (or Suspended) with the JobSet name, TPU shape and step counter, before any JobSet news."""
    obs = (st.Observation("Suspended", "Suspended", "created suspended; set spec.suspend to false to start")
           if spec.suspend else st.Observation("Pending", "JobSetCreated", f"created JobSet {names.jobset}; waiting for TPU pods"))
    now = st.now_rfc3339()
    conditions = list(status.get("conditions") or [])
    if spec.hf_token_secret_ref is not None:
        conditions = st.set_condition(conditions, "SecretsResolved", "True", "SecretFound", "hfTokenSecretRef resolved", generation, now)
    return st.status_patch({"conditions": conditions}, obs, generation, now, progress=f"0/{spec.training.steps}",
                           jobSetName=names.jobset, tpu=tpu_summary(shape, spec.tpu.slices), totalSteps=spec.training.steps)


def lft_reconcile(
    body: kopf.Body, meta: kopf.Meta, status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo, **_: Any
) -> None:
    """create/resume: render and create (or adopt) the ConfigMap and the JobSet. Not once training
    has finished (Exporting): its JobSet may be gone by its TTL, and a new one would train again."""
    if status.get("phase") in (*st.TERMINAL, "Exporting"):
        return
    settings: OperatorSettings = memo.settings
    kube: Kube = memo.kube
    generation = meta.get("generation")
    try:
        manifests = render_lora_finetune(dict(body), settings)
        spec = parse_spec(LoraFinetuneSpec, dict(body))
        shape = resolve_tpu(spec, settings)
    except InvalidSpec as e:
        if status.get("jobSetName") and kube.get(JOBSET_API, "JobSet", meta["namespace"], status["jobSetName"]) is not None:
            # The spec cannot change, so the operator's settings did (a narrower image allowlist or TPU
            # catalog after a restart): the run was admitted and its JobSet trains on; failing it would
            # leave the TPUs busy under a Failed run whose completion nobody exports.
            _event("Warning", dict(body), reason="SettingsChanged",
                   message=f"the operator's settings now refuse this spec ({e}); this run was admitted before and "
                           "keeps running, new runs like it are refused")
            return
        _fail(dict(body), patch, dict(status), "InvalidSpec", f"{e}", generation)
        return
    try:
        _check_secret(kube, meta["namespace"], spec)
    except kopf.TemporaryError as e:
        conditions = st.set_condition(list(status.get("conditions") or []), "SecretsResolved", "False", "SecretNotFound",
                                      str(e), generation, st.now_rfc3339())
        patch.status.update({"phase": status.get("phase") or "Pending", "conditions": conditions})
        _event("Warning", dict(body), reason="SecretNotFound", message=str(e))
        raise
    names = ChildNames.of(meta["name"])
    fresh = not status.get("jobSetName")
    if fresh:  # written before the children exist, so every JobSet-driven status write lands after it
        kube.merge_patch(API_VERSION, "LoraFinetune", meta["namespace"], meta["name"],
                         {"status": _initial_status(spec, shape, names, dict(status), generation)}, status=True)
    try:  # any other error may pass (an outage, RBAC being fixed): kopf retries
        created = [m["kind"] for m in manifests if kube.create_or_adopt(m)]
    except CannotCreate as e:
        _fail(dict(body), patch, dict(status), e.reason, str(e), generation)
        return
    if "JobSet" in created:
        _creation_event(dict(body), dict(status), f"created ConfigMap {names.config_map} and JobSet {names.jobset}",
                        "JobSetRecreated", f"JobSet {names.jobset} was missing when the operator resumed this run; created "
                        "it again, training resumes from the last checkpoint (to stop a run, delete or suspend the LoraFinetune)")


def lft_suspend(body: kopf.Body, meta: kopf.Meta, status: kopf.Status, new: Any, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    """spec.suspend changed: suspend or resume the JobSet (pods go; the run resumes from its checkpoint)."""
    if status.get("phase") in st.TERMINAL or not status.get("jobSetName"):
        return
    if status.get("phase") == "Exporting":  # training is over: nothing left to suspend
        _event("Normal", dict(body), reason="SuspendIgnored",
               message="training has finished and the adapter is being exported; spec.suspend has no effect now")
        return
    suspend = bool(new)
    try:
        jobset = memo.kube.merge_patch(JOBSET_API, "JobSet", meta["namespace"], status["jobSetName"], {"spec": {"suspend": suspend}})
    except ApiException as e:
        if e.status == 404:
            raise kopf.TemporaryError(f"JobSet {status['jobSetName']} not found yet", delay=5) from e
        raise
    # The phase comes from the patched JobSet, as in jobset_event, so that whichever of the two
    # writes last, they agree.
    obs = st.observe_jobset(jobset, requested_suspend=suspend)
    if not suspend and obs.phase == "Pending" and obs.reason != "WaitingForAdmission":
        obs = st.Observation("Pending", "Resumed", "resumed; waiting for TPU pods (training continues from the last checkpoint)", obs.restarts)
    patch.status.update(st.status_patch(dict(status), obs, meta.get("generation"), st.now_rfc3339()))
    _event("Normal", dict(body), reason="Suspended" if suspend else "Resumed",
           message="suspended by spec.suspend; pods are deleted and the run resumes from its last checkpoint when unsuspended"
           if suspend else "resumed by spec.suspend=false; training continues from the last checkpoint")


def _progress_fields(spec: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """The status fields that `<output.uri>/progress.json` changes (none while there is no record)."""
    record = read_progress(spec["output"]["uri"])
    if record is None:
        return {}
    fields = progress_status(record, int((spec.get("training") or {}).get("steps") or status.get("totalSteps") or 0))
    return {k: v for k, v in fields.items() if status.get(k) != v}


def lft_progress(spec: kopf.Spec, status: kopf.Status, patch: kopf.Patch, **_: Any) -> None:
    """Timer while Running: copy `<output.uri>/progress.json` into status (no API rights for pods)."""
    if changed := _progress_fields(dict(spec), dict(status)):
        patch.status.update(changed)


def lft_resync(body: kopf.Body, status: kopf.Status, memo: kopf.Memo, **_: Any) -> None:
    """Timer while Pending/Running/Exporting: re-read the JobSet or export Jobs. Event handlers are
    not retried by kopf, so a transient failure there would otherwise strand the run until the next
    change of its children."""
    cr = dict(body)
    if status.get("phase") == "Exporting":
        _sync_export(memo.kube, memo.settings, cr)
        return
    jobset = memo.kube.get(JOBSET_API, "JobSet", cr["metadata"]["namespace"], status["jobSetName"])
    if jobset is None:
        _recreate_jobset(memo.kube, memo.settings, cr)
    elif jobset.get("status"):
        _sync_jobset(memo.kube, memo.settings, cr, jobset)


def _owner_cr(kube: Kube, child: dict[str, Any], kind: str, label: str) -> dict[str, Any] | None:
    """The CR a child belongs to, only if the child's controller reference points at it."""
    name = st.owner_name(child, label)
    namespace = child.get("metadata", {}).get("namespace")
    if not name or not namespace:
        return None
    cr = kube.get(API_VERSION, kind, namespace, name)
    if cr is None:
        return None
    uid = cr.get("metadata", {}).get("uid")
    refs = child.get("metadata", {}).get("ownerReferences") or []
    return cr if any(r.get("uid") == uid and r.get("controller") for r in refs) else None


def _write_status(kube: Kube, cr: dict[str, Any], obs: st.Observation, **fields: Any) -> None:
    """Patch the CR's status if anything changed; post an Event when the phase or restarts change."""
    current = cr.get("status") or {}
    meta = cr["metadata"]
    new = st.status_patch(current, obs, meta.get("generation"), st.now_rfc3339(), **fields)
    if all(current.get(k) == v for k, v in new.items()):
        return
    try:
        kube.merge_patch(API_VERSION, cr["kind"], meta["namespace"], meta["name"], {"status": new}, status=True)
    except ApiException as e:
        if e.status != 404:
            raise
        # Deleted since the timer or child event read it (its finalizer already removed): nothing to report.
        log.debug("%s %s/%s is gone; its status was not written", cr["kind"], meta["namespace"], meta["name"])
        return
    if current.get("phase") != obs.phase:
        _event("Warning" if obs.phase == "Failed" else "Normal", cr, reason=obs.reason, message=obs.message)
    if (obs.restarts or 0) > (current.get("restarts") or 0):  # with one slice, a restart also changes the phase
        _event("Warning", cr, reason="Restarted", message=f"the JobSet restarted (restart {obs.restarts}); training resumes from the last checkpoint")


def jobset_event(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """An owned JobSet changed: map its status onto the LoraFinetune; on completion start the export;
    deleted under a run that is still training, create it again."""
    cr = _owner_cr(memo.kube, dict(body), "LoraFinetune", LFT_LABEL)
    if cr is None:
        return
    if type == "DELETED":
        _recreate_jobset(memo.kube, memo.settings, cr)
    else:
        _sync_jobset(memo.kube, memo.settings, cr, dict(body))


def _recreate_jobset(kube: Kube, settings: OperatorSettings, cr: dict[str, Any]) -> None:
    """A run that is still training lost its JobSet (deleted by hand, or by a cleanup): create it
    again, as the reconcile on an operator restart would, so the run does not sit in a stale phase;
    training resumes from the last checkpoint. A run being deleted, finished or exporting is left alone."""
    phase = (cr.get("status") or {}).get("phase")
    if cr["metadata"].get("deletionTimestamp") or phase not in ("Pending", "Running", "Suspended"):
        return
    try:
        for manifest in render_lora_finetune(cr, settings):
            kube.create_or_adopt(manifest)
    except (InvalidSpec, CannotCreate) as e:  # as in reconcile (the settings changed, the name was taken, refused)
        _write_status(kube, cr, st.Observation("Failed", e.reason, f"the JobSet was deleted and cannot be created again: {e}"))
        return
    _event("Warning", cr, reason="JobSetRecreated",
           message=f"the JobSet was deleted while the run was {phase}; created it again, training resumes from the last "
                   "checkpoint (to stop a run, delete or suspend the LoraFinetune)")


def _sync_jobset(kube: Kube, settings: OperatorSettings, cr: dict[str, Any], jobset: dict[str, Any]) -> None:
    status = cr.get("status") or {}
    if status.get("phase") in (*st.TERMINAL, "Exporting"):
        return
    obs = st.observe_jobset(jobset, requested_suspend=bool((cr.get("spec") or {}).get("suspend")))
    # Training ended: read progress.json once more, or the status keeps the progress timer's last
    # read (often well before the final step).
    progress = _progress_fields(cr["spec"], status) if obs.phase in ("Exporting", "Failed") else {}
    if obs.phase == "Exporting":
        _start_export(kube, cr, settings, obs, **progress)
        return
    _write_status(kube, cr, obs, **progress)


def _create_export_jobs(kube: Kube, cr: dict[str, Any], spec: LoraFinetuneSpec, settings: OperatorSettings) -> list[dict[str, Any]]:
    """Create (or adopt) the run's export Jobs; raises InvalidSpec or CannotCreate as creating does."""
    jobs = render_export_jobs(Owner.from_body(cr), spec, settings)
    for job in jobs:
        kube.create_or_adopt(job)
    return jobs


def _start_export(kube: Kube, cr: dict[str, Any], settings: OperatorSettings, obs: st.Observation, **progress: Any) -> None:
    try:
        jobs = _create_export_jobs(kube, cr, parse_spec(LoraFinetuneSpec, cr), settings)
    except (InvalidSpec, CannotCreate) as e:
        _write_status(kube, cr, st.Observation("Failed", "ExportFailed", f"cannot start the export: {e}", obs.restarts), **progress)
        return
    if not jobs:
        _write_status(kube, cr, st.Observation("Succeeded", "TrainingCompleted", "training finished; no export requested (output.export)",
                                               obs.restarts, completion_time=obs.completion_time), **progress)
        return
    _write_status(kube, cr, obs, **progress)


def export_job_event(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """An export Job changed: Exporting -> Succeeded (adapterUri) or Failed (ExportFailed); deleted
    while exporting, it is created again."""
    cr = _owner_cr(memo.kube, dict(body), "LoraFinetune", LFT_LABEL)
    if cr is not None:
        _sync_export(memo.kube, memo.settings, cr)


def _sync_export(kube: Kube, settings: OperatorSettings, cr: dict[str, Any]) -> None:
    if (cr.get("status") or {}).get("phase") != "Exporting" or cr["metadata"].get("deletionTimestamp"):
        return
    spec = parse_spec(LoraFinetuneSpec, cr)
    names = ChildNames.of(cr["metadata"]["name"])
    ns = cr["metadata"]["namespace"]
    uris = output_uris(spec)
    expected = [n for key, n in (("adapter", names.export), ("merged", names.export_merged)) if key in uris]
    jobs = [kube.get("batch/v1", "Job", ns, n) for n in expected]
    if None in jobs:
        # Created before the phase became Exporting, so a missing one was deleted (by hand, or by its
        # TTL while the operator was away): export again; it rewrites the same files from the checkpoint.
        try:
            _create_export_jobs(kube, cr, spec, settings)
        except (InvalidSpec, CannotCreate) as e:
            _write_status(kube, cr, st.Observation("Failed", "ExportFailed", f"an export Job was deleted and cannot be created again: {e}"))
            return
        _event("Warning", cr, reason="ExportRecreated", message="an export Job was deleted before it finished; created it again")
        return
    obs = st.combine_jobs([st.observe_job(j, "export") for j in jobs])
    fields: dict[str, Any] = {}
    if obs.phase == "Succeeded":
        fields = {"adapterUri": uris.get("adapter"), "mergedUri": uris.get("merged")}
    elif obs.phase == "Failed":
        obs = st.Observation("Failed", "ExportFailed", obs.message, completion_time=obs.completion_time)
    else:  # still exporting: the condition says whether the export pod waits or runs
        obs = st.Observation("Exporting", obs.reason, obs.message)
    _write_status(kube, cr, obs, **fields)


# --- AdapterConversion -------------------------------------------------------------------------


def adc_reconcile(body: kopf.Body, meta: kopf.Meta, status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    """create/resume: create (or adopt) the conversion Job."""
    if status.get("phase") in st.TERMINAL:
        return
    generation = meta.get("generation")
    try:
        spec = parse_spec(AdapterConversionSpec, dict(body))
        job = render_conversion_job(Owner.from_body(dict(body)), spec, memo.settings)
    except InvalidSpec as e:
        _fail(dict(body), patch, dict(status), "InvalidSpec", str(e), generation)
        return
    name = conversion_job_name(meta["name"])
    fresh = not status.get("jobName")
    if fresh:  # before the Job exists, so the Job watcher's writes land after it
        obs = st.Observation("Pending", "JobCreated", f"created conversion Job {name}")
        memo.kube.merge_patch(API_VERSION, "AdapterConversion", meta["namespace"], meta["name"],
                              {"status": st.status_patch({}, obs, generation, st.now_rfc3339(), jobName=name)}, status=True)
    try:
        created = memo.kube.create_or_adopt(job)
    except CannotCreate as e:
        _fail(dict(body), patch, dict(status), e.reason, str(e), generation)
        return
    if created:
        _creation_event(dict(body), dict(status), f"created conversion Job {name}", "ConversionRecreated",
                        f"conversion Job {name} was missing when the operator resumed this conversion; created it again")


def conversion_job_event(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """The conversion Job changed: report Running / Succeeded (outputUri) / Failed; deleted before it
    finished, it is created again."""
    cr = _owner_cr(memo.kube, dict(body), "AdapterConversion", ADC_LABEL)
    if cr is not None:
        _sync_conversion(memo.kube, memo.settings, cr, None if type == "DELETED" else dict(body))


def adc_resync(body: kopf.Body, status: kopf.Status, memo: kopf.Memo, **_: Any) -> None:
    """Timer while Pending/Running: re-read the conversion Job, as `lft_resync` does for a run (a
    failed status write in the event handler, which kopf does not retry, left it Running)."""
    cr = dict(body)
    _sync_conversion(memo.kube, memo.settings, cr, memo.kube.get("batch/v1", "Job", cr["metadata"]["namespace"], status["jobName"]))


def _sync_conversion(kube: Kube, settings: OperatorSettings, cr: dict[str, Any], job: dict[str, Any] | None) -> None:
    """Map the conversion Job (None: it is gone) onto the AdapterConversion."""
    if (cr.get("status") or {}).get("phase") in st.TERMINAL or cr["metadata"].get("deletionTimestamp"):
        return
    if job is None:
        try:
            kube.create_or_adopt(render_conversion_job(Owner.from_body(cr), parse_spec(AdapterConversionSpec, cr), settings))
        except (InvalidSpec, CannotCreate) as e:
            _write_status(kube, cr, st.Observation("Failed", e.reason, f"the conversion Job was deleted and cannot be created again: {e}"))
            return
        _event("Warning", cr, reason="ConversionRecreated", message="the conversion Job was deleted before it finished; created it again")
        return
    obs = st.observe_job(job, "conversion")
    if obs.phase == "Failed":
        obs = st.Observation("Failed", "ConversionFailed", obs.message, start_time=obs.start_time, completion_time=obs.completion_time)
    output = cr["spec"]["target"]["uri"] if obs.phase == "Succeeded" else None
    _write_status(kube, cr, obs, outputUri=output)


# --- registry ----------------------------------------------------------------------------------


def _has_status(body: kopf.Body, **_: Any) -> bool:
    """A JobSet the controller has not reported on yet changes nothing (reconcile set the phase)."""
    return bool(body.get("status"))


def _in_flight(status: kopf.Status, **_: Any) -> bool:
    return status.get("phase") in ("Pending", "Running", "Exporting") and bool(status.get("jobSetName"))


def _converting(status: kopf.Status, **_: Any) -> bool:
    return status.get("phase") in ("Pending", "Running") and bool(status.get("jobName"))


def _running(status: kopf.Status, **_: Any) -> bool:
    return status.get("phase") == "Running"


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    """Every handler of the operator, with the timer interval from the settings."""
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    for decorator in (kopf.on.create, kopf.on.resume):
        decorator(GROUP, VERSION, LFT, registry=registry, id="reconcile", backoff=RETRY_SECONDS)(lft_reconcile)
        decorator(GROUP, VERSION, ADC, registry=registry, id="reconcile", backoff=RETRY_SECONDS)(adc_reconcile)
    kopf.on.update(GROUP, VERSION, LFT, field="spec.suspend", registry=registry, id="suspend", backoff=RETRY_SECONDS)(lft_suspend)
    kopf.timer(GROUP, VERSION, LFT, interval=settings.progress_poll_seconds, when=_running, registry=registry, id="progress")(lft_progress)
    # The resync's first read waits one interval: a new run's JobSet was just created, and on a restart
    # the JobSet watch's initial listing already syncs every run; reading at once doubles a burst's load.
    kopf.timer(GROUP, VERSION, LFT, interval=settings.progress_poll_seconds, initial_delay=settings.progress_poll_seconds,
               when=_in_flight, registry=registry, id="resync")(lft_resync)
    kopf.timer(GROUP, VERSION, ADC, interval=settings.progress_poll_seconds, initial_delay=settings.progress_poll_seconds,
               when=_converting, registry=registry, id="resync")(adc_resync)
    kopf.on.event("jobset.x-k8s.io", "v1alpha2", "jobsets", labels={LFT_LABEL: kopf.PRESENT}, when=_has_status,
                  registry=registry)(jobset_event)
    kopf.on.event("batch", "v1", "jobs", labels={LFT_LABEL: kopf.PRESENT, COMPONENT_LABEL: "export"}, registry=registry)(export_job_event)
    kopf.on.event("batch", "v1", "jobs", labels={ADC_LABEL: kopf.PRESENT, COMPONENT_LABEL: "convert"}, registry=registry)(conversion_job_event)
    return registry
