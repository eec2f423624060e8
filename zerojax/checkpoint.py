"""Orbax checkpoints of the train state: asynchronous sharded saves, restore into any stage and
mesh, consolidated fp32 export, and `load_params`.

A checkpoint is one orbax step directory `DIR/<step>/` with two items:
  state  {"step", "params", "opt_state"} exactly as the run stores them (padded where sharded);
         every process writes only its own shards. The bf16 compute copy is derived: not saved.
  meta   JSON: each leaf's saved shape, each parameter's logical shape, stage, mesh, the data
         position and seed, the run's config.
Orbax writes `<step>.orbax-checkpoint-tmp` and renames it when complete, so a killed save leaves
only a tmp directory, which is reported and skipped. Restoring reads, per device, just the slice the
*target* layout puts there; where the stored shape differs (padding depends on the fsdp size and
on whether a group is sharded), orbax zero-pads or crops the end of the axis while reading, which
is exact because padding is always zeros at the end of one axis.
"""

from __future__ import annotations

import functools
import os
import sys
import zipfile

import jax
import numpy as np

from zerojax.errors import UserError
from zerojax.stages import path_str

FORMAT = 1
SAVED_KEYS = ("step", "params", "opt_state")  # "compute" is rebuilt from "params"
_TMP_MARK = ".orbax-checkpoint-tmp"


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


def warn(message: str) -> None:
    """One `warning: ...` line on stderr, from process 0 only."""
    if jax.process_index() == 0:
        sys.stderr.write(f"warning: {message}\n")
        sys.stderr.flush()


def quiet_orbax() -> None:
    """For the CLI: orbax's absl warnings (read-only options, missing step metadata) are noise there."""
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)


def checkpoint_dir(config, out_dir: str) -> str:
    """checkpoint.dir, or OUT/checkpoints; absolute, as orbax wants."""
    return os.path.abspath(config.checkpoint.dir or os.path.join(out_dir, "checkpoints"))


# ---- finding checkpoints -------------------------------------------------------------------------


def complete_steps(directory: str, *, report: bool = True) -> list[int]:
    """Steps with a complete checkpoint in `directory`, oldest first; interrupted saves are skipped."""
    if not os.path.isdir(directory):
        return []
    if report:
        for name in sorted(os.listdir(directory)):
            if _TMP_MARK in name:
                warn(f"ignoring the incomplete checkpoint {os.path.join(directory, name)} (its save was interrupted).")
    return sorted(_ocp().step.checkpoint_steps(directory))


def _is_step_dir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "state")) and os.path.isdir(os.path.join(path, "meta"))


def find_step_dir(path: str) -> str:
    """A step directory from a step directory, a checkpoint directory or a run's OUT (latest step)."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise UserError(f"checkpoint path {path!r} does not exist.")
    if _TMP_MARK in os.path.basename(path):
        raise UserError(f"checkpoint {path!r} is incomplete (its save was interrupted); use a complete step.")
    if _is_step_dir(path):
        return path
    for directory in (path, os.path.join(path, "checkpoints")):
        steps = complete_steps(directory, report=False)
        if steps:
            return os.path.join(directory, str(steps[-1]))
    raise UserError(f"{path!r} holds no complete checkpoint; give a checkpoint step directory or a run's output folder.")


# ---- metadata ------------------------------------------------------------------------------------


def _leaf_table(tree, checksums=None) -> dict[str, dict]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    table = {path_str(p): {"shape": list(x.shape), "dtype": str(np.dtype(x.dtype))} for p, x in flat}
    for (p, _), c in zip(flat, jax.tree.leaves(checksums) if checksums is not None else ()):
        table[path_str(p)]["checksum"] = int(c)
    return table


def _sum_bits(x):
    # Wrapping sum of the 32-bit patterns: exact in any reduction order, and zero padding adds 0.
    import jax.numpy as jnp

    return jnp.sum(jax.lax.bitcast_convert_type(x, jnp.uint32), dtype=jnp.uint32)


@functools.lru_cache(maxsize=8)
def _checksum_fn(mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    # Replicated results: every process can read them, also in a multi-process run.
    return jax.jit(lambda tree: jax.tree.map(_sum_bits, tree), out_shardings=NamedSharding(mesh, PartitionSpec()))


def _checksums(tree) -> list[int]:
    """One checksum per leaf (all saved leaves are 32-bit), computed where the shards live."""
    sums = _checksum_fn(jax.tree.leaves(tree)[0].sharding.mesh)(tree)
    return [int(c) for c in jax.device_get(jax.tree.leaves(sums))]


def _host_checksum(x: np.ndarray) -> int:
    return int(np.ascontiguousarray(x).view(np.uint32).sum(dtype=np.uint64) % 2**32)


def run_metadata(trainer, *, seed: int, config: dict | None = None, model: dict | None = None) -> dict:
    """The parts of a checkpoint's metadata fixed for a whole run."""
    layout = trainer.layout
    params = {
        leaf.path: {"shape": list(leaf.shape), "stored": list(leaf.padded_shape if layout.master_sharded else leaf.shape)}
        for leaf in jax.tree.leaves(layout.leaves, is_leaf=lambda x: hasattr(x, "padded_shape"))
    }
    return {
        "format": FORMAT,
        "stage": trainer.stage.index,
        "precision": trainer.precision.name,
        "engine": trainer.engine,
        "mesh": {k: int(v) for k, v in trainer.mesh.shape.items()},
        "processes": jax.process_count(),
        "seed": seed,
        "params": params,
        "config": config,
        "model": model,
    }


