"""The one parameter count: elements of a pytree's leaves, and of the shipped GPT's abstract init."""

from __future__ import annotations

import math


def count_params(tree) -> int:
    """Logical elements of every leaf with a shape: arrays, `ShapeDtypeStruct`s or `LeafLayout`s
    (whose `shape` is the unpadded one)."""
    import jax

    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape") and not isinstance(x, dict))
    return int(sum(math.prod(leaf.shape) for leaf in leaves))


def tensor_local_params(layouts) -> int:
    """Elements of one tensor-parallel slice of the model: each leaf split over `tensor` counts
    1/tensor of its elements. FSDP shards this slice (`LeafLayout`s in, as `count_params`)."""
    import jax

    leaves = jax.tree.leaves(layouts, is_leaf=lambda x: hasattr(x, "tensor_axis"))
    return int(sum(math.prod(l.shape) // (l.tensor_size if l.tensor_axis is not None else 1) for l in leaves))


def gpt_params(gpt) -> int:
    """Parameters of the shipped GPT with config `gpt`, counted on `jax.eval_shape` of its init:
    nothing is allocated."""
    import functools

    import jax
    import jax.numpy as jnp

    from zerojax.adapt import functional, param_shapes
    from zerojax.models.gpt import GPT

    inputs = jax.ShapeDtypeStruct((1, gpt.seq_len), jnp.int32)
    return count_params(param_shapes(functional(functools.partial(GPT, gpt)), jax.random.key(0), inputs))
