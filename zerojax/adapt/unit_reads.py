"""Which parameters a model reads outside the FSDP unit that gathers them.

A unit gathers its parameters inside its own calls (`zerojax.adapt.units`). Anything else that reads them (a
tied output head reading the embedding's table, a property, another module reaching in) would get
the stored shard. So before a step is built, the model is traced once with every gather replaced by
a marked identity, and the jaxpr is searched for a path from a unit's parameter to the model's
outputs that does not pass through a gather: such a parameter is read raw somewhere. Those leaves
are then gathered by the root, once, before the model runs (a correct gather, at the cost of holding
them whole for the step), and `zerojax inspect` names them.

The search follows the data through `jit`, `checkpoint`, `custom_jvp`/`custom_vjp` calls and `scan`
bodies; any other primitive with a body (a `while` loop, a `cond`) is taken to pass every input to
every output: a false alarm there costs memory, never correctness.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend

_MARK = "_zerojax_gathered"


def _zerojax_gathered(x):
    return x


_marked = jax.jit(_zerojax_gathered)


def marked(paths: list[str], values: list[Any]) -> list[Any]:
    """A `Materialize` for the search: each value through the marked identity."""
    del paths
    return [_marked(v) for v in values]


def raw_reads(run, params, *rest) -> list[bool]:
    """For each leaf of `params` (in `jax.tree.leaves` order): whether `run(params, *rest)`'s outputs
    depend on it other than through `marked`. `run` must gather with `marked`."""
    closed = jax.make_jaxpr(run)(params, *rest)
    n = len(jax.tree.leaves(params))
    reached = set().union(*_dependencies(closed.jaxpr)) if closed.jaxpr.outvars else set()
    return [i in reached for i in range(n)]


def _dependencies(jaxpr) -> list[frozenset]:
    """For each output of `jaxpr`: the indices of the inputs it depends on, other than through a mark."""
    env: dict = {v: frozenset([i]) for i, v in enumerate(jaxpr.invars)}
    none: frozenset = frozenset()

    def read(v):
        return none if isinstance(v, jax.extend.core.Literal) else env.get(v, none)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _through(eqn, ins)
        for v, deps in zip(eqn.outvars, outs):
            env[v] = deps
    return [read(v) for v in jaxpr.outvars]


def _through(eqn, ins: list[frozenset]) -> list[frozenset]:
    """The dependencies of `eqn`'s outputs, given its inputs'."""
    if eqn.params.get("name") == _MARK:
        return [frozenset()] * len(eqn.outvars)
    if eqn.primitive.name == "scan":
        return _scan(eqn, ins)
    body = _positional_body(eqn)
    if body is not None:
        return [frozenset().union(*(ins[j] for j in deps)) for deps in _dependencies(body)]
    everything = frozenset().union(*ins)
    return [everything] * len(eqn.outvars)


def _positional_body(eqn):
    """The body of a call-like primitive whose inputs and outputs are its body's, one for one."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = eqn.params.get(name)
        body = getattr(body, "jaxpr", body)
        if (
            body is not None
            and hasattr(body, "invars")
            and len(body.invars) == len(eqn.invars)
            and len(body.outvars) == len(eqn.outvars)
        ):
            return body
    return None


def _scan_split(eqn) -> tuple[int, int]:
    """How many of a scan's inputs are constants and carries (jax 0.12 keeps them in a flat tree)."""
    if "num_consts" in eqn.params:
        return eqn.params["num_consts"], eqn.params["num_carry"]
    consts, carry, _ = eqn.params["ft_in"].update(list(eqn.invars)).unpack()
    return len(list(consts)), len(list(carry))


def _scan(eqn, ins: list[frozenset]) -> list[frozenset]:
    """A scan's carry feeds the next iteration: iterate the body's dependencies to a fixed point."""
    body = eqn.params["jaxpr"].jaxpr
    consts, carry = _scan_split(eqn)
    inner = _dependencies(body)
    now = list(ins)
    while True:
        outs = [frozenset().union(*(now[j] for j in deps)) for deps in inner]
        grown = [now[consts + k] | outs[k] for k in range(carry)]
        if grown == now[consts : consts + carry]:
            return outs
        now[consts : consts + carry] = grown
