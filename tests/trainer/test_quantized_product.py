"""QLoRA's frozen product: Qwix's values and activation gradients, with a backward that dequantizes again."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwix._src.core import dot_general as qwix_dot_general
from qwix._src.core import einsum as qwix_einsum
from qwix._src.core import qarray

from lora_trainer import quantized_product
from lora_trainer.lora_provider import LoraProvider

LINEAR = (((1,), (0,)), ((), ()))  # x [tokens, in] . W [in, out], as nnx.Linear


def _weight(qtype: str, shape: tuple[int, ...] = (256, 128), tiled: dict[int, int] | None = None) -> qarray.QArray:
    how = qarray.HowToQuantize(qtype=qtype, channelwise_axes=[len(shape) - 1], tiled_axes=tiled or {0: 64},
                               calibration_method="absmax")
    return qarray.quantize(jax.random.normal(jax.random.key(0), shape, jnp.bfloat16), how)


def _x(shape: tuple[int, ...] = (8, 256)) -> jax.Array:
    return jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)


def _loss(dot: Callable[..., jax.Array]) -> Callable[[jax.Array, qarray.QArray], jax.Array]:
    return lambda x, w: jnp.tanh(dot(x, w, LINEAR).astype(jnp.float32)).sum()


@pytest.mark.parametrize("qtype", ["nf4", "int4", "int8"])
def test_values_and_activation_gradient_are_qwix_exactly(qtype: str) -> None:
    w, x = _weight(qtype), _x()
    np.testing.assert_array_equal(quantized_product.dot_general(x, w, LINEAR), qwix_dot_general.dot_general(x, w, LINEAR))
    ours = jax.jit(jax.grad(_loss(quantized_product.dot_general)))(x, w)
    theirs = jax.jit(jax.grad(_loss(qwix_dot_general.dot_general)))(x, w)
    assert float(jnp.abs(theirs).max()) > 0
    np.testing.assert_array_equal(ours, theirs)


def test_einsum_goes_through_the_frozen_product() -> None:
    """The attention projections are Einsums (q_proj-like here): same values and gradients as Qwix's einsum."""
    w, x = _weight("nf4", (256, 4, 32)), _x((2, 8, 256))
    spec = "BTD,DNH->BTNH"
    np.testing.assert_array_equal(quantized_product.einsum(spec, x, w), qwix_einsum.einsum(spec, x, w))

    def loss(einsum: Callable[..., jax.Array]) -> Callable[[jax.Array, qarray.QArray], jax.Array]:
        return lambda x, w: jnp.tanh(einsum(spec, x, w).astype(jnp.float32)).sum()

    np.testing.assert_array_equal(jax.grad(loss(quantized_product.einsum))(x, w), jax.grad(loss(qwix_einsum.einsum))(x, w))
    assert _dequantizations(jax.jit(jax.grad(loss(quantized_product.einsum))).lower(x, w).as_text()) == 2


def test_the_frozen_weight_gets_no_gradient() -> None:
    w, x = _weight("int8"), _x()
    dw = jax.grad(_loss(quantized_product.dot_general), argnums=1, allow_int=True)(x, w)
    assert dw.qvalue.dtype == jax.dtypes.float0
    assert not np.asarray(dw.scale).any()


def _dequantizations(stablehlo: str) -> int:
    """nf4 decodings in a lowered program: Qwix's gathers from the 16-entry table, or our select trees
    (each names the table's second entry, -0.6961928, once: in its first select)."""
    return len(re.findall(r"stablehlo\.gather.*tensor<16xf32>", stablehlo)) + len(re.findall(r"dense<-0\.6961928\d*>", stablehlo))


def test_the_backward_dequantizes_again_once_the_cotangent_exists() -> None:
    """Qwix's product has one dequantization that the forward and backward share (XLA then keeps the
    dequantized weight alive from one to the other, every layer's at once); ours has a second one, in
    the backward, behind an optimization barrier that also carries the cotangent."""
    w, x = _weight("nf4"), _x()
    theirs = jax.jit(jax.grad(_loss(qwix_dot_general.dot_general))).lower(x, w).as_text()
    ours = jax.jit(jax.grad(_loss(quantized_product.dot_general))).lower(x, w).as_text()
    assert _dequantizations(theirs) == 1
    assert _dequantizations(ours) == 2
    cotangent = "tensor<8x128xbf16>"  # g: the product's output
    barriers = [line for line in ours.splitlines() if "stablehlo.optimization_barrier" in line]
    assert any("tensor<256x128xui4>" in b and cotangent in b for b in barriers), barriers


def test_unquantized_operands_keep_qwix_path() -> None:
    """Only a float x against a quantized weight takes the frozen product; anything else is Qwix's call as is."""
    x, y = _x((8, 256)), jax.random.normal(jax.random.key(2), (256, 128), jnp.bfloat16)
    np.testing.assert_array_equal(quantized_product.dot_general(x, y, LINEAR), qwix_dot_general.dot_general(x, y, LINEAR))


def test_the_lora_provider_uses_it() -> None:
    provider: Any = LoraProvider(module_path=".*", rank=4, alpha=8.0, weight_qtype="nf4", tile_size=64)
    assert provider._dot_general_fn is quantized_product.dot_general
    assert provider._einsum_fn is quantized_product.einsum


def test_nf4_decoding_by_selects_equals_qwixs_table_bit_for_bit() -> None:
    """Every one of the 16 codes, and a random weight's codes, decode to Qwix's float32 table entries."""
    codes = jnp.arange(16, dtype=jnp.uint8).astype(jnp.uint4)
    np.testing.assert_array_equal(np.asarray(quantized_product.nf4_to_fp(codes)), np.asarray(quantized_product.QWIX_NF4_TO_FP(codes)))
    many = jax.random.randint(jax.random.key(0), (64, 48), 0, 16).astype(jnp.uint4)
    got, want = quantized_product.nf4_to_fp(many), quantized_product.QWIX_NF4_TO_FP(many)
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Qwix's decoding of a QArray goes through it once this module is imported.
    from qwix._src.core import numerics

    assert numerics.nf4_to_fp is quantized_product.nf4_to_fp
