"""Consolidated parameters: `export_params` writes a checkpoint's master params, fp32 and in logical
shapes, to an .npz; `zerojax.train.params_file.load_params` reads one back (as a dict, or into an NNX module)."""

from __future__ import annotations

import os
import zipfile

import jax
import numpy as np

from zerojax.core.precision import PRECISIONS
from zerojax.core.trees import path_str
from zerojax.errors import UserError
from zerojax.train.checkpoint import failure, find_step_dir, item_path, read_meta, state_handler, unreadable
from zerojax.train.checksums import host_checksum
from zerojax.train.frozen_part import fingerprint_of
from zerojax.train.params_file import MODEL_STATE_ENTRY


def _nested(keys: tuple, leaf) -> dict:
    tree = leaf
    for k in reversed(keys):
        tree = {k: tree}
    return tree


def _dig(tree, keys: tuple):
    for k in keys:
        tree = tree[k]
    return tree


def _param_keys(step_dir: str, group: str = "params") -> list[tuple]:
    """Each leaf's key path (the dict keys, as saved) under the checkpoint's `group`."""
    tree = state_handler().metadata(item_path(step_dir, "state")).tree.get(group, {})
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [tuple(getattr(k, "key", getattr(k, "idx", None)) for k in p) for p, _ in paths]


def export_params(checkpoint: str, out_path: str) -> dict:
    """Write the master params, fp32 and in logical shapes, to an .npz keyed by parameter path, and the
    model state (BatchNorm statistics) keyed by collection name and path ("batch_stats/bn/mean"); the
    entry `__model_state__` lists those collections.

    Streams one leaf at a time (read, crop, write), so host memory peaks near the largest leaf. The
    file appears only when complete (written beside it, then renamed).
    """
    step_dir = find_step_dir(checkpoint)
    meta = read_meta(step_dir)
    out_path = out_path if out_path.endswith(".npz") else out_path + ".npz"
    partial = f"{out_path}.partial"
    _check_target(out_path, partial)
    handler = state_handler()
    try:
        keys = _param_keys(step_dir)
        state_keys = _param_keys(step_dir, "model_state")
    except Exception as e:  # noqa: BLE001
        raise unreadable(step_dir, "parameters", e) from None
    try:
        zf = zipfile.ZipFile(partial, "w", allowZip64=True)
    except OSError as e:
        raise UserError(f"cannot write {partial!r}: {e.strerror or e}.") from None
    frozen = _frozen_source(step_dir, meta)
    try:
        with zf:
            if frozen:
                _write_frozen(zf, step_dir, meta, frozen)
            for group, k in [("params", k) for k in keys] + [("model_state", k) for k in state_keys]:
                name = path_str(k)
                with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, _read_leaf(handler, step_dir, meta, group, k), allow_pickle=False)
            if state_keys:
                with zf.open(f"{MODEL_STATE_ENTRY}.npy", "w") as f:
                    collections = sorted({str(k[0]) for k in state_keys})
                    np.lib.format.write_array(f, np.array(collections), allow_pickle=False)
        os.replace(partial, out_path)
    except Exception as e:  # noqa: BLE001
        if os.path.isfile(partial):
            os.remove(partial)
        if isinstance(e, UserError):
            raise
        if isinstance(e, OSError) and e.filename is None and failure(e):  # zipfile's own write to `partial`
            raise UserError(f"writing {out_path!r} failed ({failure(e)}); nothing was written.") from None
        raise unreadable(step_dir, "parameters", e) from None
    return {
        "step": meta["step"],
        "path": out_path,
        "params": len(keys) + len(frozen["params"] if frozen else ()),
        "model_state": len(state_keys),
        "from": step_dir,
    }


def _frozen_source(step_dir: str, meta: dict) -> dict | None:
    """The checkpoint's frozen part (`trainable=`: its params are left out of the checkpoint) where
    it has one, whose source must be a params file export can read them from."""
    frozen = meta.get("frozen")
    if frozen and not os.path.isfile(frozen["source"]):
        raise UserError(
            f"checkpoint {step_dir!r} holds only the trainable params; its frozen part is {frozen['source']}, "
            "which export cannot rebuild: export a run that starts from a params file (train.init_from)."
        )
    return frozen


def _write_frozen(zf, step_dir: str, meta: dict, frozen: dict) -> None:
    """The frozen params into `zf`, one leaf at a time, read from the params file the run started
    from, as the run computed with them (in its compute dtype), then fp32. A part other than the
    checkpoint's fingerprint says is one `UserError` (the caller removes what was written)."""
    source, compute = frozen["source"], PRECISIONS[meta["precision"]].compute_dtype
    seen = {}
    with np.load(source, allow_pickle=False) as npz:
        for name in frozen["params"]:
            if name not in npz.files:
                break
            x = npz[name].astype(compute)
            seen[name] = (x.dtype, host_checksum(x))
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, x.astype(np.float32), allow_pickle=False)
    if len(seen) != len(frozen["params"]) or fingerprint_of(seen) != frozen["fingerprint"]:
        raise UserError(
            f"checkpoint {step_dir!r} was trained on another frozen part than {source!r} now holds; "
            "export needs the params file the run started from."
        )


def _check_target(out_path: str, partial: str) -> None:
    """The .npz can be written: its folder exists and is writable, nothing folder-like in the way."""
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise UserError(f"output folder {out_dir!r} does not exist.")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise UserError(f"output folder {out_dir!r} is not writable; give an .npz path in a folder you can write to.")
    for path in (out_path, partial):
        if os.path.isdir(path):
            raise UserError(
                f"{path!r} is a folder; export writes a file there, so give another .npz path or move the folder away."
            )


def _read_leaf(handler, step_dir: str, meta: dict, group: str, k: tuple) -> np.ndarray:
    """One saved leaf on the host, checksum-verified; params as fp32 in their logical shape (a view)."""
    import orbax.checkpoint as ocp

    name = path_str(k)
    if group == "params" and name not in meta["params"]:
        raise KeyError(name)
    args = _nested((group, *k), ocp.RestoreArgs(restore_type=np.ndarray))
    tree = handler.restore(
        item_path(step_dir, "state"),
        args=ocp.args.PyTreeRestore(item=_nested((group, *k), 0), restore_args=args, partial_restore=True),
    )
    stored = np.asarray(_dig(tree, (group, *k)))
    want = meta["leaves"][f"{group}/{name}"]
    if "checksum" in want and want["checksum"] != host_checksum(stored):
        raise UserError(f"checkpoint {step_dir!r} is corrupted: {group + '/' + name!r} does not match its checksum.")
    if group == "params":  # model state is replicated: stored in its logical shape
        logical = tuple(meta["params"][name]["shape"])
        stored = np.asarray(stored, dtype=np.float32)[tuple(slice(0, s) for s in logical)]
    return stored
