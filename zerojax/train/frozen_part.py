"""The frozen part of a checkpoint (`trainable=`): a run with frozen params saves only the trainable
ones and a fingerprint of the rest. The frozen part never changes, so a resume rebuilds it from its
source (`train.init_from`, or the model's init) and refuses one whose fingerprint differs."""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np

from zerojax.core.trees import filled, path_str
from zerojax.errors import UserError
from zerojax.train.checksums import device_checksums


def describe(layout, source: str) -> dict | None:
    """A checkpoint's metadata of the frozen part (None where everything trains): its source and
    names; `fingerprint` is added at the first save."""
    frozen = [l.path for l in layout.frozen_leaves()]
    return {"source": source, "params": frozen} if frozen else None


def left_out(saved: dict, frozen: list[str]) -> dict:
    """The saved groups with each frozen param left out (None)."""
    if not frozen:
        return saved
    params = jax.tree_util.tree_map_with_path(lambda p, x: None if path_str(p) in frozen else x, saved["params"])
    return {**saved, "params": params}


def fingerprint(params, frozen: list[str]) -> dict:
    """The fingerprint of the `frozen` leaves of `params` (stored leaves; their sums are computed on
    the devices)."""
    leaves = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if path_str(p) in frozen}
    sums = device_checksums(list(leaves.values())) if leaves else []
    return fingerprint_of({path: (x.dtype, c) for (path, x), c in zip(leaves.items(), sums)})


def fingerprint_of(leaves: dict) -> dict:
    """A hash of the frozen leaves' names, dtypes and checksums ({path: (dtype, checksum)}). Shapes
    are left out: a stored leaf may be padded; every parameter's shape is checked apart."""
    table = {path: {"dtype": str(np.dtype(dtype)), "checksum": int(c)} for path, (dtype, c) in leaves.items()}
    text = json.dumps(table, sort_keys=True)
    return {"params": len(table), "hash": hashlib.sha256(text.encode()).hexdigest()}


def rebuilt(meta: dict, saved: dict, base_params, step_dir: str) -> dict:
    """`saved` with its frozen params from `base_params` (a fresh state's, from the same source),
    which must match the checkpoint's fingerprint."""
    frozen = meta["frozen"]
    if fingerprint(base_params, frozen["params"])["hash"] != frozen["fingerprint"]["hash"]:
        raise UserError(
            f"checkpoint {step_dir!r} was trained on another frozen part (from {frozen['source']}): this "
            "run's frozen params differ; resume with the same train.init_from and model."
        )
    return {**saved, "params": filled(saved["params"], base_params)}
