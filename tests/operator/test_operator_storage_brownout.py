"""A GCS brownout (the bucket accepts connections and answers nothing) must not starve the operator:
`lora-operator run` as a real process reading 24 running runs' progress.json from such a bucket
still creates a new run's JobSet at once, records a finished run, and stops on SIGTERM within
seconds (issue 22: a new CR waited 118 s for its JobSet and a graceful stop did not finish in 30 s,
the reads holding every thread of kopf's pool). Budget: about 15 s.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
from k8s_harness import Harness
from test_operator_e2e import _phase, lft

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

RUNS = 24


async def test_a_stalled_bucket_delays_no_new_run_no_finished_run_and_no_stop(tmp_path: Path):
    # The kernel completes the TCP handshakes (up to the backlog); nothing ever reads or answers.
    stalled = socket.create_server(("127.0.0.1", 0), backlog=512)
    try:
        async with Harness() as h:
            bucket = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{stalled.getsockname()[1]}",
                      "GCE_METADATA_HOST": "127.0.0.1:1", "NO_GCE_CHECK": "True"}
            operator = h.process(tmp_path, {"progressPollSeconds": 0.5}, bucket)
            operator.start()
            await operator.wait_live()
            names = [f"brown-{i}" for i in range(RUNS)]
            for name in names:
                await h.create(lft(name, output=f"gs://runs-bucket/{name}"))
            for name in names:
                await h.jobset_running(name)
            for name in names:
                await h.wait_for_status("LoraFinetune", name, _phase("Running"))
            await asyncio.sleep(2)  # four ticks of every run's progress timer: every read is stuck

            await h.create(lft("late", output="gs://runs-bucket/late"))
            await h.wait_for(lambda: h.get("JobSet", "late"), timeout=10, what="the new run's JobSet during the brownout")
            await h.jobset_condition(names[0], "Completed", "AllJobsCompleted", "jobset completed successfully")
            await h.wait_for_status("LoraFinetune", names[0], _phase("Exporting"), timeout=15)

            started = time.monotonic()
            assert await operator.stop(timeout=15) == 0, operator.log.read_text()[-3000:]
            print(f"stopped {time.monotonic() - started:.1f}s after SIGTERM")
            assert "no answer from storage for gs://runs-bucket/" in operator.log.read_text()
            assert "Traceback" not in operator.log.read_text(), "the operator logged an exception (kopf logs and goes on)"
    finally:
        stalled.close()
