"""The act half of "plan, then act": observe a CR's children, decide (lora_operator.reconcile),
execute the operations, and repeat on fresh reads until nothing is left to do.

One reconcile of a CR at a time in this process (a lock per CR: the CR's own handlers, its
children's events and its timer all land here). Status is written by `write_status` only, as a
merge patch conditional on the CR's resourceVersion, so a decision made on a stale read is never
written over a newer one: the conflict sends the reconcile round back to reading.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kubernetes.client.exceptions import ApiException

from lora_operator import status as st
from lora_operator.api import API_VERSION, JOBSET_API, Phase, StatusModel
from lora_operator.kube import CannotCreate, Kube
from lora_operator.plan import plan_adapter_conversion, plan_lora_finetune
from lora_operator.reconcile import (
    Create,
    Observed,
    Op,
    PatchSuspend,
    PostEvent,
    SetFinalizers,
    WriteStatus,
    decide_adapter_conversion,
    decide_lora_finetune,
    deleting,
    release,
    status_ops,
)
from lora_operator.render import Manifest
from lora_operator.run_progress import ProgressReader, progress_fields, progress_status
from lora_operator.settings import OperatorSettings
from lora_trainer.progress_record import ProgressRecord, now_rfc3339

log = logging.getLogger(__name__)

#: Rounds of observe-decide-act per reconcile; a CR that needs more is picked up again by the next trigger.
MAX_ROUNDS = 8
#: Answers that mean "read again and decide again": the object changed (409; 422 for a failed JSON
#: patch test) or went away (404).
STALE = {404, 409, 422}


class Stale(Exception):
    """What a round read has changed since; the next round reads again."""


def write_status(kube: Kube, cr: Manifest, status: StatusModel) -> Manifest | None:
    """The one writer of a CR's status: a merge patch of the fields of the partial `status` that
    change (no request when none does), refused (Stale) if the CR changed since `cr` was read.
    Returns the CR as written (None: it is gone)."""
    current = cr.get("status") or {}
    changed = {k: v for k, v in status.to_patch().items() if current.get(k) != v}
    if not changed:
        return cr
    meta = cr["metadata"]
    patch = {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": changed}
    try:
        return kube.merge_patch(API_VERSION, cr["kind"], meta["namespace"], meta["name"], patch, status=True)
    except ApiException as e:
        if e.status == 404:
            log.debug("%s %s/%s is gone; its status was not written", cr["kind"], meta["namespace"], meta["name"])
            return None
        if e.status == 409:
            raise Stale(f"{cr['kind']} {meta['name']} changed since it was read") from e
        raise


def observes_exports(cr: Manifest) -> bool:
    """Whether a reconcile of this CR reads the export Jobs too: once training has ended, and while
    the CR is being deleted (so that they can be let go)."""
    status = cr.get("status") or {}
    return bool(status.get("jobSetName")) and (status.get("phase") not in st.TRAINING or deleting(cr))


def owned(child: Manifest | None, owner: Manifest) -> Manifest | None:
    """`child` if `owner` is its controller, else None."""
    if child is None:
        return None
    uid = owner["metadata"].get("uid")
    refs = child.get("metadata", {}).get("ownerReferences") or []
    return child if any(r.get("uid") == uid and r.get("controller") for r in refs) else None


class Controller:
    """Reconciles LoraFinetunes and AdapterConversions against the API server."""

    def __init__(self, kube: Kube, settings: OperatorSettings, reader: ProgressReader | None = None) -> None:
        self.kube = kube
        self.settings = settings
        self.reader = reader or ProgressReader()
        self._locks: dict[tuple[str, str, str], threading.Lock] = {}
        self._locks_lock = threading.Lock()
        #: (kind, namespace, name) of a child -> the resourceVersion a reconcile last settled with.
        self._settled_at: dict[tuple[str, str, str], str | None] = {}

    def _lock(self, kind: str, namespace: str, name: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault((kind, namespace, name), threading.Lock())

    # --- entry points ---------------------------------------------------------------------------

    def reconcile(self, kind: str, namespace: str, name: str) -> None:
        """Bring one CR where its spec, its record and its children say it should be.

        Each round starts from the CR as read under the lock, or as the previous round's own status
        write left it; never from a copy taken before the lock (a kopf body): a decision on a status
        another reconcile has moved on from (Running, when the run already records Exporting and its
        JobSet has gone) would create what that one let go."""
        with self._lock(kind, namespace, name):
            self._reconcile_locked(kind, namespace, name)

    def _reconcile_locked(self, kind: str, namespace: str, name: str) -> None:
        cr: Manifest | None = None
        seen: Observed | None = None
        for _ in range(MAX_ROUNDS):
            cr = cr or self.kube.get(API_VERSION, kind, namespace, name)
            if cr is None:
                return
            ops, seen = self._decide(cr, seen)
            if not ops:
                self._settled(seen)
                return
            try:
                cr, seen = self._execute(cr, ops, seen)
            except Stale as e:
                log.debug("reconcile of %s %s/%s: %s; reading again", kind, namespace, name, e)
                cr, seen = None, None
        log.info("%s %s/%s is still changing after %d rounds; the next event or resync goes on", kind, namespace, name, MAX_ROUNDS)

    def _settled(self, seen: Observed) -> None:
        """Remember the children a reconcile found nothing to do about, as it saw them."""
        self._remember(seen.jobset, *seen.jobs.values())

    def _remember(self, *children: Manifest | None) -> None:
        """Remember these versions of children as known: the operator made them (its create's or
        patch's answer, which its own reconcile goes on from) or settled with them."""
        with self._locks_lock:
            for child in children:
                if child is not None:
                    meta = child["metadata"]
                    self._settled_at[child["kind"], meta["namespace"], meta["name"]] = meta.get("resourceVersion")

    def _known(self, child: Manifest) -> bool:
        """Whether this version of the child is one a reconcile made or settled with: its event (the
        echo of the operator's own write) brings no news."""
        meta = child.get("metadata", {})
        with self._locks_lock:
            known = self._settled_at.get((child.get("kind", ""), meta.get("namespace", ""), meta.get("name", "")))
        return bool(meta.get("resourceVersion")) and known == meta["resourceVersion"]

    def child_changed(self, child: Manifest, kind: str, label: str, event: str | None = None) -> None:
        """A child changed (or went): reconcile its owner. A child whose owner is gone (or is
        another object of the same name) is let go at once: nobody needs to know what it did. An
        event for the very version of a child that a reconcile settled with (the echo of the
        operator's own create or patch) changes nothing and is dropped."""
        meta = child.get("metadata", {})
        name = (meta.get("labels") or {}).get(label)
        if not name or event != "DELETED" and self._known(child):
            return
        with self._lock(kind, meta["namespace"], name):
            if event != "DELETED" and self._known(child):  # a reconcile that made or saw this very version just ended
                return
            cr = self.kube.get(API_VERSION, kind, meta["namespace"], name)
            if cr is None or owned(child, cr) is None:
                self._let_go(child)
            else:
                self._reconcile_locked(kind, meta["namespace"], name)

    def _let_go(self, child: Manifest) -> None:
        """Take the tracking finalizer off a child nobody needs to know about any more."""
        meta = child["metadata"]
        for _ in range(MAX_ROUNDS):
            ops = release(child)
            if not ops:
                return
            try:
                for op in ops:
                    assert isinstance(op, SetFinalizers)
                    self._set_finalizers(op)
                return
            except Stale:
                fresh = self.kube.get(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])
                if fresh is None:
                    return
                child = fresh

    # --- observe and decide ---------------------------------------------------------------------

    def _decide(self, cr: Manifest, seen: Observed | None) -> tuple[list[Op], Observed]:
        """Observe the CR's children (or take `seen`, still valid from the round before) and
        decide: (operations, what was observed)."""
        now = now_rfc3339()
        if cr["kind"] == "LoraFinetune":
            plan = plan_lora_finetune(cr, self.settings)
            seen = seen or self._observe_run(cr, plan)
            return decide_lora_finetune(cr, plan, seen, now), seen
        conversion = plan_adapter_conversion(cr, self.settings)
        if seen is None:
            job = owned(self.kube.get("batch/v1", "Job", cr["metadata"]["namespace"], conversion.job_name), cr)
            seen = Observed(jobs={conversion.job_name: job})
        return decide_adapter_conversion(cr, conversion, seen, now), seen

    def _observe_run(self, cr: Manifest, plan: Any) -> Observed:
        ns = cr["metadata"]["namespace"]
        status = cr.get("status") or {}
        phase = status.get("phase")
        if not status.get("jobSetName"):
            return Observed(secret=self._secret(ns, plan.spec) if plan.spec is not None else None)
        jobset = owned(self.kube.get(JOBSET_API, "JobSet", ns, plan.names.jobset), cr)
        jobs: dict[str, Manifest | None] = {}
        if observes_exports(cr):
            jobs = {n: owned(self.kube.get("batch/v1", "Job", ns, n), cr) for n in plan.export_names}
        progress: dict[str, Any] = {}
        if phase in st.TRAINING and jobset is not None and plan.spec is not None:
            if st.observe_jobset(jobset).phase in (Phase.EXPORTING, Phase.FAILED):
                # Training ended: read the last record, or the status keeps the timer's (often well before the end).
                progress = self._progress(plan.spec.output.uri, plan.spec.training.steps, status)
        return Observed(jobset=jobset, jobs=jobs, progress=progress)

    def _secret(self, namespace: str, spec: Any) -> str | None:
        """Whether the Secret named by spec.hfTokenSecretRef exists with its key (its data is never kept)."""
        ref = spec.hf_token_secret_ref
        if ref is None:
            return None
        secret = self.kube.get("v1", "Secret", namespace, ref.name)
        if secret is None:
            return "missing"
        return "found" if ref.key in (secret.get("data") or {}) | (secret.get("stringData") or {}) else "no-key"

    def _progress(self, output_uri: str, total: int, status: dict[str, Any]) -> dict[str, Any]:
        """The status fields the trainer's last progress record changes (none if it cannot be read now)."""
        record = self.reader.read(output_uri)
        if record is None:
            return {}
        return {k: v for k, v in progress_status(record, total).items() if status.get(k) != v}

    def record_progress(self, namespace: str, name: str, record: ProgressRecord) -> None:
        """Copy a progress record (read by the timer) into a Running run's status (no longer
        Running: nothing to copy)."""
        with self._lock("LoraFinetune", namespace, name):
            for _ in range(MAX_ROUNDS):  # kopf's own annotation patches may land between the read and the write
                cr = self.kube.get(API_VERSION, "LoraFinetune", namespace, name)
                status = (cr or {}).get("status") or {}
                if cr is None or status.get("phase") != Phase.RUNNING:
                    return
                total = int(((cr.get("spec") or {}).get("training") or {}).get("steps") or status.get("totalSteps") or 0)
                try:
                    write_status(self.kube, cr, progress_fields(record, total))
                    return
                except Stale:
                    log.debug("%s/%s changed while its progress was written; reading it again", namespace, name)

    # --- act ------------------------------------------------------------------------------------

    def _execute(self, cr: Manifest, ops: list[Op], seen: Observed) -> tuple[Manifest | None, Observed | None]:
        """Run the operations in order; the first refusal ends the round. Returns what the next
        round may start from instead of reading again: the CR as the round's last status write
        left it (no other operation changes the CR, and only a reconcile holding its lock writes
        its status), and `seen` with the children the round created, unless it patched a child or
        moved the run between training and exporting (which observe different children)."""
        fresh: Manifest | None = None
        before = observes_exports(cr)
        created: dict[str, Manifest] = {}
        patched = False
        for op in ops:
            if isinstance(op, WriteStatus):
                written = write_status(self.kube, cr, op.status)
                if written is None:
                    return None, None
                cr = fresh = written
            elif isinstance(op, PostEvent):
                self.kube.post_event(cr, type=op.type, reason=op.reason, message=op.message, key=op.key)
            elif isinstance(op, Create):
                try:
                    child = self.kube.create_or_adopt(op.manifest)
                except CannotCreate as e:
                    obs = st.Observation(Phase.FAILED, op.reason or e.reason, f"{op.prefix}{e}")
                    return self._execute(cr, status_ops(cr, obs, now_rfc3339()), seen)[0], None
                created[child["kind"] + "/" + child["metadata"]["name"]] = child
                self._remember(child)
            elif isinstance(op, PatchSuspend):
                patched = True
                self._patch(JOBSET_API, "JobSet", cr["metadata"]["namespace"], op.name, {"spec": {"suspend": op.suspend}})
            else:
                patched = True
                self._set_finalizers(op)
        if patched or before != observes_exports(cr):
            return fresh, None
        jobset = next((c for c in created.values() if c["kind"] == "JobSet"), seen.jobset)
        jobs = {name: created.get(f"Job/{name}", job) for name, job in seen.jobs.items()}
        return fresh, Observed(jobset=jobset, jobs=jobs, secret=seen.secret, progress=seen.progress)

    def _patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        try:
            self.kube.merge_patch(api_version, kind, namespace, name, patch)
        except ApiException as e:
            if e.status in STALE:
                raise Stale(f"{kind} {name} answered {e.status}") from e
            raise

    def _set_finalizers(self, op: SetFinalizers) -> None:
        try:
            self.kube.set_finalizers(op.child, op.finalizers)
        except ApiException as e:
            if e.status in STALE:
                raise Stale(f"{op.child['kind']} {op.child['metadata']['name']} changed since it was read") from e
            raise

