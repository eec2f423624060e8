"""Parameter and batch trees: one spelling of a path ("blocks/0/kernel") for every key path, whether a
path lies under one of a model's layer stacks, a partial tree filled in, the one parameter count, and
a batch's inputs (an array or any pytree of arrays, the global batch first) as shapes."""

from __future__ import annotations

import math


def path_str(path) -> str:
    """'blocks/attn/wq' from a jax key path (DictKey, GetAttrKey, SequenceKey) or a tuple of names."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr) and not isinstance(k, str | int):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def under(path: tuple, stacks) -> bool:
    """Whether a param path lies in one of the stack paths `stacks`."""
    return any(tuple(path[: len(s)]) == tuple(s) for s in stacks)


def filled(partial, full):
    """`partial` (shaped like `full`, None where a leaf is missing) with each missing leaf from `full`."""
    import jax

    return jax.tree.map(lambda f, p: f if p is None else p, full, partial)


def count_params(tree) -> int:
    """Logical elements of every leaf with a shape: arrays, `ShapeDtypeStruct`s or `LeafLayout`s
    (whose `shape` is the unpadded one)."""
    import jax

    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape") and not isinstance(x, dict))
    return int(sum(math.prod(leaf.shape) for leaf in leaves))


def abstract(tree):
    """`tree`'s arrays (host or device, any pytree) as `jax.ShapeDtypeStruct`s, without shardings."""
    import jax
    import numpy as np

    def one(x):
        x = x if hasattr(x, "dtype") else np.asarray(x)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)

    return jax.tree.map(one, tree)


def zeros(shapes):
    """Zeros shaped like `shapes` (a pytree of `jax.ShapeDtypeStruct`s)."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def batch_rows(inputs) -> int:
    """The rows of a batch's inputs: its first leaf's leading axis (`zerojax.adapt.checks.check_rows`
    checks that every leaf has them)."""
    import jax

    return jax.tree.leaves(inputs)[0].shape[0]


def describe(tree) -> str:
    """'float32[16, 12]' for an array (or its shape), else each leaf by path: "x float32[16, 12], y int32[16]"."""
    import jax
    import numpy as np

    one = lambda x: f"{np.dtype(x.dtype).name}{list(np.shape(x))}"  # noqa: E731
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return one(tree)
    return ", ".join(f"{path_str(p)} {one(x)}" for p, x in jax.tree_util.tree_flatten_with_path(tree)[0])
