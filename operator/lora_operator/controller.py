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
from lora_operator.api import API_VERSION
from lora_operator.kube import CannotCreate, Kube
from lora_operator.plan import plan_adapter_conversion, plan_lora_finetune
from lora_operator.progress import ProgressReader, progress_status
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
from lora_operator.render import JOBSET_API, Manifest
from lora_operator.settings import OperatorSettings

log = logging.getLogger(__name__)

#: Rounds of observe-decide-act per reconcile; a CR that needs more is picked up again by the next trigger.
MAX_ROUNDS = 8
#: Answers that mean "read again and decide again": the object changed (409; 422 for a failed JSON
#: patch test) or went away (404).
STALE = {404, 409, 422}


class Stale(Exception):
    """What a round read has changed since; the next round reads again."""


def write_status(kube: Kube, cr: Manifest, fields: dict[str, Any]) -> Manifest | None:
    """The one writer of a CR's status: a merge patch of the fields that change, refused (Stale) if
    the CR changed since `cr` was read. Returns the CR as written (None: it is gone)."""
    current = cr.get("status") or {}
    changed = {k: v for k, v in fields.items() if current.get(k) != v}
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

    def _lock(self, kind: str, namespace: str, name: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault((kind, namespace, name), threading.Lock())

    # --- entry points ---------------------------------------------------------------------------

    def reconcile(self, kind: str, namespace: str, name: str) -> None:
        """Bring one CR where its spec, its record and its children say it should be."""
        with self._lock(kind, namespace, name):
            for _ in range(MAX_ROUNDS):
                cr = self.kube.get(API_VERSION, kind, namespace, name)
                if cr is None:
                    return
                ops = self._decide(cr)
                if not ops:
                    return
                try:
                    self._execute(cr, ops)
                except Stale as e:
                    log.debug("reconcile of %s %s/%s: %s; reading again", kind, namespace, name, e)
            log.info("%s %s/%s is still changing after %d rounds; the next event or resync goes on", kind, namespace, name, MAX_ROUNDS)

    def child_changed(self, child: Manifest, kind: str, label: str) -> None:
        """A child changed (or went): reconcile its owner. A child whose owner is gone (or is
        another object of the same name) is let go at once: nobody needs to know what it did."""
        meta = child.get("metadata", {})
        name = (meta.get("labels") or {}).get(label)
        if not name:
            return
        cr = self.kube.get(API_VERSION, kind, meta["namespace"], name)
        if cr is None or owned(child, cr) is None:
            self._let_go(child)
        else:
            self.reconcile(kind, meta["namespace"], name)

    def _let_go(self, child: Manifest) -> None:
        meta = child["metadata"]
        for _ in range(MAX_ROUNDS):
            if not release(child):
                return
            try:
                self._execute(child, release(child))
                return
            except Stale:
                fresh = self.kube.get(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])
                if fresh is None:
                    return
                child = fresh

    # --- observe and decide ---------------------------------------------------------------------

    def _decide(self, cr: Manifest) -> list[Op]:
        now = st.now_rfc3339()
        if cr["kind"] == "LoraFinetune":
            plan = plan_lora_finetune(cr, self.settings)
            return decide_lora_finetune(cr, plan, self._observe_run(cr, plan), now)
        conversion = plan_adapter_conversion(cr, self.settings)
        job = owned(self.kube.get("batch/v1", "Job", cr["metadata"]["namespace"], conversion.job_name), cr)
        return decide_adapter_conversion(cr, conversion, Observed(jobs={conversion.job_name: job}), now)

    def _observe_run(self, cr: Manifest, plan: Any) -> Observed:
        ns = cr["metadata"]["namespace"]
        status = cr.get("status") or {}
        phase = status.get("phase")
        if not status.get("jobSetName"):
            return Observed(secret=self._secret(ns, plan.spec) if plan.spec is not None else None)
        jobset = owned(self.kube.get(JOBSET_API, "JobSet", ns, plan.names.jobset), cr)
        jobs: dict[str, Manifest | None] = {}
        if phase not in st.TRAINING or deleting(cr):
            jobs = {n: owned(self.kube.get("batch/v1", "Job", ns, n), cr) for n in plan.export_names}
        progress: dict[str, Any] = {}
        if phase in st.TRAINING and jobset is not None and plan.spec is not None:
            if st.observe_jobset(jobset).phase in ("Exporting", "Failed"):
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

    def record_progress(self, namespace: str, name: str, record: dict[str, Any]) -> None:
        """Copy a progress record (read by the timer) into a Running run's status; a run that has
        changed meanwhile keeps its status (the next tick reads again)."""
        with self._lock("LoraFinetune", namespace, name):
            cr = self.kube.get(API_VERSION, "LoraFinetune", namespace, name)
            status = (cr or {}).get("status") or {}
            if cr is None or status.get("phase") != "Running":
                return
            total = int(((cr.get("spec") or {}).get("training") or {}).get("steps") or status.get("totalSteps") or 0)
            try:
                write_status(self.kube, cr, progress_status(record, total))
            except Stale:
                log.debug("%s/%s changed while its progress was read; the next read writes it", namespace, name)

    # --- act ------------------------------------------------------------------------------------

    def _execute(self, cr: Manifest, ops: list[Op]) -> None:
        """Run the operations in order; the first refusal ends the round."""
        for op in ops:
            if isinstance(op, WriteStatus):
                written = write_status(self.kube, cr, op.fields)
                if written is None:
                    return
                cr = written
            elif isinstance(op, PostEvent):
                self.kube.post_event(cr, type=op.type, reason=op.reason, message=op.message, key=op.key)
            elif isinstance(op, Create):
                try:
                    self.kube.create_or_adopt(op.manifest)
                except CannotCreate as e:
                    obs = st.Observation("Failed", op.reason or e.reason, f"{op.prefix}{e}")
                    self._execute(cr, status_ops(cr, obs, st.now_rfc3339()))
                    return
            elif isinstance(op, PatchSuspend):
                self._patch(JOBSET_API, "JobSet", cr["metadata"]["namespace"], op.name, {"spec": {"suspend": op.suspend}})
            else:
                self._set_finalizers(op)

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

