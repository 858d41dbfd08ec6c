"""16-bit matmuls accumulate in float32 with 16-bit operands, forward and backward, and change no number.

`accumulating_dot` exists for speed (XLA's CPU backend upcasts a `bf16 x bf16 -> bf16` dot to
float32 but runs `bf16 x bf16 -> f32` natively), so these tests pin both halves: the values
are those of the float32 product of the same operands, and the compiled program really
feeds 16-bit operands to every dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trainer_fixtures import dot_operand_types

from lora_trainer import accumulating_dot

CASES = [
    # (lhs shape, rhs shape, dimension numbers): a projection, a [B,T,D] x [D,N,H] einsum-like,
    # attention's batched form and a contraction over a leading dim.
    ((6, 8), (8, 5), (((1,), (0,)), ((), ()))),
    ((2, 3, 8), (8, 2, 4), (((2,), (0,)), ((), ()))),
    ((2, 3, 4, 8), (2, 3, 8, 5), (((3,), (2,)), ((0, 1), (0, 1)))),
    ((7, 6), (7, 5), (((0,), (0,)), ((), ()))),
    # attention's grouped-query scores [b, t, k, g, d] x [b, s, k, d]: two batch dims, not leading
    ((2, 5, 3, 4, 8), (2, 6, 3, 8), (((4,), (3,)), ((0, 2), (0, 2)))),
    # and its probabilities [b, k, t, g, s] x values [b, s, k, d]
    ((2, 3, 5, 4, 6), (2, 6, 3, 8), (((4,), (1,)), ((0, 1), (0, 2)))),
]


@pytest.mark.parametrize(("ls", "rs", "dims"), CASES)
def test_subscripts_describe_the_same_product(ls: tuple[int, ...], rs: tuple[int, ...], dims: accumulating_dot.DotDims) -> None:
    x, w = jax.random.normal(jax.random.key(0), ls), jax.random.normal(jax.random.key(1), rs)
    lhs, rhs, out = accumulating_dot.subscripts(len(ls), len(rs), dims)
    np.testing.assert_allclose(jnp.einsum(f"{lhs},{rhs}->{out}", x, w), jax.lax.dot_general(x, w, dims), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("ls", "rs", "dims"), CASES)
def test_bfloat16_values_and_gradients_are_the_float32_ones_rounded(
    ls: tuple[int, ...], rs: tuple[int, ...], dims: accumulating_dot.DotDims
) -> None:
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], ls).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], rs).astype(jnp.bfloat16)

    def wide(x: jax.Array, w: jax.Array) -> jax.Array:  # the same operands, exactly, in float32
        return jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), dims)

    out, vjp = jax.vjp(lambda x, w: accumulating_dot.dot_general(x, w, dims), x, w)
    ref, ref_vjp = jax.vjp(wide, x, w)
    g = jax.random.normal(keys[2], out.shape).astype(jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    # Summation order may differ from the float32 reference's, so a value on a rounding boundary
    # may round the other way: one bfloat16 step apart at most, and rarely (rounding toward zero,
    # or rounding twice, would miss about half the values).
    for got, want in ((out, ref), *zip(vjp(g), ref_vjp(g.astype(jnp.float32)), strict=True)):
        assert got.dtype == jnp.bfloat16
        steps = _steps(got, want)
        assert steps.max() <= 1 and (steps == 0).mean() >= 0.9, (steps.max(), (steps == 0).mean())


def _steps(got: jax.Array, want: jax.Array) -> np.ndarray:
    """How many bfloat16 steps each value of `got` is from `want` rounded to bfloat16."""
    def ordered(a: jax.Array) -> np.ndarray:  # bit patterns as integers that count steps across zero too
        bits = np.asarray(a.astype(jnp.bfloat16)).view(np.int16).astype(np.int32)
        return np.where(bits < 0, -(bits & 0x7FFF), bits)

    return np.abs(ordered(got) - ordered(want))


def test_float32_is_passed_through_unchanged() -> None:
    x, w = jax.random.normal(jax.random.key(0), (6, 8)), jax.random.normal(jax.random.key(1), (8, 5))
    dims = (((1,), (0,)), ((), ()))
    assert not accumulating_dot.is_low_precision(x, w)
    np.testing.assert_array_equal(accumulating_dot.dot_general(x, w, dims), jax.lax.dot_general(x, w, dims))
    assert not accumulating_dot.is_low_precision(x.astype(jnp.bfloat16), w)  # mixed: promoted as JAX does


def test_compiled_forward_and_backward_feed_bfloat16_to_every_dot() -> None:
    """What makes it fast on CPU: no dot of the step (activation gradient included) gets float32 operands."""
    x = jnp.ones((64, 32), jnp.bfloat16)
    w = jnp.ones((32, 48), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))

    def loss(x: jax.Array) -> jax.Array:
        return jnp.sum(accumulating_dot.dot_general(x, w, dims).astype(jnp.float32) ** 2)

    hlo = jax.jit(jax.value_and_grad(loss)).lower(x).compile().as_text()
    types = dot_operand_types(hlo)
    assert len(types) == 2, hlo  # the forward product and the input gradient (w is a constant)
    assert all(t == ("bf16", "bf16") for t in types), types


def test_a_float32_result_can_be_asked_for_unrounded() -> None:
    """The LoRA provider adds its float32 delta before rounding: the product must come back unrounded."""
    x = jax.random.normal(jax.random.key(0), (6, 8)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (8, 5)).astype(jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    out = accumulating_dot.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, jnp.float32(x) @ jnp.float32(w), rtol=1e-6, atol=1e-6)
    hlo = jax.jit(jax.grad(lambda x: jnp.sum(accumulating_dot.dot_general(x, w, dims, preferred_element_type=jnp.float32) ** 2))).lower(x)
    assert all(t == ("bf16", "bf16") for t in dot_operand_types(hlo.compile().as_text()))


@pytest.mark.parametrize(("ls", "rs", "dims"), [c for c in CASES if len(c[2][1][0]) > 1])
def test_dots_with_several_batch_dims_also_run_on_bfloat16_operands(
    ls: tuple[int, ...], rs: tuple[int, ...], dims: accumulating_dot.DotDims
) -> None:
    """XLA:CPU upcasts a 16-bit dot with two batch dims (attention's) to float32; `native_dot` merges them."""
    x, w = jnp.ones(ls, jnp.bfloat16), jnp.ones(rs, jnp.bfloat16)

    def loss(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(accumulating_dot.dot_general(x, w, dims, preferred_element_type=jnp.float32) ** 2)

    types = dot_operand_types(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text())
    assert len(types) == 3 and all(t == ("bf16", "bf16") for t in types), types
