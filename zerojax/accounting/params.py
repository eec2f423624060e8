"""Parameter counts for the planner: one tensor-parallel slice, and the shipped GPT's abstract init
(the one count of a tree is `zerojax.core.trees.count_params`)."""

from __future__ import annotations

import math

from zerojax.core.trees import count_params


def tensor_local_params(layouts) -> int:
    """Elements of one tensor-parallel slice of one pipeline stage of the model: each leaf split over
    `tensor` counts 1/tensor of its elements, each stacked leaf split over `pipeline` 1/pipeline. FSDP
    shards this slice (`LeafLayout`s in, as `count_params`)."""
    import jax

    leaves = jax.tree.leaves(layouts, is_leaf=lambda x: hasattr(x, "tensor_axis"))
    return int(sum(math.prod(l.shape) // l.model_split for l in leaves))


def gpt_param_shapes(gpt):
    """The shipped GPT's abstract params for config `gpt`, from `jax.eval_shape` of its init:
    nothing is allocated."""
    import functools

    import jax
    import jax.numpy as jnp

    from zerojax.adapt.model import functional, param_shapes
    from zerojax.models.gpt import GPT

    inputs = jax.ShapeDtypeStruct((1, gpt.seq_len), jnp.int32)
    return param_shapes(functional(functools.partial(GPT, gpt)), jax.random.key(0), inputs)


def gpt_params(gpt) -> int:
    """Parameters of the shipped GPT with config `gpt` (`gpt_param_shapes`)."""
    return count_params(gpt_param_shapes(gpt))


def selected_params(shapes, trainable: str | None) -> int | None:
    """The parameters a `train.trainable` regex selects of the abstract `shapes`; None: all of them."""
    import jax

    from zerojax.core.trainable import select

    mask = select(trainable, shapes) if trainable is not None else None
    if mask is None:
        return None
    return count_params([s for s, t in zip(jax.tree.leaves(shapes), jax.tree.leaves(mask)) if t])
