"""High availability: two `lora-operator run` processes elect a leader over a Lease on the emulated
API server; only the leader reconciles, and when it is SIGKILLed the other takes over without a
duplicate child. The election itself (expiry on the candidate's own clock, races, release) is
checked without processes too."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest
import yaml
from gcs_emulator import free_port
from k8s_harness import Harness
from test_operator_e2e import lft

from lora_operator.leader import LeaderElector
from lora_operator.settings import LeaderElection

LEASE = {"enabled": True, "leaseName": "lora-operator", "leaseNamespace": "default",
         "leaseDurationSeconds": 3, "renewDeadlineSeconds": 2, "retryPeriodSeconds": 0.5}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_the_lease_goes_to_one_candidate_and_over_only_when_it_expired():
    async with Harness() as h:
        config = LeaderElection.model_validate(LEASE)
        clock_a, clock_b = _Clock(), _Clock()
        a, b = LeaderElector(h.kube(), config, "op-a", clock_a), LeaderElector(h.kube(), config, "op-b", clock_b)
        assert await asyncio.to_thread(a.try_acquire_or_renew)
        assert not await asyncio.to_thread(b.try_acquire_or_renew)
        clock_b.now = 2.9  # A has not renewed for 2.9s of B's clock: not expired yet
        assert not await asyncio.to_thread(b.try_acquire_or_renew)
        clock_a.now = 1.0
        assert await asyncio.to_thread(a.try_acquire_or_renew)  # A renews: B's wait starts over
        clock_b.now = 5.0
        assert not await asyncio.to_thread(b.try_acquire_or_renew)
        clock_b.now = 8.1  # 3.1s after B last saw the record change
        assert await asyncio.to_thread(b.try_acquire_or_renew)
        assert not await asyncio.to_thread(a.try_acquire_or_renew)  # A sees B's fresh record
        lease = await h.get("Lease", "lora-operator")
        assert lease["spec"]["holderIdentity"] == "op-b" and lease["spec"]["leaseTransitions"] == 1
        # Two candidates that read the same version: the second write fails its resourceVersion test (422).
        late = LeaderElector(h.kube(), config, "op-c", _Clock())
        late._get = lambda: lease  # type: ignore[method-assign]  # read before B's next renewal
        assert await asyncio.to_thread(b.try_acquire_or_renew)
        late.clock.now = 10.0
        assert await asyncio.to_thread(late.try_acquire_or_renew) is False  # it saw the copy expire, but lost the write
        assert (await h.get("Lease", "lora-operator"))["spec"]["holderIdentity"] == "op-b"
        # A clean stop hands over at once.
        await asyncio.to_thread(b.release)
        assert await asyncio.to_thread(a.try_acquire_or_renew)
        assert h.server_errors() == []


async def _scrape(session: aiohttp.ClientSession, port: int) -> str | None:
    try:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
            return await r.text()
    except aiohttp.ClientError:
        return None


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_the_standby_takes_over_when_the_leader_is_killed(tmp_path):
    async with Harness() as h:
        settings = tmp_path / "settings.yaml"
        settings.write_text(yaml.safe_dump({"progressPollSeconds": 1, "leaderElection": LEASE}))
        ports = {name: (free_port(), free_port()) for name in ("op-a", "op-b")}
        procs = {name: h.operator_process(tmp_path, ["--settings", str(settings), "--liveness", f"http://127.0.0.1:{health}/healthz",
                                                     "--metrics-port", str(metrics)], tmp_path / f"{name}.log", POD_NAME=name)
                 for name, (health, metrics) in ports.items()}
        logs = {name: (tmp_path / f"{name}.log") for name in ports}
        try:
            async with aiohttp.ClientSession() as session:
                alive = set(procs)

                async def one_leader() -> dict[str, bool] | None:
                    """{replica: leads} from each live replica's /metrics, once exactly one leads."""
                    for name in alive:
                        assert procs[name].poll() is None, logs[name].read_text()
                    texts = {n: await _scrape(session, ports[n][1]) for n in alive}
                    if None in texts.values():
                        return None
                    state = {n: "lora_operator_leader 1.0" in str(t) for n, t in texts.items()}
                    return state if sum(state.values()) == 1 else None

                state = await h.wait_for(one_leader, timeout=60, what="exactly one leader")
                leader = next(n for n, leads in state.items() if leads)
                standby = next(n for n in procs if n != leader)
                lease = await h.get("Lease", "lora-operator")
                assert lease["spec"]["holderIdentity"] == leader
                # The standby answers its liveness probe too (else the kubelet would restart it for ever).
                async with session.get(f"http://127.0.0.1:{ports[standby][0]}/healthz") as r:
                    assert r.status == 200

                await h.create(lft("ha-1", output="gs://runs-bucket/ha-1"))
                first = await h.wait_for(lambda: h.get("JobSet", "ha-1"), what="JobSet of ha-1")
                await h.wait_for(lambda: asyncio.sleep(0, "Handler 'reconcile' succeeded" in logs[leader].read_text()),
                                 what="the leader's reconcile")
                assert "Handler '" not in logs[standby].read_text()  # the standby ran no handler at all

                procs[leader].send_signal(signal.SIGKILL)
                await asyncio.to_thread(procs[leader].wait, 10)
                alive.discard(leader)
                await h.create(lft("ha-2", output="gs://runs-bucket/ha-2"))
                await h.wait_for(one_leader, timeout=30, what="the standby leading")
                await h.wait_for(lambda: h.get("JobSet", "ha-2"), timeout=30, what="JobSet of ha-2 from the new leader")
                await h.wait_for_status("LoraFinetune", "ha-1", lambda s: s.get("phase") == "Pending")
                await asyncio.sleep(2)  # the new leader's resume and resync passes over ha-1 have run
                assert (await h.get("Lease", "lora-operator"))["spec"]["holderIdentity"] == standby
                assert sorted(js["metadata"]["name"] for js in await h.list("JobSet")) == ["ha-1", "ha-2"]
                assert (await h.get("JobSet", "ha-1"))["metadata"]["uid"] == first["metadata"]["uid"]
                assert sorted(cm["metadata"]["name"] for cm in await h.list("ConfigMap")) == ["ha-1-config", "ha-2-config"]
                assert "Handler 'reconcile' succeeded" in logs[standby].read_text()
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs.values():
                await asyncio.to_thread(proc.wait, 30)
        assert procs[standby].returncode == 0, logs[standby].read_text()
        assert h.server_errors() == []
