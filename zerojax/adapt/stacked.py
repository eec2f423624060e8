"""`Stacked`: n copies of a block, stored with a leading layer axis and run by one `jax.lax.scan`.

    import zerojax as zj

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Linear(64, 256, rngs=rngs)
            self.blocks = zj.Stacked(Block, 12, 256, rngs=rngs)  # Block(256, rngs=...) twelve times
            self.head = nnx.Linear(256, 10, rngs=rngs)

        def __call__(self, x):
            x = self.blocks(self.embed(x))  # the 12 blocks in order; each block maps x -> x
            return self.head(x)

Each block is built by `block(*args, rngs=<this layer's rngs>, **kwargs)` under `nnx.vmap` with the
RNG streams split per layer (Flax NNX's `nnx.split_rngs` + `nnx.vmap` recipe, the same as the
shipped GPT's blocks), so every leaf of the stack has a leading axis of size n. Calling the stack
scans the blocks in order: `blocks(x, *extra)` runs `x = block_i(x, *extra)` for i = 0..n-1, where
`extra` (masks, rotary tables, ...) is passed unchanged to every block. A block may hold Dropout
(each layer draws its own masks: the RNG state is stacked and scanned) and BatchNorm (its running
statistics are stacked and updated per layer).

Why: the program holds one block's body whatever n is, so compile time stays flat in depth; and the
zerojax engines gather a `Stacked`'s weights one layer at a time inside the scan at stage 3 (the
"layers" route, `trainer.gather_report().route == "layers"`): the engine installs a layer hook for
the duration of the model's call (`hooks_installed`), the scan body runs it on each layer's stored
params, and the body is rematerialised so the backward pass gathers the layer again instead of
keeping it. A model may hold several stacks, at any depth of its module tree; a `Stacked` inside
another `Stacked`'s block is scanned as part of its outer layer.

`remat`: "full" (default) saves only each layer's input, "dots" also saves the weight matmuls'
outputs, "none" saves everything the block computes (at stage 3 that includes each layer's
gathered weights, so memory then grows with depth again), "offload" keeps what "dots" saves in host
memory (GPU and TPU only; see `zerojax.core.remat`).
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from zerojax.core import remat as remat_lib
from zerojax.core.remat import check as check_remat
from zerojax.errors import UserError

LAYERS = "layers"  # the attribute holding the stacked blocks: stack params live under <path>/layers

# id(Stacked) -> (layer hook or None, layer loop or None), set by `hooks_installed` for one call.
_ACTIVE: contextvars.ContextVar[Mapping[int, tuple]] = contextvars.ContextVar(
    "zerojax_stack_hooks", default=types.MappingProxyType({})
)


class Stacked(nnx.Module):
    """`n` copies of `block(*args, rngs=..., **kwargs)`, scanned in order when called (see the module doc)."""

    def __init__(self, block: Callable[..., nnx.Module], n: int, *args, rngs: nnx.Rngs, remat: str = "full", **kwargs):
        if not isinstance(n, int) or n < 1:
            raise UserError(f"Stacked needs a positive number of blocks, got n={n!r}.")
        check_remat(remat, "Stacked remat")
        self.n = n
        self.remat = remat

        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> nnx.Module:
            return block(*args, rngs=rngs, **kwargs)

        setattr(self, LAYERS, make(rngs))

    def __call__(self, x, *args, **kwargs):
        hook, loop = _ACTIVE.get().get(id(self), (None, None))
        layers = getattr(self, LAYERS)
        graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
        if loop is not None and not jax.tree.leaves(rest):
            # The engine's loop materialises each layer's params itself (prefetch of the next layer).
            try:
                return loop(lambda x, p: nnx.merge(graphdef, p, rest)(x, *args, **kwargs), x, params)
            except (TypeError, ValueError) as e:
                if hook is None:  # a pipeline's loop
                    _check_whole_extra(e, x, (args, kwargs))
                raise
        if loop is not None and hook is None:  # a pipeline: its loop is the only way through
            raise UserError(
                "a pipeline runs zj.Stacked's blocks in its own loop, which carries no RNG or BatchNorm "
                "state, and these blocks hold some (dropout, BatchNorm); train them without mesh.pipeline, "
                "or without dropout and BatchNorm in the blocks."
            )

        def body(x, layer):
            p, r = layer
            # FSDP: the hook gathers this layer's shards here, inside the rematerialised body, so the
            # backward pass gathers them again and the gather's transpose reduce-scatters the grads.
            if hook is not None:
                p = hook(p)
            block = nnx.merge(graphdef, p, r)
            y = block(x, *args, **kwargs)
            _check_same(x, y)
            return y, nnx.state(block, nnx.Not(nnx.Param))  # RNG counters, BatchNorm statistics

        x, rest = jax.lax.scan(remat_lib.remat(body, self.remat), x, (params, rest))
        if jax.tree.leaves(rest):
            nnx.update(layers, rest)
        return x


def _check_whole_extra(error: Exception, x, extra) -> None:
    """After a pipeline's loop failed: where an extra argument has a row per sequence (its first
    axis the input's), say that a pipeline passes it whole to every microbatch."""
    rows = getattr(x, "shape", (None,))[0]
    per_row = [a.shape for a in jax.tree.leaves(extra) if len(getattr(a, "shape", ())) > 0 and a.shape[0] == rows]
    if per_row:
        raise UserError(
            f"a pipeline passes zj.Stacked's extra arguments whole to every microbatch, and one has a row per "
            f"sequence {tuple(per_row[0])}, which it cannot split yet; train without mesh.pipeline, or pass "
            f"per-row values inside the stack's input ({type(error).__name__}: {str(error).splitlines()[0]})."
        ) from error


def _check_same(x, y) -> None:
    """A scanned block must return what it takes: same structure, shapes and dtypes."""

    def spec(tree):
        return jax.tree.structure(tree), [(jax.numpy.shape(a), jax.numpy.result_type(a)) for a in jax.tree.leaves(tree)]

    if spec(x) != spec(y):
        raise UserError(
            f"each block of a Stacked must map x to a value of the same structure, shape and dtype "
            f"(it is scanned): got {spec(x)[1]} in and {spec(y)[1]} out."
        )


def stack_paths(module: nnx.Module) -> tuple[tuple, ...]:
    """The param paths (tuples of keys, as in `nnx.to_pure_dict`) of the outermost `Stacked`s'
    layer stacks in `module`, in graph order."""
    found = [path for path, node in nnx.iter_graph(module) if isinstance(node, Stacked)]
    outer = [p for p in found if not any(q != p and p[: len(q)] == q for q in found)]
    return tuple(sorted((tuple(p) + (LAYERS,) for p in outer), key=lambda p: tuple(map(str, p))))


@contextlib.contextmanager
def hooks_installed(module: nnx.Module, hooks: Mapping[tuple, Any] | None, loops: Mapping[tuple, Any] | None = None):
    """Within the block, each outermost `Stacked` of `module` runs `hooks[its stack path]` on each
    layer's params inside its scan body, and hands its loop to `loops[its stack path]` if given."""
    hooks, loops = hooks or {}, loops or {}
    active = {}
    for path, node in nnx.iter_graph(module):
        key = tuple(path) + (LAYERS,)
        if isinstance(node, Stacked) and (key in hooks or key in loops):
            active[id(node)] = (hooks.get(key), loops.get(key))
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def at(tree, path: tuple):
    """The subtree of a nested dict at `path`."""
    for key in path:
        tree = tree[key]
    return tree
