"""Qwix's LoRA provider with a hand-ordered backward for the low-rank path.

Why this exists (docs/benchmarks.md, "Trainer: findings"): with Qwix's own provider the
LoRA delta `(x @ A) @ B * alpha/r` is differentiated by JAX's generic transpose rules, which
put the big activation gradient `g` ([tokens, out]) first in the dot that forms `dB`. XLA's
CPU backend then materialises a transposed copy of `g` for every adapted projection (on the
benchmark model, eight 1408 x 2048 copies per step: 13% of the step), and the LoRA step cost
as much as a full fine-tune. `lora_delta` states the backward explicitly, with the small
rank-r operand first in every dot, so only rank-sized tensors are ever transposed; the
alpha/r scale is applied to the rank-r intermediate rather than to the output.

For a float32 base the math is exactly Qwix's (same params, shapes, initialisers, dropout,
quantized base path); `tests/trainer/test_lora_provider.py` checks loss and gradients against
`qwix.LoraProvider` on every family's projections. A bfloat16 base differs on purpose: it stays
bfloat16 and runs on XLA:CPU's native bf16 dots (`LoraProvider`; tested against the float32
model and on the compiled HLO). The two methods below follow Qwix 0.1.8's
`LoraProvider.einsum` / `dot_general` except where the frozen product and the delta are computed.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import string
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.interpreters import pxla
from qwix._src.core import qarray
from qwix._src.providers import lora as qwix_lora
from qwix._src.providers import ptq
from qwix._src.utils import flax_util

from lora_trainer import accumulating_dot, fused_delta, quantized_product
from lora_trainer.accumulating_dot import contract
from lora_trainer.models.remat import PRODUCTS


class _Subscripts(NamedTuple):
    """Einsum subscripts of the low-rank path: x, A, B, output and the rank-r intermediate h."""

    x: str
    a: str
    b: str
    out: str
    h: str


@functools.lru_cache(maxsize=None)
def _subscripts(spec: str) -> _Subscripts | None:
    """Split `"x,a,b->out"` and derive h (x's kept letters, then A's rank letter); None if unusual.

    The backward below is valid when every output letter comes from x or B and the rank is
    the one letter A and B share that neither x nor the output has (Qwix's specs all look so).
    """
    inputs, out = spec.replace(" ", "").split("->")
    parts = inputs.split(",")
    if len(parts) != 3:
        return None
    x, a, b = parts
    rank = [c for c in a if c in b and c not in x and c not in out]
    if len(rank) != 1 or any(c not in x + b for c in out) or any(c not in x + b for c in a):
        return None
    h = "".join(c for c in x if c in out + b) + rank[0]
    return _Subscripts(x, a, b, out, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def lora_delta(spec: str, x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """`einsum(spec, x, a, b) * scale` for a LoRA spec `"x,a,b->out"`, with a layout-friendly backward.

    Mixed precision as `torch.autocast` does it: the LoRA params stay float32 (the optimizer's
    master copy) and are rounded to a 16-bit activation's dtype where they meet activation-sized
    operands; every product accumulates in float32 and the delta is float32. The weight
    gradients are formed from the same 16-bit operands, accumulated in float32 and kept
    float32 (autocast rounds them to 16 bits as well). With float32 activations nothing is rounded.
    """
    return _forward(spec, x, a, b, scale)[0]


def _compute_dtype(x: jax.Array) -> Any:
    """The dtype LoRA factors are rounded to before meeting activation `x`: its own if 16-bit, else float32."""
    return x.dtype if accumulating_dot.is_low_precision(x) else jnp.float32


def _forward(spec: str, x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    s = _subscripts(spec)
    assert s is not None, spec
    lo = _compute_dtype(x)
    h = contract(s.x, s.a, s.h, x, a.astype(lo)) * scale
    return contract(s.h, s.b, s.out, h.astype(lo), b.astype(lo)), h


def _lora_delta_fwd(spec: str, x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> tuple[jax.Array, tuple]:
    out, h = _forward(spec, x, a, b, scale)
    return out, (x, a, b, h)


def _lora_delta_bwd(spec: str, scale: float, res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients with the rank-r operand first in each dot, so XLA transposes only small tensors."""
    x, a, b, h = res
    s = _subscripts(spec)
    lo = _compute_dtype(x)
    g = g.astype(lo)
    gh = (contract(s.out, s.b, s.h, g, b.astype(lo)) * scale).astype(lo)
    dx = contract(s.h, s.a, s.x, gh, a.astype(lo))
    db = contract(s.h, s.out, s.b, h.astype(lo), g)
    # dA is formed rank axis first and fenced before it is transposed to A's layout: unfenced, XLA
    # folds the transpose into the dot by swapping its operands (x first), a form XLA:CPU's 16-bit
    # kernels lack (the step fails to run).
    rank = s.h[-1]
    da_sub = rank + s.a.replace(rank, "")
    da = contract(s.h, s.x, da_sub, gh, x)
    da = jnp.transpose(jax.lax.optimization_barrier(da), [da_sub.index(c) for c in s.a])
    return dx.astype(x.dtype), da.astype(a.dtype), db.astype(b.dtype)


lora_delta.defvjp(_lora_delta_fwd, _lora_delta_bwd)


def dot_general_spec(lhs_ndim: int, lhs_ca: Sequence[int], lhs_ba: Sequence[int], n_remain: int) -> str:
    """The einsum spec of Qwix's dot_general LoRA delta `"x,a,b->out"`.

    Qwix reshapes A to (*batch, *contract, r) and B to (*batch, r, *remain); the delta has
    dot_general's output order (batch, lhs free, remain).
    """
    letters = iter(string.ascii_letters)
    x = [next(letters) for _ in range(lhs_ndim)]
    batch = "".join(x[i] for i in lhs_ba)
    contracted = "".join(x[i] for i in lhs_ca)
    free = "".join(c for i, c in enumerate(x) if i not in lhs_ca and i not in lhs_ba)
    rank = next(letters)
    remain = "".join(next(letters) for _ in range(n_remain))
    return f"{''.join(x)},{batch}{contracted}{rank},{batch}{rank}{remain}->{batch}{free}{remain}"


#: True while a function is traced that must not drop out (evaluation). Read at trace time.
_DROPOUT_OFF = contextvars.ContextVar("lora_dropout_off", default=False)


@contextlib.contextmanager
def no_lora_dropout() -> Iterator[None]:
    """Trace the model without LoRA dropout (Qwix itself applies it on every call, eval included)."""
    token = _DROPOUT_OFF.set(True)
    try:
        yield
    finally:
        _DROPOUT_OFF.reset(token)


def _dropout(lhs: jax.Array, rate: float) -> jax.Array:
    """Qwix's LoRA dropout (keys from the module's `qwix_rngs`), skipped under `no_lora_dropout`."""
    if rate <= 0 or _DROPOUT_OFF.get():
        return lhs
    return nnx.Dropout(rate, deterministic=False)(lhs, rngs=flax_util.make_rng("dropout"))


def _lora_params(
    rule: qwix.LoraRule, weight_name: str, a_shape: Any, a_transpose: Any, b_shape: Any, b_transpose: Any
) -> tuple[jax.Array, jax.Array]:
    """The module's LoRA A and B for `weight_name` (Qwix creates them on the first call)."""
    return qwix_lora._get_or_create_lora_params(
        name=weight_name,
        rule=rule,
        a_shape=a_shape,
        b_shape=b_shape,
        a_sharding_transpose=a_transpose,
        b_sharding_transpose=b_transpose,
    )


def _sums_before_rounding(rule: Any, lhs: Any, rhs: Any, preferred_element_type: Any) -> bool:
    """True when a LoRA delta is added to this unquantized product of a 16-bit model: then the product
    stays float32 until the delta is added, and the sum is rounded once (PEFT rounds the product first)."""
    return rule.weight_qtype is None and preferred_element_type is None and accumulating_dot.is_low_precision(lhs, rhs)


def _weight_name(rule: Any, rhs: Any) -> str | None:
    """The name of the weight a LoRA rule adapts in this product; None when there is no rule or rhs is no weight."""
    return flax_util.find_param(rhs, ptq.WithAux) if isinstance(rule, qwix.LoraRule) else None


def _adapted(total: jax.Array, dtype: Any) -> jax.Array:
    """An adapted projection's output (frozen product + delta) in `dtype`, tagged for `training.remat: dots`.

    The frozen product and the delta come from custom_vjp functions, which a remat policy cannot
    see into: tagged, the rounded sum is kept (what a plain model keeps of the same projection),
    and neither the float32 parts nor the matmuls behind them are saved or recomputed.
    """
    return checkpoint_name(total.astype(dtype), PRODUCTS)


class _CompiledQuantize:
    """Qwix's `qarray` module, with `quantize` compiled once per way of quantizing and shape.

    Why: Qwix quantizes each QLoRA weight once, during `apply_lora`'s dummy forward, which runs
    op by op; on CPU a Llama-3.2-1B-shaped model spent 79 s there under nf4, silently (real-size
    audit), about 6x the compiled function's time. The values are bitwise the same.

    A weight staged on the host (`load_model(on_host=True)`) while the run has accelerators is
    quantized on the first of them and its quantized form brought back: one weight's 16 bits at
    a time are ever on the chip, and the host's CPU (about 20 s for an 8B model's nf4 with 13
    cores) is not needed.
    """

    def __init__(self) -> None:
        self._compiled: dict[tuple[Any, ...], Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(qarray, name)

    def quantize(self, array: jax.Array, how: qarray.HowToQuantize) -> qarray.QArray:
        if how.noise_fn is not None:  # stochastic rounding: leave it to Qwix as is
            return qarray.quantize(array, how)
        key = (str(how.qtype), tuple(how.channelwise_axes), tuple(sorted(how.tiled_axes.items())), how.calibration_method)
        if key not in self._compiled:
            self._compiled[key] = jax.jit(functools.partial(qarray.quantize, how=how))
        home, accelerator = next(iter(array.devices())), jax.devices()[0]
        if home.platform == "cpu" and accelerator.platform != "cpu" and len(array.devices()) == 1:
            return jax.device_put(self._compiled[key](jax.device_put(array, accelerator)), home)
        return self._compiled[key](array)


class LoraProvider(qwix.LoraProvider):
    """`qwix.LoraProvider` whose low-rank path goes through `lora_delta`.

    Two more differences from Qwix, both about 16-bit (bfloat16) base models: every frozen
    product the model makes (projections, attention, LM head) goes through
    `accumulating_dot.dot_general`, so XLA's CPU backend runs it natively in bfloat16 instead
    of upcasting both operands; and the adapted projection's output keeps the base's dtype
    (as PEFT casts it back), where Qwix's `bf16 + float32 delta` silently turned every later
    activation of the model into float32. The adapted product and its delta are summed in
    float32 and rounded once. QLoRA's one-time weight quantization is compiled (`_CompiledQuantize`),
    and its frozen products dequantize the weight again in the backward pass rather than keep the
    forward's (`quantized_product`). On TPU an unquantized 16-bit projection and its delta are one
    product (`fused_delta`) where their shapes allow.
    """

    #: Whether an unquantized 16-bit projection and its delta are one product (`fused_delta`); None: on TPU,
    #: decided when the model is traced. The CPU keeps two (its tests and golden logits are of that form).
    fuses_delta: bool | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._qarray_module = _CompiledQuantize()
        self._dot_general_fn = quantized_product.dot_general
        self._einsum_fn = quantized_product.einsum

    def dot_general(
        self,
        lhs: jax.Array,
        rhs: Any,
        dimension_numbers: jax.lax.DotDimensionNumbers,
        precision: jax.lax.PrecisionLike = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        """The frozen (possibly quantized) product plus the LoRA delta (Qwix's shapes and params)."""
        rule, _ = self._get_current_rule_and_op_id("dot_general", only_rule=True)
        weight_name = _weight_name(rule, rhs)
        wide = weight_name is not None and _sums_before_rounding(rule, lhs, rhs, preferred_element_type)
        fuses = out_sharding is None and self._fuses(rule, wide)
        contracted = fused_delta.canonical_dot_general(lhs.ndim, rhs.ndim, dimension_numbers) if fuses else None
        if contracted is not None:
            self._get_current_rule_and_op_id("dot_general")  # Qwix's per-module op count, as its own call keeps it
            a, b = self._factors(rule, weight_name, rhs, dimension_numbers)
            return _adapted(fused_delta.product(lhs, rhs, a, b, rule.alpha / rule.rank, contracted), lhs.dtype)
        if rule is None or rule.weight_qtype is None:  # what Qwix does unquantized, with a 16-bit fast path
            self._get_current_rule_and_op_id("dot_general")  # Qwix's per-module op count, as its own call keeps it
            res = accumulating_dot.dot_general(
                lhs, rhs, dimension_numbers, precision, jnp.float32 if wide else preferred_element_type, out_sharding
            )
        else:
            res = ptq.PtqProvider.dot_general(
                self, lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding=out_sharding
            )
        if weight_name is None:  # no LoRA rule here, or rhs is not a weight
            return res
        out_dtype = lhs.dtype if wide else res.dtype
        (lhs_ca, _), (lhs_ba, _) = dimension_numbers
        a, b = self._factors(rule, weight_name, rhs, dimension_numbers)
        lhs = _dropout(lhs, rule.dropout)
        spec = dot_general_spec(lhs.ndim, lhs_ca, lhs_ba, b.ndim - len(lhs_ba) - 1)
        return _adapted(res + lora_delta(spec, lhs, a, b, rule.alpha / rule.rank), out_dtype)

    def _fuses(self, rule: Any, wide: bool) -> bool:
        """Whether this product and its delta may be one (`fused_delta`): on TPU without tensor parallelism
        (`fused_delta.allowed_on`), an unquantized 16-bit projection without LoRA dropout (dropout feeds
        the delta an input the frozen product does not see)."""
        if self.fuses_delta is None:
            mesh = pxla.thread_resources.env.physical_mesh  # the run's, as the step is traced under it (`train`)
            fuses = jax.default_backend() == "tpu" and (mesh.empty or fused_delta.allowed_on(dict(mesh.shape)))
        else:
            fuses = self.fuses_delta
        return fuses and wide and rule.weight_qtype is None and rule.dropout == 0

    def _factors(
        self, rule: Any, weight_name: str, rhs: Any, dimension_numbers: jax.lax.DotDimensionNumbers
    ) -> tuple[jax.Array, jax.Array]:
        """The LoRA A and B of a dot_general's weight `rhs` (Qwix's params), shaped (*batch, *contract, r)
        and (*batch, r, *remain) as `dot_general_spec`'s delta takes them."""
        (_, rhs_ca), (_, rhs_ba) = dimension_numbers
        rhs_ra = tuple(i for i in range(rhs.ndim) if i not in rhs_ca and i not in rhs_ba)
        contract_shape = tuple(rhs.shape[i] for i in rhs_ca)
        batch_shape = tuple(rhs.shape[i] for i in rhs_ba)
        remain_shape = tuple(rhs.shape[i] for i in rhs_ra)
        a_shape, a_transpose, b_shape, b_transpose = qwix_lora._create_lora_layer_shapes(
            rhs_ca, rhs_ba, rhs_ra, contract_shape, batch_shape, remain_shape, rule.rank
        )
        lora_a, lora_b = _lora_params(rule, weight_name, a_shape, a_transpose, b_shape, b_transpose)
        a = jnp.reshape(lora_a, (*batch_shape, *contract_shape, rule.rank))
        b = jnp.reshape(lora_b, (*batch_shape, rule.rank, *remain_shape))
        return a, b

    def einsum(self, einsum_str: str, *operands: Any, **kwargs: Any) -> jax.Array:
        """The frozen (possibly quantized) einsum plus the LoRA delta (Qwix's shapes and params)."""
        rule, _ = self._get_current_rule_and_op_id("einsum", only_rule=True)
        if isinstance(rule, qwix.LoraRule) and len(operands) != 2:
            raise ValueError(f"Unsupported einsum format for LoRA: {einsum_str=}")
        weight_name = _weight_name(rule, operands[-1])
        wide = weight_name is not None and _sums_before_rounding(rule, *operands, kwargs.get("preferred_element_type"))
        if weight_name is not None:
            lhs, rhs = operands
            a_shape, b_shape, lora_spec, a_transpose, b_transpose = qwix_lora._parse_einsum_str_for_lora(
                lhs.shape, rhs.shape, einsum_str, rule.rank
            )
            setattr(flax_util.get_current_module(), weight_name + "_lora_einsum_str", lora_spec)
            lora_a, lora_b = _lora_params(rule, weight_name, a_shape, a_transpose, b_shape, b_transpose)
            fuses = not kwargs and self._fuses(rule, wide)
            contracted = fused_delta.canonical_einsum(einsum_str, lora_spec) if fuses else None
            if contracted is not None:
                self._get_current_rule_and_op_id("einsum")  # Qwix's per-module op count, as its own call keeps it
                return _adapted(fused_delta.product(lhs, rhs, lora_a, lora_b, rule.alpha / rule.rank, contracted), lhs.dtype)
        frozen = dict(kwargs)
        if wide:
            frozen["preferred_element_type"] = jnp.float32
        if "_dot_general" not in frozen and accumulating_dot.is_low_precision(*operands):
            frozen["_dot_general"] = accumulating_dot.dot_general  # Qwix passes it on when it does not quantize
        res = ptq.PtqProvider.einsum(self, einsum_str, *operands, **frozen)
        if weight_name is None:  # no LoRA rule here, or rhs is not a weight
            return res
        out_dtype = lhs.dtype if wide else res.dtype
        lhs = _dropout(lhs, rule.dropout)
        scale = rule.alpha / rule.rank
        if kwargs or _subscripts(lora_spec) is None:  # a form the explicit backward does not cover
            delta = jnp.einsum(lora_spec, lhs, lora_a, lora_b, **kwargs) * scale
        else:
            delta = lora_delta(lora_spec, lhs, lora_a, lora_b, scale)
        return _adapted(res + delta, out_dtype)
