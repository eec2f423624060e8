"""What zerojax hands a model's call besides its inputs, by the names its author gave them.

Flax's guides and examples spell a model's mode `train` (the BatchNorm guide), `training` (the dropout
guide), `is_training` or `deterministic`; a model with a default would otherwise train in evaluation
mode, its dropout off and its statistics never updated, without a word. An NNX model may take its
`nnx.Rngs` at call time; a Linen model draws from the RNG streams the step keys (`rng_streams`).
"""

from __future__ import annotations

import inspect
import re

import jax
from flax import errors as flax_errors

from zerojax.errors import UserError

# A model's own mode argument as Flax's guides and examples spell it, and its value when training.
MODE_ARGUMENTS = {"train": True, "training": True, "is_training": True, "deterministic": False}
CALL_RNGS = "rngs"  # an NNX model's `nnx.Rngs` taken at call time (`self.dropout(x, rngs=rngs)`)
# What zerojax hands an NNX model whose `__call__` takes it: the layer hooks, and its own `Rngs`.
_OWN_ARGUMENTS = ("layer_hook", "layer_loop", CALL_RNGS)


def mode_names(fn, hooks: tuple[str, ...] = _OWN_ARGUMENTS) -> tuple[str, ...]:
    """The mode arguments (`MODE_ARGUMENTS`) a model's `__call__` takes, each passed by name, so a
    model written `__call__(self, x, training: bool = False)` trains in training mode; another
    argument it requires is one `UserError` (zerojax passes the inputs, the mode and, to a model that
    takes them, `hooks`)."""
    try:
        params = list(inspect.signature(fn).parameters.values())[2:]  # past self and the inputs
    except (TypeError, ValueError):
        return ()
    by_name = [p for p in params if p.kind not in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    filled = {p.name for p in by_name if p.name in (*MODE_ARGUMENTS, *hooks)}
    unfilled = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unfilled = [name for name in unfilled if name not in filled]
    if unfilled:
        raise UserError(
            f"the model's __call__ requires {', '.join(unfilled)}, which zerojax cannot fill: it calls the "
            f"model on batch['inputs'] (a pytree of arrays for several inputs) and passes the mode by name "
            f"({', '.join(MODE_ARGUMENTS)}); give {'them defaults' if len(unfilled) > 1 else 'it a default'} "
            f"or take {'them' if len(unfilled) > 1 else 'it'} from the inputs."
        )
    return tuple(n for n in MODE_ARGUMENTS if n in filled)


def takes_by_name(fn, name: str) -> bool:
    """Whether the `__call__` `fn` takes `name` by keyword."""
    try:
        param = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def mode_arguments(names: tuple[str, ...], train: bool) -> dict:
    """The mode arguments `names` for training (`train=True`) or evaluation."""
    return {n: train == MODE_ARGUMENTS[n] for n in names}


def linen_streams(rng_streams: tuple[str, ...] | None, linen: bool) -> tuple[str, ...]:
    """The streams a Linen model's step keys (None: dropout). An NNX model keys every stream its
    `Rngs` hold, so streams named for one would do nothing: one `UserError`."""
    if linen:
        return tuple(rng_streams) if rng_streams is not None else ("dropout",)
    if rng_streams is not None:
        raise UserError(
            f"rng_streams {tuple(rng_streams)!r} names a Linen model's make_rng streams; an NNX model's Rngs "
            f"streams are each keyed every step already: leave it out."
        )
    return ()


def unkeyed_stream(error, rng_streams: tuple[str, ...]) -> UserError:
    """Flax's error for a stream a Linen model draws from (`self.make_rng`) that the step does not key,
    as one sentence that says how to key it."""
    found = re.search(r'needs PRNG for "([^"]+)"', str(error))
    name = found.group(1) if found else None
    stream = f"the RNG stream {name!r}" if name else "an RNG stream"
    wanted = repr((*rng_streams, name)) if name else "(..., the stream)"
    return UserError(
        f"the model draws from {stream} (self.make_rng), which is not among the streams zerojax keys from each "
        f"step, {rng_streams!r}: name it, Trainer(..., rng_streams={wanted}) or model.rng_streams in a config."
    )


def keyed_run(run, rng, rng_streams: tuple[str, ...], train: bool):
    """`run(rngs=...)` of a Linen model: in training keyed from `rng` per stream; in eval mode first
    without a key (`deterministic=not self.has_rng("dropout")` then turns dropout off), and keyed only
    where Flax says the model draws even so (hard-coded dropout), from `rng` or a fixed key. A stream
    the step does not key is one `UserError` (`unkeyed_stream`)."""

    def keys(rng):
        return None if rng is None else {s: jax.random.fold_in(rng, i) for i, s in enumerate(rng_streams)}

    try:
        return run(rngs=keys(rng) if train else None)
    except flax_errors.InvalidRngError as error:
        if train:
            raise unkeyed_stream(error, rng_streams) from None
    try:
        return run(rngs=keys(jax.random.key(0) if rng is None else rng))
    except flax_errors.InvalidRngError as error:
        raise unkeyed_stream(error, rng_streams) from None
