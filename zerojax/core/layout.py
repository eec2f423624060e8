"""The state layout: the stage table x each leaf's rule -> a `NamedSharding` per leaf per state group.

The state groups are those of `zerojax.core.state.TrainState`. A sharded group stores leaves in their
padded shape; a replicated group in their logical shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.core import axis_rules as axis_rules_lib
from zerojax.core import offload as offload_lib
from zerojax.core import optim
from zerojax.core import trainable as trainable_lib
from zerojax.core.leaf_rule import LeafLayout, fit_to, leaf_layout
from zerojax.core.mesh import FSDP_AXIS, PIPELINE_AXIS, TENSOR_AXIS, pipeline_size
from zerojax.core.precision import Precision, cast_tree
from zerojax.core.stages import Stage
from zerojax.core.state import TrainState
from zerojax.core.trees import path_str, under
from zerojax.errors import UserError

_is_layout = lambda x: isinstance(x, LeafLayout)  # noqa: E731
# A storage shape: a plain tuple of ints. Not any tuple: optax's `MaskedNode` (a masked-out leaf of
# `optax.masked` / `multi_transform` state) is an empty NamedTuple, a pytree node with no leaves.
_is_shape = lambda x: type(x) is tuple and all(isinstance(i, int) for i in x)  # noqa: E731


@dataclass(frozen=True)
class StateLayout:
    mesh: Any
    stage: Stage
    precision: Precision
    leaves: Any  # pytree of LeafLayout, same structure as the params
    # The optimizer group's own leaves where they differ: padded leaves replicated in their logical
    # shape, for optimizers whose update is not elementwise (see `zerojax.core.optim.pads_exactly`).
    opt_leaves: Any = None
    # `zero.offload`: which groups live in host memory between steps (see `zerojax.core.offload`)
    offload: str = "none"
    # param paths whose leaves stack layers on axis 0, kept whole (`make_layout`'s `stack_paths`)
    stacks: tuple = ()
    # the model's logical axis names that no rule maps and no mesh axis is: free for FSDP
    unmapped_names: tuple = ()
    # logical axis name -> mesh axis, for parameters and activations (`zerojax.core.constraints`)
    axis_rules: Any = None

    @property
    def fsdp_size(self) -> int:
        return self.mesh.shape[FSDP_AXIS]

    # Which groups are sharded: read off the stage table, adjusted for fp32, where master == compute.
    @property
    def master_sharded(self) -> bool:
        if self.precision.separate_compute_copy:
            return self.stage.master_params
        return self.stage.compute_params

    @property
    def optimizer_sharded(self) -> bool:
        return self.stage.optimizer

    @property
    def compute_sharded(self) -> bool:
        return self.stage.compute_params

    @property
    def grads_sharded(self) -> bool:
        return self.stage.gradients

    @property
    def keeps_compute_copy(self) -> bool:
        """Stage 3 keeps none: it casts the fp32 shard right before gathering it."""
        return self.precision.separate_compute_copy and not self.stage.compute_params

    @property
    def host_groups(self) -> tuple[str, ...]:
        """The state groups kept in host memory ("pinned_host") between steps."""
        return offload_lib.groups(self.offload, self.keeps_compute_copy)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    # The params group: a trainable leaf is stored as its master; a frozen one (`LeafLayout.trainable`)
    # has no master and no optimizer state, so it is kept once, as the compute params are: in the
    # compute dtype, sharded only where they are (stage 3). The compute group has no copy of it (None).
    def param_sharded(self, leaf: LeafLayout) -> bool:
        return self.master_sharded if leaf.trainable else self.compute_sharded

    def param_dtype(self, leaf: LeafLayout):
        return self.precision.master_dtype if leaf.trainable else self.precision.compute_dtype

    def param_shardings(self):
        return jax.tree.map(
            lambda l: NamedSharding(self.mesh, l.spec(self.param_sharded(l))), self.leaves, is_leaf=_is_layout
        )

    def param_shape(self, leaf: LeafLayout) -> tuple[int, ...]:
        return leaf.padded_shape if self.param_sharded(leaf) else leaf.shape

    def to_params(self, tree):
        """Logical (or any-layout) params as the params group stores them: shape and dtype per leaf."""
        return jax.tree.map(
            lambda l, x: fit_to(x, self.param_shape(l)).astype(self.param_dtype(l)),
            self.leaves,
            tree,
            is_leaf=_is_layout,
        )

    def trained_leaves(self) -> list[LeafLayout]:
        """The trainable leaves' layouts (count them with `zerojax.core.trees.count_params`)."""
        return [l for l in jax.tree.leaves(self.leaves, is_leaf=_is_layout) if l.trainable]

    def frozen_leaves(self) -> list[LeafLayout]:
        """The frozen leaves' layouts: empty where everything trains."""
        return [l for l in jax.tree.leaves(self.leaves, is_leaf=_is_layout) if not l.trainable]

    def trained(self, tree):
        """`tree` (shaped like the params) with None for each frozen leaf: the compute group's leaves."""
        return jax.tree.map(lambda l, x: x if l.trainable else None, self.leaves, tree, is_leaf=_is_layout)

    def frozen_from(self, source, tree):
        """`tree`'s trainable leaves and `source`'s frozen ones: the whole compute params from the
        compute group (`tree`) and the params group (`source`); frozen leaves passed through an update."""
        return jax.tree.map(lambda l, s, t: t if l.trainable else s, self.leaves, source, tree, is_leaf=_is_layout)

    def shardings(self, sharded: bool, leaves=None):
        leaves = self.leaves if leaves is None else leaves
        return jax.tree.map(lambda l: NamedSharding(self.mesh, l.spec(sharded)), leaves, is_leaf=_is_layout)

    def shapes(self, sharded: bool, leaves=None):
        """Storage shapes of a group: padded where sharded, logical where replicated."""
        leaves = self.leaves if leaves is None else leaves
        return jax.tree.map(lambda l: l.padded_shape if sharded else l.shape, leaves, is_leaf=_is_layout)

    def to_layout(self, tree, sharded: bool, leaves=None):
        """Pad (or crop) every leaf to the storage shape of a sharded (or replicated) group."""
        shapes = self.shapes(sharded, leaves)
        return jax.tree.map(lambda x, shape: fit_to(x, shape), tree, shapes, is_leaf=_is_shape)

    # The optimizer group: `leaves` at `optimizer_sharded`, or `opt_leaves` where those are set.
    @property
    def _opt(self):
        return self.leaves if self.opt_leaves is None else self.opt_leaves

    def opt_shapes(self):
        return self.shapes(self.optimizer_sharded, self._opt)

    def opt_shardings(self):
        return self.shardings(self.optimizer_sharded, self._opt)

    def to_opt(self, tree):
        """`tree` (any layout) in the optimizer group's storage shapes."""
        return self.to_layout(tree, self.optimizer_sharded, self._opt)

    def opt_state_shardings(self, opt_state_shapes):
        """A sharding per leaf of whatever pytree the optimizer's `init` returned: a leaf inside a copy of
        the params tree (Adam's moments; `masked` / `multi_transform` copies, where masked-out leaves are
        `MaskedNode`s holding nothing) and shaped like its parameter's storage shards like it; every
        other leaf (counters, Adafactor's factored statistics, hyperparameters) by its own rule."""
        by_path = {}
        for (path, layout), shape in zip(
            jax.tree_util.tree_flatten_with_path(self._opt, is_leaf=_is_layout)[0],
            jax.tree.leaves(self.opt_shapes(), is_leaf=_is_shape),
        ):
            by_path[tuple(path)] = (layout, shape)

        def one(path, leaf):
            for cut in range(len(path) + 1):  # the longest param path the leaf's path ends with
                found = by_path.get(tuple(path[cut:]))
                if found is not None:
                    layout, shape = found
                    if tuple(leaf.shape) == tuple(shape):
                        return NamedSharding(self.mesh, layout.spec(self.optimizer_sharded))
                    break
            return self._own_rule(leaf)

        return jax.tree_util.tree_map_with_path(one, opt_state_shapes)

    def _own_rule(self, leaf) -> NamedSharding:
        """Leaves that are not param-shaped (factored statistics, counters) shard only when even."""
        shape = tuple(getattr(leaf, "shape", ()))
        if not self.optimizer_sharded or not shape:
            return self.replicated
        l = leaf_layout("", shape, np.dtype(leaf.dtype).itemsize, self.fsdp_size)
        return NamedSharding(self.mesh, l.spec(not l.padded))

    def opt_state_shapes(self, tx: optax.GradientTransformation):
        """The optimizer state's abstract leaves, from the optimizer group's storage shapes."""
        params = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s, self.precision.master_dtype), self.opt_shapes(), is_leaf=_is_shape
        )
        state = optim.state_shapes(tx, params)
        optim.check_update(tx, params, state)
        return state

    def state_shardings(self, tx, opt_state_shapes) -> TrainState:
        """Each group's shardings; the `host_groups` in memory kind "pinned_host"."""
        shardings = TrainState(
            step=self.replicated,
            params=self.param_shardings(),
            opt_state=self.opt_state_shardings(opt_state_shapes),
            compute=self.trained(self.shardings(False)) if self.keeps_compute_copy else None,
        )
        host = {g: jax.tree.map(offload_lib.to_host, getattr(shardings, g)) for g in self.host_groups}
        return shardings.replace(**host)

    def compute_shapes(self, sharding=None):
        """The logical params as `jax.ShapeDtypeStruct`s in the compute dtype, each with `sharding`
        if given: what an abstract trace of the model reads."""
        dtype = self.precision.compute_dtype
        return jax.tree.map(
            lambda l: jax.ShapeDtypeStruct(l.shape, dtype, sharding=sharding), self.leaves, is_leaf=_is_layout
        )

    def abstract_state(self, tx, opt_state_shapes) -> TrainState:
        """The state as `jax.ShapeDtypeStruct`s carrying their shardings; traces nothing."""
        shardings = self.state_shardings(tx, opt_state_shapes)
        params = jax.tree.map(
            lambda l, sh: jax.ShapeDtypeStruct(self.param_shape(l), self.param_dtype(l), sharding=sh),
            self.leaves,
            shardings.params,
            is_leaf=_is_layout,
        )
        compute = None
        if self.keeps_compute_copy:
            compute = jax.tree.map(
                lambda l, sh: jax.ShapeDtypeStruct(l.shape, self.precision.compute_dtype, sharding=sh),
                self.leaves,
                shardings.compute,
                is_leaf=_is_layout,
            )
            compute = self.trained(compute)

        opt_state = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_state_shapes, shardings.opt_state
        )
        return TrainState(
            step=jax.ShapeDtypeStruct((), np.int32, sharding=shardings.step),
            params=params,
            opt_state=opt_state,
            compute=compute,
        )

    def fresh_state(self, tx: optax.GradientTransformation, params) -> TrainState:
        """Step 0 from logical params (any dtype): master, optimizer and compute groups in their layouts."""
        compute = None
        if self.keeps_compute_copy:
            compute = self.trained(jax.tree.map(lambda x: x.astype(self.precision.compute_dtype), params))
        master = jax.tree.map(lambda x: x.astype(self.precision.master_dtype), params)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=self.to_params(params),
            opt_state=tx.init(self.to_opt(master)),
            compute=compute,
        )

    def derive_compute(self, params):
        """The persistent compute copy of master `params`: logical shapes, compute dtype, replicated
        (None for the frozen leaves, which the params group holds as they are computed with)."""
        return self.trained(cast_tree(self.to_layout(params, sharded=False), self.precision.compute_dtype))


