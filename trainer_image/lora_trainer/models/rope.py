"""Rotary position embeddings as the HF config describes them, and the seam into Tunix.

Why this exists: Tunix 0.1.7's llama3 and qwen3 attention call a module-level
`apply_rope(x, positions, head_dim=...)` that always uses theta 1e6 and knows no
`rope_scaling`; a real Llama 3 (theta 500000, Llama 3.1 `llama3` scaling) then differs
from `transformers` by ~0.6 in logits. Instead of forking the attention code we route
that one call: `install_seam(module)` replaces the module's `apply_rope` with a function
that uses the `RopeSpec` of the model currently running (set by `active(spec)`, which our
model subclasses enter in `__call__`), and falls back to Tunix's own function when no spec
is active, so plain Tunix models keep their behaviour. The spec is read at trace time, so
it works under jit, grad and remat.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lora_trainer.errors import UserError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """One attention's rotary embedding: base theta plus optional HF-style scaling."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [head_dim // 2] in float32, computed as transformers does."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
        inv = (1.0 / (np.float32(self.theta) ** exponents)).astype(np.float32)
        if self.rope_type == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.rope_type == "llama3":
            return _llama3_scaled(inv, self)
        return inv


def _llama3_scaled(inv: np.ndarray, spec: RopeSpec) -> np.ndarray:
    """Llama 3.1's frequency-dependent scaling (transformers `_compute_llama3_parameters`)."""
    old_len = spec.original_max_position_embeddings
    low_freq_wavelen = old_len / spec.low_freq_factor
    high_freq_wavelen = old_len / spec.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_freq_wavelen, inv / spec.factor, inv)
    smooth = (old_len / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_from_params(params: Mapping[str, Any] | None, *, theta: float | None, where: str) -> RopeSpec:
    """A RopeSpec from an HF `rope_scaling` / `rope_parameters` dict (either spelling of the type key)."""
    params = dict(params or {})
    theta = params.get("rope_theta", theta)
    if theta is None:
        raise UserError(f"{where}: config.json has no rope_theta; add the model's rope_theta to config.json")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UserError(
            f"{where}: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
            "use a checkpoint whose config.json rope_scaling is one of those"
        )
    fields: dict[str, Any] = {"theta": float(theta), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        fields["factor"] = float(params["factor"])
    if rope_type == "llama3":
        fields["low_freq_factor"] = float(params["low_freq_factor"])
        fields["high_freq_factor"] = float(params["high_freq_factor"])
        fields["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return RopeSpec(**fields)


def hf_rope(hf_config: Mapping[str, Any], layer_type: str | None = None) -> RopeSpec:
    """The RopeSpec of a config.json: transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`.

    `layer_type` picks the entry of a per-layer-type `rope_parameters` (Gemma 3:
    `sliding_attention` / `full_attention`).
    """
    params = hf_config.get("rope_parameters")
    if params and layer_type is not None and layer_type in params:
        params = params[layer_type]
    elif params is None:
        params = hf_config.get("rope_scaling")
    return rope_from_params(params, theta=hf_config.get("rope_theta"), where="config.json")


def rotate(inputs: jax.Array, positions: jax.Array, inv_freq: np.ndarray, kv_heads: int | None = None) -> jax.Array:
    """Apply rotary embedding in HF's rotate-half layout to [B, T, N, H] inputs.

    With `kv_heads` (the heads being rotated are grouped per kv head, as attention reads them)
    on CPU, see `_rotate_grouped`. The values are the same either way (up to float32 rounding).
    """
    sin, cos = sin_cos(positions, inv_freq)
    if kv_heads is not None and jax.default_backend() == "cpu":
        return _rotate_grouped(inputs, sin, cos, kv_heads)
    return _rotated(inputs, sin[..., None, :], cos[..., None, :])


def _rotated(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """HF's `x * cos + rotate_half(x) * sin` in x's dtype, sin/cos broadcast against x's last axis."""
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rotate_grouped(inputs: jax.Array, sin: jax.Array, cos: jax.Array, kv_heads: int) -> jax.Array:
    """`rotate` of [B, T, N, H] inputs, computed on the heads as `gqa_attention`'s CPU dots read them.

    Why: XLA:CPU fuses a rotation and a transpose into one loop, and that loop runs at about half
    speed when the transpose comes last (its output scattered) rather than first (its input
    gathered) (docs/benchmarks.md, "Trainer: findings"). The attention's dots read queries as
    [B, kv, T, N/kv, H]; the forward rotates in that layout, so XLA cancels the transposes and
    writes the rotated values straight where the dots read them. Its gradient arrives in that
    layout and needs [B, T, N, H] for the projection's backward: the backward transposes first
    and rotates back (by the negative angle) after.
    """
    b, t, n, h = inputs.shape
    x = jnp.transpose(inputs.reshape(b, t, kv_heads, n // kv_heads, h), (0, 2, 1, 3, 4))
    out = _rotated(x, sin[:, None, :, None, :], cos[:, None, :, None, :])
    return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(b, t, n, h)


def _rotate_grouped_fwd(inputs: jax.Array, sin: jax.Array, cos: jax.Array, kv_heads: int) -> tuple[jax.Array, tuple]:
    return _rotate_grouped(inputs, sin, cos, kv_heads), (sin, cos)


def _rotate_grouped_bwd(kv_heads: int, res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    sin, cos = res
    dx = _rotated(g, -sin[..., None, :], cos[..., None, :])
    return dx, jnp.zeros_like(sin), jnp.zeros_like(cos)


_rotate_grouped.defvjp(_rotate_grouped_fwd, _rotate_grouped_bwd)


def sin_cos(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """sin and cos of the rotary angles `positions * inv_freq`, each [..., H/2] float32.

    On CPU the two tables are materialised before they meet the heads. Left to itself, XLA's
    CPU backend fuses sin and cos into the rotation's loop over [B, T, N, H] and so computes
    them once per head instead of once per position: on the benchmark model the rope fusions
    took ~2x the time of the rotation itself (docs/benchmarks.md, "Trainer: findings"). A
    dot is an op XLA:CPU never fuses into an elementwise loop, and `optimization_barrier` is
    dropped before fusion, so the tables pass through an exact identity product (float32, one
    nonzero term per output: bitwise the same values). Other backends get the plain tables.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    table = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    if jax.default_backend() == "cpu":
        eye = jnp.eye(table.shape[-1], dtype=table.dtype)
        table = jax.lax.dot_general(table, eye, (((table.ndim - 1,), (0,)), ((), ())), precision="highest")
    sin, cos = jnp.split(table, 2, axis=-1)
    return sin, cos


_ACTIVE: contextvars.ContextVar[RopeSpec | None] = contextvars.ContextVar("lora_trainer_rope", default=None)


@contextlib.contextmanager
def active(spec: RopeSpec) -> Iterator[None]:
    """Make `spec` the rope of every seam-routed `apply_rope` call inside the block."""
    token = _ACTIVE.set(spec)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def install_seam(module: ModuleType) -> None:
    """Route `module.apply_rope` (Tunix llama3/qwen3 signature) through the active RopeSpec. Idempotent."""
    original: Callable[..., jax.Array] = module.apply_rope
    if getattr(original, "_lora_trainer_seam", False):
        return

    def apply_rope(
        inputs: jax.Array, positions: jax.Array, head_dim: int, rope_theta: int = 1_000_000, kv_heads: int | None = None
    ) -> jax.Array:
        spec = _ACTIVE.get()
        if spec is None:
            return original(inputs, positions, head_dim=head_dim, rope_theta=rope_theta)
        return rotate(inputs, positions, spec.inv_freq(head_dim), kv_heads)

    apply_rope._lora_trainer_seam = True  # type: ignore[attr-defined]
    module.apply_rope = apply_rope


class RopeFromConfig:
    """Mixin for a Tunix model class whose `apply_rope` goes through the seam: the forward pass
    runs under the model's own RopeSpec (theta and scaling from config.json).

    Used as `class Llama3(RopeFromConfig, tunix_llama3.Llama3)`; the module must have had
    `install_seam` called on it.
    """

    def __init__(self, config: Any, *, rope_spec: RopeSpec, rngs: Any):
        super().__init__(config, rngs=rngs)  # type: ignore[call-arg]
        self.rope_spec = rope_spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with active(self.rope_spec):
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
