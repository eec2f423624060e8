"""Whether a traced model may mix its batch's rows, read from its jaxpr alone.

Traced with a batch of a prime number of rows that no other dimension is a multiple of, a dimension
that is a multiple of it carries rows (the batch itself, or batch and sequence merged). An operation
that reduces, contracts, sorts, scans, slices, pads, reverses, concatenates or gathers along such a
dimension may make a row's output depend on other rows; everything elementwise, and every reshape
that keeps the rows outermost, cannot. Anything not known is taken to mix: the answer only decides
whether the exact measurement (`zerojax.adapt.model_rows`) runs, so a false "may" costs a compile
and a false "cannot" would miss a model.
"""

from __future__ import annotations

import numpy as np

from zerojax.core.jaxprs import inner_jaxprs

_REDUCING = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor"}
_REDUCING |= {"argmax", "argmin"}
_ALONG_ONE = {  # the parameter naming the one dimension the operation runs along
    "cumsum": "axis",
    "cumprod": "axis",
    "cummax": "axis",
    "cummin": "axis",
    "cumlogsumexp": "axis",
    "sort": "dimension",
    "top_k": "axis",
    "concatenate": "dimension",
    "split": "axis",
    "approx_top_k": "reduction_dimension",
}
# call-like primitives and control flow, judged by their bodies (scatters, generic reductions and
# windows carry jaxprs too, but as combiners: they are judged by what they combine along)
_CALLS = {"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call"}
_CALLS |= {"custom_vjp_call_jaxpr", "cond", "while", "scan", "custom_lin", "remat2", "custom_linear_solve"}
_CALLS |= {"custom_vmap_call"}
# same-shaped results that are no elementwise function of their operands
_SAME_SHAPE_NOT_ELEMENTWISE: tuple[str, ...] = (
    "fft",
    "reduce_window",
    "select_and_",
    "scatter",
    "dynamic_update_slice",
)
_SAME_SHAPE_NOT_ELEMENTWISE += ("pure_callback", "io_callback", "custom_call", "ffi_call", "shard_map", "pallas_call")
_SHAPE_ONLY = {  # move dimensions, draw, or constrain: no row reads another
    "squeeze",
    "expand_dims",
    "transpose",
    "convert_element_type",
    "iota",
    "copy",
    "copy_p",
    "select_n",
    "clamp",
    "sharding_constraint",
    "device_put",
    "reduce_precision",
    "stop_gradient",
    "optimization_barrier",
    "random_bits",
    "random_wrap",
    "random_unwrap",
    "random_seed",
    "random_fold_in",
    "random_split",
    "threefry2x32",
}


def may_mix_rows(jaxpr, rows: int) -> bool:
    """Whether any equation of `jaxpr` (a `Jaxpr`, nested ones included) may mix the rows of a batch
    of `rows` rows, `rows` a prime no other dimension is a multiple of."""
    return any(_eqn_may_mix(eqn, rows) for eqn in jaxpr.eqns)


def _eqn_may_mix(eqn, rows: int) -> bool:
    name, params = eqn.primitive.name, eqn.params
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    carrying = lambda shape: [i for i, d in enumerate(shape) if isinstance(d, int) and d and d % rows == 0]  # noqa: E731
    inner = inner_jaxprs(eqn) if name in _CALLS else []
    if inner:  # calls and control flow: their bodies decide; a scan along rows mixes them
        length = params.get("length", 0) if name == "scan" else 0
        if isinstance(length, int) and length and length % rows == 0:  # a scan whose steps are rows
            return True
        return any(may_mix_rows(j, rows) for j in inner)
    first = carrying(shapes[0]) if shapes else []
    if name in _REDUCING:
        return bool(set(params["axes"]) & set(first))
    if name in _ALONG_ONE:
        axis = params.get(_ALONG_ONE[name], -1)
        return any((axis % len(s) if s else 0) in carrying(s) for s in shapes if s)
    if name == "dot_general":  # along rows, or rows against rows (x @ x.T): not per row
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = params["dimension_numbers"]
        lhs, rhs = set(first), set(carrying(shapes[1]))
        if lhs & set(lhs_contract) or rhs & set(rhs_contract):
            return True
        return bool(lhs - set(lhs_batch) and rhs - set(rhs_batch))
    if name == "broadcast_in_dim":  # a new dimension of rows: each row against every other
        return bool(first) and len(carrying(tuple(eqn.outvars[0].aval.shape))) > len(first)
    if name == "reshape":
        return _reshape_mixes(shapes[0], tuple(eqn.outvars[0].aval.shape), carrying)
    if name == "slice":
        strides = params["strides"] or (1,) * len(shapes[0])
        return any(
            (params["start_indices"][i], params["limit_indices"][i], strides[i]) != (0, shapes[0][i], 1) for i in first
        )
    if name == "pad":
        return any(tuple(params["padding_config"][i]) != (0, 0, 0) for i in first)
    if name == "rev":
        return bool(set(params["dimensions"]) & set(first))
    if name == "conv_general_dilated":
        batch = params["dimension_numbers"].lhs_spec[0]
        return any(i != batch for i in first) or bool(carrying(shapes[1]))
    if name == "gather":  # a lookup per row (an embedding) reads its own indices; from activations, any row
        return bool(first)
    if name in _SHAPE_ONLY:
        return False
    if _elementwise(eqn) and not name.startswith(_SAME_SHAPE_NOT_ELEMENTWISE):
        # (rows, 1) against (1, rows) is every row against every other
        return len({tuple(carrying(s)) for s in shapes if carrying(s)}) > 1
    # anything else (gathers and scatters from activations, windows, dynamic slices, custom calls)
    # mixes wherever rows reach it
    return any(carrying(s) for s in shapes) or any(carrying(tuple(v.aval.shape)) for v in eqn.outvars)


def computes_in_half_precision(jaxpr) -> bool:
    """Whether any value in `jaxpr` (nested ones included) is bfloat16 or float16: its rounding, run
    on another number of rows, moves a deep model's outputs by several percent."""
    for eqn in jaxpr.eqns:
        if any(str(getattr(v.aval, "dtype", "")) in ("bfloat16", "float16") for v in eqn.outvars):
            return True
        if any(computes_in_half_precision(j) for j in inner_jaxprs(eqn)):
            return True
    return False


def _reshape_mixes(before: tuple, after: tuple, carrying) -> bool:
    """A reshape keeps rows apart when the rows' dimension has the same elements outside it before and
    after ((rows, seq, d) -> (rows * seq, d) and back); (rows, d) -> (d, rows) interleaves them."""
    have, got = carrying(before), carrying(after)
    if not have:
        return bool(got)
    if not got:
        return True
    return int(np.prod(before[: have[0]])) != int(np.prod(after[: got[0]]))


def _elementwise(eqn) -> bool:
    """Results shaped as the operands broadcast together (scalars and dimensions of 1 broadcast)."""
    ins = [tuple(v.aval.shape) for v in eqn.invars if getattr(v.aval, "shape", ())]
    outs = {tuple(v.aval.shape) for v in eqn.outvars}
    if not ins or len({len(s) for s in [*ins, *outs]}) > 1:
        return not ins and outs <= {()}
    broadcast = tuple(max(sizes) for sizes in zip(*ins))
    return outs == {broadcast} and all(set(sizes) <= {1, max(sizes)} for sizes in zip(*ins))