def _opt_shapes(leaves, dtype) -> tuple[Any, Any]:
    """The params as the optimizer would see them: (logical, padded) `jax.ShapeDtypeStruct`s."""
    shapes = lambda padded: jax.tree.map(  # noqa: E731
        lambda l: jax.ShapeDtypeStruct(l.padded_shape if padded else l.shape, dtype), leaves, is_leaf=_is_layout
    )
    return shapes(False), shapes(True)


def _unpadded(leaf: LeafLayout) -> LeafLayout:
    """A padded leaf as a non-elementwise optimizer keeps it: whole over fsdp (its tensor split kept)."""
    if not leaf.padded:
        return leaf
    reason = "replicated in the optimizer: padding would change a non-elementwise update"
    return dataclasses.replace(leaf, padded_shape=leaf.shape, axis=None, reason=reason)


def make_layout(
    mesh,
    stage: Stage,
    precision: Precision,
    param_shapes,
    *,
    replicate_below_bytes: int = 2048,
    optimizer_pads_exactly: Callable[[Any, Any], bool] = lambda logical, padded: True,
    stack_paths: tuple = (),
    offload: str = "none",
    hierarchical: bool = False,
    axis_names: dict | None = None,
    axis_rules: dict | None = None,
    trainable=None,
) -> StateLayout:
    """One `LeafLayout` per parameter; leaves under one of the `stack_paths` (the param paths of the
    model's layer stacks: `zj.Stacked`, or what a model taking `layer_hook` declares) keep axis 0 whole
    from FSDP (a `pipeline` mesh splits it into pipeline stages, every other leaf over fsdp x pipeline).

    `optimizer_pads_exactly(logical, padded)` (`optim.pads_exactly`: the params as the optimizer sees
    them), asked only if the optimizer group has a padded leaf: if not, it keeps them replicated, whole.
    `axis_names` ({param path: logical names}) and `axis_rules` (`zerojax.core.axis_rules`) choose each
    leaf's tensor-parallel dimension, and a dimension the model gives to `fsdp` itself.
    `trainable`: a bool per leaf (`zerojax.core.trainable.select`); None: every leaf trains.
    """
    rules = axis_rules_lib.as_rules(axis_rules)
    tensor = dict(mesh.shape).get(TENSOR_AXIS, 1)
    stages = pipelined_stages(mesh, param_shapes, stack_paths)
    over = (FSDP_AXIS, "data") if hierarchical else (FSDP_AXIS,)  # hpZ: state sharded over fsdp x data
    fsdp = mesh.shape[FSDP_AXIS] * (mesh.shape["data"] if hierarchical else 1)

    def rule(path, leaf):
        name = path_str(path)
        stacked = under(tuple(getattr(k, "key", k) for k in path), stack_paths)
        tensor_axis, fsdp_axis = axis_rules_lib.dims(name, (axis_names or {}).get(name), leaf.shape, rules, tensor)
        beside = not stacked and stages > 1
        return leaf_layout(
            name,
            leaf.shape,
            np.dtype(precision.master_dtype).itemsize,
            fsdp * (stages if beside else 1),
            layer_axis=0 if stacked else None,
            replicate_below_bytes=replicate_below_bytes,
            over=_beside_pipeline(over) if beside else over,
            tensor_axis=tensor_axis,
            tensor_size=tensor,
            fsdp_axis=fsdp_axis,
            pipeline_size=stages if stacked else 1,
        )

    leaves = jax.tree_util.tree_map_with_path(rule, param_shapes)
    leaves = leaves if trainable is None else _with_trainable(leaves, trainable, param_shapes)
    padded = stage.optimizer and any(l.padded for l in jax.tree.leaves(leaves, is_leaf=_is_layout))
    unpadded = padded and not optimizer_pads_exactly(*_opt_shapes(leaves, precision.master_dtype))
    opt_leaves = jax.tree.map(_unpadded, leaves, is_leaf=_is_layout) if unpadded else None
    names = [n for ns in (axis_names or {}).values() for n in ns]
    unmapped = tuple(axis_rules_lib.unmapped(names, rules))
    return StateLayout(
        mesh, stage, precision, leaves, opt_leaves, offload, tuple(stack_paths), unmapped, axis_rules=rules
    )