def _item(step_dir: str, name: str):
    from etils import epath

    return epath.Path(step_dir) / name


def _state_handler():
    # Handlers, not Checkpointers: these read one item directory and need no step metadata.
    return _ocp().PyTreeCheckpointHandler()


def read_meta(step_dir: str) -> dict:
    ocp = _ocp()
    try:
        meta = ocp.JsonCheckpointHandler().restore(_item(step_dir, "meta"), args=ocp.args.JsonRestore())
    except Exception:  # noqa: BLE001 - any failure to read is a damaged checkpoint
        meta = None
    if not isinstance(meta, dict) or not {"format", "step", "params", "leaves"} <= set(meta):
        raise UserError(f"checkpoint {step_dir!r} is corrupted or truncated: its metadata cannot be read.")
    if meta["format"] != FORMAT:
        raise UserError(f"checkpoint {step_dir!r} has format {meta['format']!r}; this zerojax reads format {FORMAT}.")
    return meta


# ---- saving --------------------------------------------------------------------------------------


class CheckpointWriter:
    """Asynchronous sharded saves; orbax keeps the newest `keep` and deletes older ones only after a
    newer save is complete."""

    def __init__(self, directory: str, *, keep: int, run_meta: dict):
        ocp = _ocp()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, create=True,
            cleanup_tmp_directories=True,  # interrupted saves were reported by `complete_steps`
        )
        self.directory = directory
        self._run_meta = run_meta
        self._manager = ocp.CheckpointManager(directory, options=options)

    def save(self, step: int, state: dict) -> None:
        """Returns once the shards are copied off the devices; files are written in the background."""
        ocp = _ocp()
        saved = {k: state[k] for k in SAVED_KEYS}
        meta = {**self._run_meta, "step": step, "data": {"position": step, "seed": self._run_meta["seed"]},
                "leaves": _leaf_table(saved, _checksums(saved))}
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(saved),
                                                         meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()  # waits for the save in flight


# ---- restoring -----------------------------------------------------------------------------------


def _check_model(meta: dict, layout, step_dir: str) -> None:
    saved = {p: tuple(v["shape"]) for p, v in meta["params"].items()}
    here = {l.path: l.shape for l in jax.tree.leaves(layout.leaves, is_leaf=lambda x: hasattr(x, "padded_shape"))}
    for path in sorted(set(saved) | set(here)):
        if path not in here:
            raise UserError(f"checkpoint {step_dir!r} is from another model: it has parameter {path!r}, which this model lacks.")
        if path not in saved:
            raise UserError(f"checkpoint {step_dir!r} is from another model: it lacks parameter {path!r} of this model.")
        if saved[path] != here[path]:
            raise UserError(f"checkpoint {step_dir!r} is from another model: parameter {path!r} has shape "
                            f"{saved[path]} there but {here[path]} here.")


def _check_leaves(meta: dict, target: dict, step_dir: str) -> None:
    saved, here = meta["leaves"], _leaf_table(target)
    differ = sorted(set(saved) ^ set(here)) or [p for p in sorted(here) if saved[p]["dtype"] != here[p]["dtype"]]
    if differ:
        raise UserError(f"checkpoint {step_dir!r} holds the state of another optimizer ({differ[0]!r} does not "
                        "match); resume with the optimizer it was trained with.")


def restore(trainer, step_dir: str, key, batch: dict) -> tuple[dict, dict]:
    """(state, meta): the checkpoint in `step_dir`, placed as `trainer` (any stage, any mesh) wants.

    Each device reads only its own slice; nothing is gathered. Raises `UserError` for a checkpoint of
    another model or optimizer, or a damaged one, before any state is changed.
    """
    ocp = _ocp()
    meta = read_meta(step_dir)
    target = trainer.abstract_state(key, batch)
    _check_model(meta, trainer.layout, step_dir)
    _check_leaves(meta, target, step_dir)
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)

    def args_for(path, t):
        stored = tuple(meta["leaves"][path_str(path)]["shape"])
        # Only leaves whose padding differs between the two layouts may be padded or cropped.
        return ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype,
                                    strict=stored == tuple(t.shape))

    restore_args = jax.tree_util.tree_unflatten(treedef, [args_for(p, t) for p, t in flat])
    try:
        saved = _state_handler().restore(
            _item(step_dir, "state"), args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))
    except Exception:  # noqa: BLE001 - tensorstore and orbax raise many types for damaged files
        raise UserError(f"checkpoint {step_dir!r} is corrupted or truncated: its arrays cannot be read.") from None
    _verify(meta, saved, step_dir)
    return trainer.restore_state(saved), meta


