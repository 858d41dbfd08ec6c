"""The act half of "plan, then act": observe a CR's children, decide (lora_operator.reconcile),
execute the operations, and repeat until nothing is left to do; then write the status, once.

One reconcile of a CR at a time in this process (a lock per CR: the CR's own handlers, its
children's events and its timer all land here). Status is written by `write_status` only, as a
merge patch conditional on the CR's resourceVersion, so a decision made on a stale read is never
written over a newer one: the conflict sends the reconcile back to reading. A reconcile collects
the status changes its rounds decide in one `StatusDraft` and writes it once, at the end; the
only other writes are the write-aheads the durable record needs (see `StatusDraft`).
"""

from __future__ import annotations

import contextlib
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


class StatusDraft:
    """The status changes a reconcile has decided and not yet written, merged in decision order.

    A reconcile is several rounds of observe, decide, act; each round decides on the CR as the
    draft will leave it (`over`), and the draft is written once, when nothing is left to do. One
    exception, on purpose: before any operation on a child the draft is written first (a
    write-ahead), because what the status says must be durable before the operator acts on it
    (lora_operator.reconcile): the admission before the children are created, the suspension
    requested before the JobSet is patched, what training ended with before the JobSet is let go.
    A kill between the two then finds the record and finishes the job. So a reconcile writes its
    status at most once, plus once per write-ahead."""

    def __init__(self) -> None:
        self.status: StatusModel | None = None

    def add(self, change: StatusModel) -> None:
        """Merge a decided change in (a field decided again keeps the later value)."""
        self.status = change if self.status is None else self.status.merged(change)

    def over(self, cr: Manifest) -> Manifest:
        """`cr` as it will be once the draft is written: what the next decision starts from.
        Shallow, like the merge patch for what decisions write (whole lists, whole records)."""
        if self.status is None:
            return cr
        return {**cr, "status": {**(cr.get("status") or {}), **self.status.to_patch()}}

    def write(self, kube: Kube, cr: Manifest) -> Manifest | None:
        """Write the draft onto `cr` (the CR as last read or written) and start afresh. Returns
        the CR as written (`cr` when nothing was pending; None: it is gone); Stale if it changed."""
        if self.status is None:
            return cr
        written = write_status(kube, cr, self.status)
        self.status = None
        return written


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
        """Rounds of observe, decide, act until nothing is left to do, then the one status write.
        A conflict drops what was decided on the stale read (draft included) and reads again."""
        cr: Manifest | None = None
        seen: Observed | None = None
        draft = StatusDraft()
        for _ in range(MAX_ROUNDS):
            cr = cr or self.kube.get(API_VERSION, kind, namespace, name)
            if cr is None:
                return
            try:
                ops, seen = self._decide(draft.over(cr), seen)
                if not ops:
                    draft.write(self.kube, cr)
                    self._settled(seen)
                    return
                cr, seen = self._execute(cr, draft, ops, seen)
            except Stale as e:
                log.debug("reconcile of %s %s/%s: %s; reading again", kind, namespace, name, e)
                cr, seen, draft = None, None, StatusDraft()
        log.info("%s %s/%s is still changing after %d rounds; the next event or resync goes on", kind, namespace, name, MAX_ROUNDS)
        if cr is not None:  # what the executed rounds decided is written; the next trigger goes on from there
            with contextlib.suppress(Stale):
                draft.write(self.kube, cr)

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

    def _execute(self, cr: Manifest, draft: StatusDraft, ops: list[Op], seen: Observed) -> tuple[Manifest | None, Observed | None]:
        """Run the operations in order, status changes into `draft`; the first refusal ends the
        round. Returns what the next round starts from instead of reading again: the CR as read
        or as the round's write-ahead left it (None: it is gone), so that every change in the
        draft was decided on the very version the draft's conditional write goes onto (only a
        reconcile holding the CR's lock writes its status; anyone else's change is a conflict),
        and `seen` with the children the round created, unless it patched a child or moved the
        run between training and exporting (which observe different children)."""
        before = observes_exports(draft.over(cr))
        created: dict[str, Manifest] = {}
        patched = False
        for op in ops:
            if self._note(cr, draft, op):
                continue
            if draft.status is not None:  # status first, then children: the write-ahead (see StatusDraft)
                written = draft.write(self.kube, cr)
                if written is None:
                    return None, None
                cr = written
            if isinstance(op, Create):
                if (child := self._create(cr, draft, op)) is None:
                    return cr, None
                created[child["kind"] + "/" + child["metadata"]["name"]] = child
            else:
                patched = True
                self._change_child(cr, op)
        if patched or before != observes_exports(draft.over(cr)):
            return cr, None
        jobset = next((c for c in created.values() if c["kind"] == "JobSet"), seen.jobset)
        jobs = {name: created.get(f"Job/{name}", job) for name, job in seen.jobs.items()}
        return cr, Observed(jobset=jobset, jobs=jobs, secret=seen.secret, progress=seen.progress)

    def _note(self, cr: Manifest, draft: StatusDraft, op: Op) -> bool:
        """Take a status change into the draft or post an event; False for an operation on a child."""
        if isinstance(op, WriteStatus):
            draft.add(op.status)
        elif isinstance(op, PostEvent):
            self.kube.post_event(cr, type=op.type, reason=op.reason, message=op.message, key=op.key)
        else:
            return False
        return True

    def _create(self, cr: Manifest, draft: StatusDraft, op: Create) -> Manifest | None:
        """Create (or adopt) a child. Refused (a webhook, a name taken), the CR's failure goes
        into the draft, its event is posted, and None is returned."""
        try:
            child = self.kube.create_or_adopt(op.manifest)
        except CannotCreate as e:
            obs = st.Observation(Phase.FAILED, op.reason or e.reason, f"{op.prefix}{e}")
            for failed in status_ops(draft.over(cr), obs, now_rfc3339()):
                self._note(cr, draft, failed)
            return None
        self._remember(child)
        return child

    def _change_child(self, cr: Manifest, op: Op) -> None:
        """Suspend or resume the JobSet, or set a child's finalizers."""
        if isinstance(op, PatchSuspend):
            self._patch(JOBSET_API, "JobSet", cr["metadata"]["namespace"], op.name, {"spec": {"suspend": op.suspend}})
        else:
            assert isinstance(op, SetFinalizers)
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