def _beside_pipeline(over: tuple[str, ...]) -> tuple[str, ...]:
    """A leaf beside a pipelined stack is split over fsdp x pipeline, and over hpZ's `data` last:
    the minor axis, so that gathering the primary shard over `data` yields the secondary copy as a
    contiguous shard over fsdp x pipeline."""
    return (FSDP_AXIS, PIPELINE_AXIS, *over[1:])


def _with_trainable(leaves, trainable, param_shapes):
    dtypes = trainable_lib.declared_dtypes(param_shapes, trainable)
    replace = lambda l, t, d: dataclasses.replace(l, trainable=bool(t), read_dtype=d)  # noqa: E731
    return jax.tree.map(replace, leaves, trainable, dtypes, is_leaf=_is_layout)


def pipelined_stages(mesh, param_shapes, stack_paths: tuple) -> int:
    """The mesh's pipeline stages, checked: a pipelined model has one stack of identical blocks whose
    layers divide into them."""
    stages = pipeline_size(mesh)
    if stages > 1:
        _check_pipelined(param_shapes, stack_paths, stages)
    return stages


def _check_pipelined(param_shapes, stack_paths: tuple, stages: int) -> None:
    if not stack_paths:
        raise UserError(
            f"mesh.pipeline={stages} splits a model's stack of identical blocks into pipeline stages, but this "
            "model has none it can split (an NNX model's zj.Stacked blocks, or the shipped GPT; Linen nn.scan and "
            "NNX nnx.scan or nnx.vmap stacks are not split yet); use mesh.pipeline=1."
        )
    if len(stack_paths) > 1:
        names = ", ".join("/".join(map(str, s)) for s in stack_paths)
        raise UserError(
            f"mesh.pipeline={stages} pipelines one stack of blocks; this model has {len(stack_paths)}: {names}."
        )
    layers = {
        int(leaf.shape[0])
        for path, leaf in jax.tree_util.tree_flatten_with_path(param_shapes)[0]
        if under(tuple(getattr(k, "key", k) for k in path), stack_paths)
    }
    (n,) = layers or {0}
    if n % stages:
        raise UserError(
            f"the model's {n} layers do not divide into mesh.pipeline={stages} pipeline stages of equal size; "
            f"choose a pipeline size that divides {n}."
        )
