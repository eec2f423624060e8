"""`zerojax.adapt.row_mixing`: which traced functions of a batch of rows may mix them, from the jaxpr
alone: every row-mixing form found, no row-separable layer flagged (each flag costs a compile)."""

import jax
import jax.numpy as jnp
import pytest

from zerojax.adapt.model_rows import TRACED_ROWS as ROWS
from zerojax.adapt.row_mixing import may_mix_rows

X = jax.ShapeDtypeStruct((ROWS, 3), jnp.float32)
TOKENS = jax.ShapeDtypeStruct((ROWS, 8, 3), jnp.float32)
W = jax.ShapeDtypeStruct((3, 5), jnp.float32)

MIXING = {
    "batch mean": (lambda x, w: x - x.mean(0), X),
    "sort over rows": (lambda x, w: jnp.sort(x, 0), X),
    "cumsum over rows": (lambda x, w: jnp.cumsum(x, 0), X),
    "roll": (lambda x, w: jnp.roll(x, 1, 0), X),
    "interleaving reshape": (lambda x, w: x.reshape(3, ROWS), X),
    "reversed rows": (lambda x, w: x[::-1], X),
    "gram matrix": (lambda x, w: x @ x.T, X),
    "pairwise broadcast": (lambda x, w: x[:, None, 0] - x[None, :, 0], X),
    "branch on the batch": (lambda x, w: jax.lax.cond(x.mean() > 0, lambda: x, lambda: -x), X),
    "scan over rows": (lambda x, w: jax.lax.scan(lambda c, r: (c + r, c), jnp.zeros(3), x)[1], X),
    "first row": (lambda x, w: x * x[0], X),
    "tokens pooled over the batch": (lambda x, w: (x.reshape(-1, 3) @ w).max(0), TOKENS),
    "segment sum": (lambda x, w: jax.ops.segment_sum(x, (x[:, 0] > 0).astype(jnp.int32), 2), X),
    "one row by index": (lambda x, w: x - jax.lax.dynamic_index_in_dim(x, 0, 0), X),
    "fft over rows": (lambda x, w: jnp.fft.fft(x, axis=0).real, X),
    "linear solve": (lambda x, w: jax.lax.custom_linear_solve(lambda v: v - v.mean(0), x, lambda f, b: b), X),
}
SEPARATE = {
    "dense": (lambda x, w: jax.nn.relu(x @ w), X),
    "layer norm": (lambda x, w: (x - x.mean(-1, keepdims=True)) / x.std(-1, keepdims=True), X),
    "tokens merged and split": (lambda x, w: (x.reshape(-1, 3) @ w).reshape(ROWS, 8, 5).mean(1), TOKENS),
    "attention": (lambda x, w: jax.nn.dot_product_attention(x[:, :, None], x[:, :, None], x[:, :, None]), TOKENS),
    "vmap": (lambda x, w: jax.vmap(lambda r: r @ w)(x), X),
    "scan over layers": (
        lambda x, w: jax.lax.scan(lambda c, _: (jnp.tanh(c @ w[:, :3]), None), x, None, length=3)[0],
        X,
    ),
    "checkpoint": (lambda x, w: jax.checkpoint(lambda x: jnp.sin(x) @ w)(x), X),
    "embedding": (lambda x, w: jnp.take(w, (x[..., 0] > 0).astype(jnp.int32), axis=0), X),
}


@pytest.mark.parametrize("name", [*MIXING, *SEPARATE])
def test_mixing_forms_are_found_and_row_separable_layers_are_not(name):
    fn, rows = {**MIXING, **SEPARATE}[name]
    assert may_mix_rows(jax.make_jaxpr(fn)(rows, W).jaxpr, ROWS) == (name in MIXING)