def _verify(meta: dict, saved: dict, step_dir: str) -> None:
    """Checksums of the leaves restored at their stored shape (padded or cropped ones can't match)."""
    flat = jax.tree_util.tree_flatten_with_path(saved)[0]
    for (p, x), c in zip(flat, _checksums(saved)):
        want = meta["leaves"][path_str(p)]
        if list(x.shape) == want["shape"] and want.get("checksum", c) != c:
            raise UserError(f"checkpoint {step_dir!r} is corrupted: {path_str(p)!r} does not match its checksum.")


# ---- export and load -----------------------------------------------------------------------------


def _nested(keys: tuple, leaf) -> dict:
    tree = leaf
    for k in reversed(keys):
        tree = {k: tree}
    return tree


def _dig(tree, keys: tuple):
    for k in keys:
        tree = tree[k]
    return tree


def _param_keys(step_dir: str) -> list[tuple]:
    """Each parameter's key path (the dict keys, as saved) under the checkpoint's "params"."""
    tree = _state_handler().metadata(_item(step_dir, "state")).tree["params"]
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [tuple(getattr(k, "key", getattr(k, "idx", None)) for k in p) for p, _ in paths]


def export_params(checkpoint: str, out_path: str) -> dict:
    """Write the master params, fp32 and in logical shapes, to an .npz keyed by parameter path.

    Streams one leaf at a time (read, crop, write), so host memory peaks near the largest leaf. The
    file appears only when complete (written beside it, then renamed).
    """
    ocp = _ocp()
    step_dir = find_step_dir(checkpoint)
    meta = read_meta(step_dir)
    out_path = out_path if out_path.endswith(".npz") else out_path + ".npz"
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise UserError(f"output folder {out_dir!r} does not exist.")
    handler = _state_handler()
    partial = f"{out_path}.partial"
    try:
        keys = _param_keys(step_dir)
        with zipfile.ZipFile(partial, "w", allowZip64=True) as zf:
            for k in keys:
                name = "/".join(str(x) for x in k)
                if name not in meta["params"]:
                    raise KeyError(name)
                item = _nested(("params", *k), 0)
                args = _nested(("params", *k), ocp.RestoreArgs(restore_type=np.ndarray))
                tree = handler.restore(_item(step_dir, "state"), args=ocp.args.PyTreeRestore(
                    item=item, restore_args=args, partial_restore=True))
                stored = np.asarray(_dig(tree, ("params", *k)), dtype=np.float32)
                want = meta["leaves"][f"params/{name}"]
                if "checksum" in want and want["checksum"] != _host_checksum(stored):
                    raise UserError(f"checkpoint {step_dir!r} is corrupted: {'params/' + name!r} does not match its checksum.")
                logical = tuple(meta["params"][name]["shape"])
                leaf = stored[tuple(slice(0, s) for s in logical)]  # a view: write_array streams it
                with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, leaf, allow_pickle=False)
                del tree, stored, leaf
        os.replace(partial, out_path)
    except Exception as e:  # noqa: BLE001
        if os.path.exists(partial):
            os.remove(partial)
        if isinstance(e, UserError):
            raise
        raise UserError(f"checkpoint {step_dir!r} is corrupted or truncated: its parameters cannot be read.") from None
    return {"step": meta["step"], "path": out_path, "params": len(keys), "from": step_dir}


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        *parents, last = [int(p) if p.isdigit() else p for p in name.split("/")]
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree


def load_params(path: str, model=None):
    """Parameters written by `zerojax export`.

    Without `model`: a nested dict of fp32 arrays shaped like the model's params (pass it to
    `Trainer.init(..., params=...)` to fine-tune). With an `nnx.Module`: that module, its
    parameters replaced in place, after checking every name and shape.
    """
    if not os.path.isfile(path):
        raise UserError(f"parameter file {path!r} does not exist.")
    try:
        with np.load(path, allow_pickle=False) as npz:
            flat = {name: npz[name] for name in npz.files}
    except Exception:  # noqa: BLE001
        raise UserError(f"parameter file {path!r} is not a readable .npz written by `zerojax export`.") from None
    if model is None:
        return _unflatten(flat)
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    wanted = {path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(pure)[0]}
    for name in sorted(set(wanted) | set(flat)):
        if name not in flat or name not in wanted or tuple(flat[name].shape) != wanted[name]:
            raise UserError(f"parameter file {path!r} does not fit this model: parameter {name!r} differs.")
    new = jax.tree_util.tree_map_with_path(lambda p, x: jax.numpy.asarray(flat[path_str(p)], x.dtype), pure)
    nnx.replace_by_pure_dict(state, new)
    nnx.update(model, state)
    return model
