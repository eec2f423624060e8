"""The optimizers a config can name: one registry of the optax factory and the fp32 state it keeps.

Config validation, `build_optimizer` and the planner's memory model all read `OPTIMIZERS`, so a new
optimizer is one entry here. optax is imported only when an optimizer is built: the planner stays
JAX-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zerojax.errors import UserError, first_line


@dataclass(frozen=True)
class Optimizer:
    name: str
    slots: int  # fp32 tensors of the parameters' size (Adam: first and second moment)
    factored: bool = False  # Adafactor: second moment kept as row and column statistics
    # (learning rate or schedule, the `optimizer` config section) -> optax.GradientTransformation
    make: Callable[[Any, Any], Any] | None = field(default=None, compare=False, repr=False)


def _adamw(lr, c):
    import optax

    return optax.adamw(lr, b1=c.b1, b2=c.b2, weight_decay=c.weight_decay)


def _adam(lr, c):
    import optax

    return optax.adam(lr, b1=c.b1, b2=c.b2)


def _sgd(lr, c):
    import optax

    return optax.sgd(lr)


def _sgd_momentum(lr, c):
    import optax

    return optax.sgd(lr, momentum=c.b1)


def _adafactor(lr, c):
    import optax

    return optax.adafactor(lr)


OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer("adamw", 2, make=_adamw),
    "adam": Optimizer("adam", 2, make=_adam),
    "sgd": Optimizer("sgd", 0, make=_sgd),
    "sgd_momentum": Optimizer("sgd_momentum", 1, make=_sgd_momentum),
    "adafactor": Optimizer("adafactor", 0, factored=True, make=_adafactor),  # optax default: no momentum
}


def get_optimizer(name: str, key: str = "optimizer.name") -> Optimizer:
    """The registry entry for `name`; `key` names the setting in the error (e.g. `--optimizer`)."""
    if name not in OPTIMIZERS:
        raise UserError(f"{key} must be one of {', '.join(OPTIMIZERS)}, got {name!r}.")
    return OPTIMIZERS[name]


def learning_rate(c, total_steps: int):
    """An `optimizer` config section's learning rate: warm-up then cosine decay (an optax schedule,
    step -> rate), or the constant `lr`."""
    import optax

    if c.warmup_steps:
        return optax.warmup_cosine_decay_schedule(0.0, c.lr, c.warmup_steps, max(total_steps, c.warmup_steps + 1))
    return c.lr


def build_optimizer(c, total_steps: int):
    """The optax transformation an `optimizer` config section names (`learning_rate`), with global-norm
    clipping when `grad_clip` is set."""
    import optax

    base = get_optimizer(c.name).make(learning_rate(c, total_steps), c)  # type: ignore[misc]
    return optax.chain(optax.clip_by_global_norm(c.grad_clip), base) if c.grad_clip else base


def pads_exactly(
    tx, params: tuple[Any, Any] | None = None, shape: tuple[int, int] = (129, 131), padded: tuple[int, int] = (129, 136)
) -> bool:
    """Whether `tx`'s update of a zero-padded leaf is the update of the unpadded leaf, padded: true
    for elementwise optimizers (SGD, momentum, Adam/AdamW, global-norm clipping); false for
    Adafactor (factored row/column statistics, update RMS clipping, parameter-scale RMS). Measured
    on a probe leaf large enough to be factored, over two steps; a transform that cannot run on the
    probe counts as not exact. Its state must also be padded with the leaf or not depend on it:
    `optax.flatten` updates exactly, but its one flat moment holds every leaf's padding, so a
    checkpoint of it would mean another layout on another device count.

    `params`: the model's (logical, padded) param shapes, for a choice made per leaf from its shape
    (`multi_transform` labels, a weight-decay mask): it must come out the same on both (`_decides_alike`)."""
    if params is not None and not _decides_alike(tx, *params):
        return False
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    pad = lambda x: jnp.pad(x, [(0, t - s) for s, t in zip(shape, padded)])  # noqa: E731

    def both(p, grads):  # two steps on the leaf and on it padded, as the step calls `update` (`update_args`)
        s, sp, q, qp = tx.init(p), tx.init(pad(p)), p, pad(p)
        extra = update_args(tx, jnp.zeros((), jnp.float32))
        updates = []
        for g in grads:
            u, s = tx.update(g, s, q, **extra)
            up, sp = tx.update(pad(g), sp, qp, **extra)
            updates.append((u, up))
            q, qp = q + u, qp + up
        return updates

    try:
        p = np.asarray(rng.normal(size=shape), np.float32)
        grads = [np.asarray(rng.normal(size=shape), np.float32) for _ in range(2)]
        # each state leaf: the leaf's shape, padded with it, or one shape whatever the padding
        s = jax.eval_shape(tx.init, jax.ShapeDtypeStruct(shape, jnp.float32))
        sp = jax.eval_shape(tx.init, jax.ShapeDtypeStruct(padded, jnp.float32))
        alike = lambda a, b: (np.shape(a), np.shape(b)) == (shape, padded) or np.shape(a) == np.shape(b)  # noqa: E731
        if not all(jax.tree.leaves(jax.tree.map(alike, s, sp))):
            return False
        # One compiled program on the host's first device: op by op, the probe compiled some sixty.
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            for u, up in jax.jit(both)(p, grads):
                u, up = np.asarray(u), np.asarray(up)
                if not np.allclose(up[: shape[0], : shape[1]], u, rtol=1e-6, atol=1e-8) or np.any(up[:, shape[1] :]):
                    return False
        return True
    except Exception:  # noqa: BLE001 - any failure on the probe: be exact
        return False


def check_transformation(tx) -> None:
    """`tx` is an optax transformation: its `init` and `update` callable (a factory such as `optax.adam`
    passed uncalled, or a bare function, is one `UserError`)."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise UserError(
            f"the optimizer must be an optax GradientTransformation (with init and update), got {tx!r}; "
            "call the factory, e.g. optax.adamw(3e-4)."
        )


