"""Device mesh with the axes `data` (pure replicas), `fsdp` (the axis ZeRO shards over) and `tensor`
(Megatron-style tensor parallelism: the parameter dimensions the axis rules map to it, see
`zerojax.core.axis_rules`), and, when asked for, `pipeline` (a model's stack of blocks split into
pipeline stages of consecutive layers, `zerojax.engines.pipeline`). Owns the mesh-size and
batch-divisibility rules."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence

import numpy as np

from zerojax.errors import UserError

DATA_AXIS = "data"  # whole replicas: parameters are never split over it (but hpZ's state)
FSDP_AXIS = "fsdp"  # the axis ZeRO shards over
TENSOR_AXIS = "tensor"  # tensor parallelism
PIPELINE_AXIS = "pipeline"  # pipeline stages; outermost (between nodes), present only when > 1
AXES = (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS)
BATCH_AXES = (DATA_AXIS, "fsdp")  # the global batch is split over every data-parallel axis


def simulate_cpu_devices(count: int) -> None:
    """Ask XLA for `count` host devices; must run before JAX initialises its backends.

    Keeps any `XLA_FLAGS` the user already set, replacing only an earlier device-count flag.
    """
    if count < 1:
        raise UserError(f"--devices must be a positive number of devices, got {count}.")
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags.strip()} {flag}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def check_sizes(data, fsdp=None, tensor=1, pipeline=1) -> None:
    """Each mesh size given is a positive integer (`fsdp` None: every device left over)."""
    sizes = (("mesh.data", data), ("mesh.tensor", tensor), ("mesh.fsdp", fsdp), ("mesh.pipeline", pipeline))
    for name, size in sizes:
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise UserError(f"{name} must be a positive integer, got {size!r}.")


def check_batch(batch_size: int, data_parallel: int, subject: str | None = None) -> None:
    """The global batch splits evenly over every data-parallel device (mesh data x fsdp). `subject`
    names the batch in the message (default: the config's `train.batch_size`)."""
    if batch_size % data_parallel:
        raise UserError(
            f"{subject or f'train.batch_size={batch_size}'} is not divisible by the data-parallel size "
            f"{data_parallel} (mesh.data x mesh.fsdp)."
        )


def make_mesh(
    data: int = 1, fsdp: int | None = None, tensor: int = 1, *, pipeline: int = 1, devices: Sequence | None = None
):
    """A `jax.sharding.Mesh` over `devices` (default: all) with axes (data, fsdp, tensor), and
    `pipeline` first where `pipeline` > 1 (the outermost axis: consecutive devices share a stage).

    By default every device not taken by `pipeline`, `data` or `tensor` is on `fsdp`. Axes are
    `Auto`, so XLA propagates shardings through the step (GSPMD) and `shard_map` can still name them.
    """
    import jax
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    check_sizes(data, fsdp, tensor, pipeline)
    if fsdp is None:
        if n % (pipeline * data * tensor):
            given = f"mesh.pipeline={pipeline} x " if pipeline > 1 else ""
            raise UserError(
                f"{given}mesh.data={data} x mesh.tensor={tensor} does not divide the {n} available devices."
            )
        fsdp = n // (pipeline * data * tensor)
    shape = (data, fsdp, tensor)
    if math.prod(shape) * pipeline != n:
        given = f"pipeline={pipeline} x " if pipeline > 1 else ""
        raise UserError(
            f"mesh {given}data={data} x fsdp={fsdp} x tensor={tensor} = {math.prod(shape) * pipeline} devices, "
            f"but {n} are available; the sizes must multiply to the device count."
        )
    names = AXES if pipeline == 1 else (PIPELINE_AXIS, *AXES)
    sizes = shape if pipeline == 1 else (pipeline, *shape)
    return Mesh(np.asarray(devices).reshape(sizes), names, axis_types=(AxisType.Auto,) * len(names))


def checked_mesh(mesh):
    """`mesh` as the step uses it: a `Mesh` over `make_mesh`'s axes, each `Auto`, since the step's
    shardings are the partitioner's (one from `jax.make_mesh` has `Explicit` axes by default: the same
    devices are taken with `Auto` axes). Another object or other axis names are one `UserError`."""
    from jax.sharding import AxisType, Mesh

    if not isinstance(mesh, Mesh):
        raise UserError(
            f"mesh must be a jax.sharding.Mesh such as zj.make_mesh(fsdp=8) builds; got a {type(mesh).__name__}."
        )
    names = tuple(mesh.axis_names)
    if names not in (AXES, (PIPELINE_AXIS, *AXES)):
        raise UserError(
            f"the mesh's axes are {names}; zerojax steps on the axes {AXES} (with {PIPELINE_AXIS!r} first to "
            "pipeline): build it with zj.make_mesh(data=..., fsdp=..., tensor=..., devices=...)."
        )
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, names, axis_types=(AxisType.Auto,) * len(names))


def pipeline_size(mesh) -> int:
    """Pipeline stages on `mesh` (1 where it has no `pipeline` axis)."""
    return int(dict(mesh.shape).get(PIPELINE_AXIS, 1))


def check_tensor_used(layout) -> None:
    """A `tensor` axis over which some parameter is split: otherwise its devices would repeat each
    other's work (a model without axis names, or names no rule maps to `tensor`)."""
    import jax

    tensor = dict(layout.mesh.shape).get("tensor", 1)
    leaves = jax.tree.leaves(layout.leaves, is_leaf=lambda x: hasattr(x, "tensor_axis"))
    if tensor > 1 and all(l.tensor_axis is None for l in leaves):
        raise UserError(
            f"the mesh's tensor axis has {tensor} devices, but no parameter of this model is mapped to it "
            "(name its dimensions with nnx.with_partitioning / nn.with_logical_partitioning and map a name "
            "to tensor in the axis rules), so they would repeat each other's work; use tensor=1."
        )


def data_parallel_size(mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)
