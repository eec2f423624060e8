"""Parameter trees: one spelling of a path ("blocks/0/kernel") for every key path, whether a path lies
under one of a model's layer stacks, a partial tree filled in, and the one parameter count."""

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