def state_shapes(tx, params):
    """The abstract state `tx.init` returns for `params` (abstract too), whatever pytree it is; an `init`
    that fails on the model's parameters is one `UserError` naming the failure."""
    import jax

    try:
        return jax.eval_shape(tx.init, params)
    except Exception as error:  # noqa: BLE001 - any failure of a user's init: one sentence
        first = first_line(error)
        raise UserError(
            f"the optimizer's init failed on the model's parameters ({type(error).__name__}: {first[:200]}); "
            "its masks or labels must match the params tree, which zerojax hands the optimizer as plain nested "
            "dicts (a mask built from an nnx.State or a FrozenDict: build it from nnx.to_pure_dict(...) or a "
            "plain dict, or pass a function of the params; zerojax inspect lists the parameter names)."
        ) from error


def _decides_alike(tx, logical, padded) -> bool:
    """Whether `tx` traces the same `init` and `update` on the params in their logical and in their
    padded shapes, shapes aside: the same operations, constants and state structure. A label or mask
    computed from a leaf's shape (`x.shape[0] == vocab`) that the padding changes gives another."""
    import jax
    import jax.numpy as jnp

    def traced(shapes):
        state = jax.eval_shape(tx.init, shapes)
        extra = update_args(tx, jax.ShapeDtypeStruct((), jnp.float32))
        update = jax.make_jaxpr(lambda g, s, p, e: tx.update(g, s, p, **e))(shapes, state, shapes, extra)
        return jax.tree.structure(state), _operations(jax.make_jaxpr(tx.init)(shapes).jaxpr), _operations(update.jaxpr)

    try:
        return traced(logical) == traced(padded)
    except Exception:  # noqa: BLE001 - an optimizer that cannot be traced on shapes alone: be exact
        return False


def _operations(jaxpr) -> list:
    """Each equation's primitive and scalar literal operands, nested jaxprs walked, shapes left out."""
    from zerojax.core.jaxprs import inner_jaxprs

    out: list = []
    for eqn in jaxpr.eqns:
        literals = tuple(str(v.val) for v in eqn.invars if hasattr(v, "val") and getattr(v.val, "ndim", 0) == 0)
        out.append((eqn.primitive.name, literals, [_operations(inner) for inner in inner_jaxprs(eqn)]))
    return out


def update_args(tx, loss) -> dict:
    """Keyword arguments for `tx.update` beside (grads, state, params): the step's loss as `value`
    where the update takes keyword arguments (every `optax.chain`, `optax.MultiSteps`), as a user's
    own loop passes it to `optax.contrib.reduce_on_plateau`; transformations that do not read it
    drop it (optax's `with_extra_args_support`). None otherwise."""
    import inspect

    try:
        parameters = inspect.signature(tx.update).parameters.values()
    except (TypeError, ValueError):  # no signature to read: pass nothing extra
        return {}
    takes = any(p.kind is p.VAR_KEYWORD or p.name == "value" for p in parameters)
    return {"value": loss} if takes else {}


def check_update(tx, params, state) -> None:
    """`tx.update` runs on abstract gradients shaped like `params` with the `state` `init` gave (as
    the step calls it, `update_args`); a failure is one `UserError` naming it, before anything compiles
    (`optax.lookahead` wants its own params type; a line search wants `value_fn`)."""
    import jax
    import jax.numpy as jnp

    try:
        jax.eval_shape(lambda g, s: tx.update(g, s, g, **update_args(tx, jnp.zeros((), jnp.float32))), params, state)
    except Exception as error:  # noqa: BLE001 - any failure of a user's update: one sentence
        first = first_line(error)
        raise UserError(
            f"the optimizer's update failed on gradients shaped like the model's parameters "
            f"({type(error).__name__}: {first[:200]}); zerojax calls update(grads, state, params), with "
            "value=<the step's loss> where it takes keyword arguments."
        ) from error
