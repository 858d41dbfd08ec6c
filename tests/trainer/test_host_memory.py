"""`host_memory.retain_freed_memory` stops XLA's per-step buffers from page-faulting afresh every call."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lora_trainer import host_memory

#: A jitted step with 64 MiB temporaries, like a training step's activations (freed when it ends).
#: Above glibc's largest dynamic mmap threshold (32 MiB), so by default each one is mmap'd afresh.
PROBE = """
import ctypes, json, resource
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: one fault per 4 KiB page, not per huge page
from lora_trainer import host_memory
applied = host_memory.retain_freed_memory()
import jax, jax.numpy as jnp
x, w1, w2 = jnp.ones((2048, 512)), jnp.ones((512, 8192)), jnp.ones((8192, 512))
f = jax.jit(lambda x, w1, w2: jnp.tanh(jnp.tanh(x @ w1) @ w2).sum())
for _ in range(2):
    f(x, w1, w2).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    f(x, w1, w2).block_until_ready()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 6
print(json.dumps({"applied": applied, "faults_per_call": faults}))
"""


def _probe(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env={**os.environ, **env}, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_buffers_are_reused_instead_of_page_faulted_again() -> None:
    """Tuned, a step never faults its temporaries in again. By default glibc hands them back to the
    kernel in most runs, but not all (how XLA's threads allocate varies: 0-53% of a temporary's pages
    per call over repeated runs here), so the default is probed until it shows the effect, up to 4 times."""
    pages = 2048 * 8192 * 4 // 4096  # one temporary
    defaults = []
    for _ in range(4):
        tuned, default = _probe(), _probe(**{host_memory.OPT_OUT_ENV: "default"})
        assert tuned["applied"] and not default["applied"]
        assert tuned["faults_per_call"] < 0.01 * pages
        defaults.append(default["faults_per_call"])
        if defaults[-1] > 0.05 * pages:
            return
    pytest.fail(f"the default allocator never page-faulted a temporary again ({defaults} faults per call): the probe sees nothing")


@pytest.mark.parametrize(
    ("platforms", "attached", "cpu"),
    [(None, False, True), (None, True, False), ("cpu", True, True), ("tpu", True, False), ("cuda,cpu", False, False), ("", False, True)],
)
def test_only_a_process_computing_on_the_cpu_is_tuned(platforms: str | None, attached: bool, cpu: bool) -> None:
    """On a TPU host the one arena only made threads queue (tokenizing took 22.5 s there instead of 6.2 s,
    issue 21): JAX_PLATFORMS decides when it is set, otherwise whether an accelerator is attached."""
    env = {} if platforms is None else {"JAX_PLATFORMS": platforms}
    assert host_memory.computes_on_cpu(env, attached) is cpu
