"""`lora-operator run`: start kopf with our registry (standalone, liveness endpoint, `/metrics`),
alone or as one of several replicas that elect a leader (`leaderElection` in the settings)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

import kopf
import kubernetes.client
import kubernetes.config

from lora_operator.controller import Controller
from lora_operator.handlers import build_registry
from lora_operator.kube import Kube
from lora_operator.leader import LeaderElector, LostLeadership, default_identity, lead
from lora_operator.metrics import FailureLog, OperatorMetrics
from lora_operator.settings import OperatorSettings, SettingsError, load_settings


def kube_from_environment() -> Kube:
    """In-cluster service account when running in a pod, else the local kubeconfig."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return Kube(kubernetes.client.ApiClient())


def add_cluster_login(registry: kopf.OperatorRegistry) -> None:
    """Authenticate kopf the same way as our client: service account in-cluster, else kubeconfig."""
    kopf.on.login(registry=registry)(kopf.login_with_service_account)
    kopf.on.login(registry=registry)(kopf.login_with_kubeconfig)


async def _reconcile(
    settings: OperatorSettings,
    kube: Kube,
    registry: kopf.OperatorRegistry,
    *,
    namespaces: Sequence[str],
    liveness: str | None,
    stop_flag: object,
    ready_flag: object,
) -> None:
    watched = list(namespaces) or settings.watch_namespaces
    kopf_settings = kopf.OperatorSettings()
    # Chosen namespaces are served exactly as named. With scanning on, kopf would first list every
    # namespace (to match patterns), which the chart's namespaced RBAC forbids, and retry that 403
    # for ~1 min, serving nothing meanwhile. The cost: CRDs are discovered once, at start.
    kopf_settings.scanning.disabled = bool(watched)
    await kopf.operator(
        registry=registry,
        settings=kopf_settings,
        memo=kopf.Memo(settings=settings, kube=kube, controller=Controller(kube, settings)),
        standalone=True,
        clusterwide=not watched,
        namespaces=watched,
        liveness_endpoint=liveness,
        stop_flag=stop_flag,  # type: ignore[arg-type]
        ready_flag=ready_flag,  # type: ignore[arg-type]
    )


async def operate(
    settings: OperatorSettings,
    kube: Kube,
    registry: kopf.OperatorRegistry,
    *,
    namespaces: Sequence[str] = (),
    liveness: str | None = None,
    stop_flag: object = None,
    ready_flag: object = None,
    metrics: OperatorMetrics | None = None,
    identity: str | None = None,
) -> None:
    """Run the operator until `stop_flag` is set (the tests and `run_operator` share this): at once, or
    once this replica holds the leader Lease (raising LostLeadership if it loses it)."""
    metrics = metrics or OperatorMetrics()
    metrics.install(registry)
    failures = FailureLog(metrics)
    logging.getLogger("kopf").addHandler(failures)
    try:
        def reconcile(flag: object) -> Coroutine[Any, Any, None]:
            return _reconcile(settings, kube, registry, namespaces=namespaces, liveness=liveness, stop_flag=flag, ready_flag=ready_flag)

        if not settings.leader_election.enabled:
            metrics.leader.set(1)
            await reconcile(stop_flag)
            return
        elector = LeaderElector(kube, settings.leader_election, identity or default_identity())
        await lead(elector, reconcile, stop_flag=stop_flag, liveness=liveness, on_leading=lambda on: metrics.leader.set(int(on)))
    finally:
        logging.getLogger("kopf").removeHandler(failures)


def run_operator(*, namespaces: Sequence[str], liveness: str, settings_path: str | None, metrics_port: int) -> int:
    """Entry point of `lora-operator run`; 1 when this replica lost the leader Lease (restart it)."""
    try:
        settings = load_settings(settings_path)
    except SettingsError as e:
        print(f"lora-operator run: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    registry = build_registry(settings)
    add_cluster_login(registry)
    metrics = OperatorMetrics()
    try:
        server = metrics.serve(metrics_port) if metrics_port else None
    except OSError as e:
        print(f"lora-operator run: cannot serve /metrics on port {metrics_port} ({e.strerror}); "
              "pass a free --metrics-port (0: no metrics)", file=sys.stderr)
        return 2
    try:
        asyncio.run(operate(settings, kube_from_environment(), registry, namespaces=namespaces, liveness=liveness,
                            metrics=metrics, identity=os.environ.get("POD_NAME")))
    except LostLeadership as e:
        print(f"lora-operator run: {e}; exiting to start again as a candidate", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.shutdown()
    return 0
