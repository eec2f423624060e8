"""Orbax checkpoints of the train state: asynchronous sharded saves, and restore into any stage and
mesh. (Consolidated fp32 export and `load_params` are in `zerojax.interop.params`.)

A checkpoint is one orbax step directory `DIR/<step>/` with two items:
  state  the saved groups of `TrainState` (`TrainState.SAVED`, those not None) exactly as the run
         stores them (padded where sharded); every process writes only its own shards. The bf16
         compute copy is derived: not saved.
  meta   JSON: each leaf's saved shape, each parameter's logical shape, stage, mesh, the data
         position and seed, the run's config.
Orbax writes `<step>.orbax-checkpoint-tmp` and renames it when complete, so a killed save leaves
only a tmp directory, which is reported and skipped. Restoring reads, per device, just the slice the
*target* layout puts there; where the stored shape differs (padding depends on the fsdp size and
on whether a group is sharded), orbax zero-pads or crops the end of the axis while reading, which
is exact because padding is always zeros at the end of one axis.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time

import jax
import numpy as np

from zerojax.core.state import TrainState
from zerojax.core.trees import path_str
from zerojax.errors import UserError, WriteFailed, first_line
from zerojax.log import warn
from zerojax.train import frozen_part
from zerojax.train.checksums import device_checksums

FORMAT = 1
_TMP_MARK = ".orbax-checkpoint-tmp"


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


def checkpoint_dir(configured: str | None, out_dir: str) -> str:
    """The configured checkpoint directory (checkpoint.dir), or OUT/checkpoints; absolute, as orbax wants."""
    return os.path.abspath(configured or os.path.join(out_dir, "checkpoints"))


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
    raise UserError(
        f"{path!r} holds no complete checkpoint; give a checkpoint step directory or a run's output folder."
    )


# ---- metadata ------------------------------------------------------------------------------------


def _leaf_table(tree, checksums=None) -> dict[str, dict]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    table = {path_str(p): {"shape": list(x.shape), "dtype": str(np.dtype(x.dtype))} for p, x in flat}
    for (p, _), c in zip(flat, jax.tree.leaves(checksums) if checksums is not None else ()):
        table[path_str(p)]["checksum"] = int(c)  # type: ignore[assignment]
    return table


def run_metadata(
    trainer, *, seed: int, config: dict | None = None, model: dict | None = None, source: str | None = None
) -> dict:
    """The parts of a checkpoint's metadata fixed for a whole run. `source`: where the params of a
    fresh start came from (a `train.init_from` file; None: the model's init), which a checkpoint
    holding only the trainable part records for its frozen part."""
    layout = trainer.layout
    params = {
        leaf.path: {"shape": list(leaf.shape), "stored": list(layout.param_shape(leaf))}
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
        # The frozen params are not saved: their names and source here, their fingerprint per save
        "frozen": frozen_part.describe(layout, source or f"the model's init (seed {seed})"),
    }


def item_path(step_dir: str, name: str):
    """The path of one item (`state` or `meta`) of a step directory, made absolute (Orbax reads only
    absolute paths; a relative one was reported as a damaged checkpoint)."""
    from etils import epath

    return epath.Path(os.path.abspath(step_dir)) / name


def state_handler():
    # Handlers, not Checkpointers: these read one item directory and need no step metadata.
    return _ocp().PyTreeCheckpointHandler()


def failure(e: BaseException) -> str | None:
    """What went wrong, when it is not damaged data: a permission, memory or other OS error (orbax
    and tensorstore wrap these in their own types and re-raise them from other threads, so the
    messages of the whole exception chain are read too); else None."""
    seen: list[BaseException] = []
    while e is not None and e not in seen and len(seen) < 16:
        seen.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    for cause in seen:
        why = _os_failure(cause)
        if why is not None:
            return why
    return None


def _os_failure(e: BaseException) -> str | None:
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, PermissionError) or "Permission denied" in text or "PERMISSION_DENIED" in text:
        return "permission denied"
    if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "out of memory"
    for errno_name, words in (
        ("ENOSPC", "No space left on device"),
        ("EFBIG", "File too large"),
        ("EROFS", "Read-only file system"),
        ("EDQUOT", "Disk quota exceeded"),
        ("EIO", "Input/output error"),
    ):
        if words in text:
            return f"{words.lower()} ({errno_name})"
    if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return e.strerror or str(e)
    return None


def unreadable(step_dir: str, what: str, e: BaseException) -> UserError:
    why = failure(e)
    if why is None:
        return UserError(f"checkpoint {step_dir!r} is corrupted or truncated: its {what} cannot be read.")
    return UserError(f"checkpoint {step_dir!r} cannot be read ({why}) while reading its {what}.")


def read_meta(step_dir: str) -> dict:
    ocp = _ocp()
    try:
        meta = ocp.JsonCheckpointHandler().restore(item_path(step_dir, "meta"), args=ocp.args.JsonRestore())
    except Exception as e:  # noqa: BLE001 - tensorstore and orbax raise many types
        if failure(e):
            raise unreadable(step_dir, "metadata", e) from None
        meta = None
    if not isinstance(meta, dict) or not {"format", "step", "params", "leaves"} <= set(meta):
        raise UserError(f"checkpoint {step_dir!r} is corrupted or truncated: its metadata cannot be read.")
    if meta["format"] != FORMAT:
        raise UserError(f"checkpoint {step_dir!r} has format {meta['format']!r}; this zerojax reads format {FORMAT}.")
    return meta


# ---- saving --------------------------------------------------------------------------------------


class _UnretrievedWriteErrors(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" reports (each with a traceback) about
    writes under a watched checkpoint directory. Reports about anything else pass."""

    def __init__(self):
        super().__init__()
        self.directories: set[str] = set()

    def watch(self, directory: str) -> None:
        self.directories |= {directory, os.path.abspath(directory)}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("exception was never retrieved" in text and any(d in text for d in self.directories))


_UNRETRIEVED_WRITE_ERRORS = _UnretrievedWriteErrors()
logging.getLogger("asyncio").addFilter(_UNRETRIEVED_WRITE_ERRORS)  # one filter, however many writers


class CheckpointWriter:
    """Asynchronous sharded saves; orbax keeps the newest `keep` and deletes older ones only after a
    newer save is complete."""

    def __init__(self, directory: str, *, keep: int, run_meta: dict):
        ocp = _ocp()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=True,
            create=True,
            cleanup_tmp_directories=True,  # interrupted saves were reported by `complete_steps`
        )
        self.directory = directory
        self._run_meta = run_meta
        self._step: int | None = None
        self._closed = False
        self._manager = ocp.CheckpointManager(directory, options=options)
        # A failed save's error reaches `save` (orbax re-raises it) and becomes one line; its other
        # writer tasks' errors would also print, as tracebacks, whenever they are garbage-collected.
        _UNRETRIEVED_WRITE_ERRORS.watch(directory)

    def save(self, step: int, state: TrainState) -> None:
        """Returns once the shards are copied off the devices; files are written in the background.
        A failed write (this save's or the previous one's) is a `UserError` naming the step and why."""
        ocp = _ocp()
        frozen = self._run_meta.get("frozen")
        if frozen and "fingerprint" not in frozen:  # the frozen part never changes: hashed once per run
            frozen["fingerprint"] = frozen_part.fingerprint(state.params, frozen["params"])
        saved = frozen_part.left_out(state.saved(), frozen["params"] if frozen else [])
        meta = {
            **self._run_meta,
            "step": step,
            "data": {"position": step, "seed": self._run_meta["seed"]},
            "leaves": _leaf_table(saved, device_checksums(saved)),
        }
        # The previous save's background write first, so a failure is named after its own step.
        self.wait()
        with self._writing(step):
            self._manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.PyTreeSave(saved), meta=ocp.args.JsonSave(meta)),
                force=True,
            )
        self._step = step

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        try:
            yield
        except Exception as e:  # noqa: BLE001 - orbax re-raises the background thread's error
            why = failure(e) or f"{type(e).__name__}: {first_line(e)}"
            self._closed = True  # the manager is unusable now; don't wait for it again
            self._remove_partial()
            raise WriteFailed(
                f"writing the checkpoint of step {step} to {self.directory!r} failed "
                f"({why}); the earlier checkpoints there are intact."
            ) from None

    def _remove_partial(self, settle_s: float = 0.25, limit_s: float = 10.0) -> None:
        """A failed save leaves a tmp folder, removed at once (process 0). Writer threads still in
        flight may recreate parts of it, so remove until it stays gone for `settle_s`."""
        if jax.process_index() != 0:
            return
        deadline = time.monotonic() + limit_s
        while True:
            partial = [
                os.path.join(self.directory, n)
                for n in (os.listdir(self.directory) if os.path.isdir(self.directory) else ())
                if _TMP_MARK in n
            ]
            for path in partial:
                shutil.rmtree(path, ignore_errors=True)
            if not partial or time.monotonic() > deadline:
                return
            time.sleep(settle_s)

    def wait(self) -> None:
        with self._writing(self._step):
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight; idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._writing(self._step):
            self._manager.close()


# ---- restoring -----------------------------------------------------------------------------------


def _check_model(meta: dict, layout, step_dir: str) -> None:
    saved = {p: tuple(v["shape"]) for p, v in meta["params"].items()}
    here = {l.path: l.shape for l in jax.tree.leaves(layout.leaves, is_leaf=lambda x: hasattr(x, "padded_shape"))}
    for path in sorted(set(saved) | set(here)):
        if path not in here:
            raise UserError(
                f"checkpoint {step_dir!r} is from another model: it has parameter {path!r}, which this model lacks."
            )
        if path not in saved:
            raise UserError(
                f"checkpoint {step_dir!r} is from another model: it lacks parameter {path!r} of this model."
            )
        if saved[path] != here[path]:
            raise UserError(
                f"checkpoint {step_dir!r} is from another model: parameter {path!r} has shape "
                f"{saved[path]} there but {here[path]} here."
            )


def _check_leaves(meta: dict, target: dict, step_dir: str) -> None:
    saved, here = meta["leaves"], _leaf_table(target)
    differ = sorted(set(saved) ^ set(here)) or [p for p in sorted(here) if saved[p]["dtype"] != here[p]["dtype"]]
    if differ:
        raise UserError(
            f"checkpoint {step_dir!r} holds the state of another optimizer ({differ[0]!r} does not "
            "match); resume with the optimizer it was trained with."
        )


def restore(trainer, step_dir: str, key=None, batch: dict | None = None, base=None) -> tuple[TrainState, dict]:
    """(state, meta): the checkpoint in `step_dir`, placed as `trainer` (any stage, any mesh) wants:
    a `Trainer` prepared for `key` and `batch` (the state is then the one it steps), or a
    `zerojax.train.shard.Sharded` (`zj.shard`; no key or batch needed).

    A checkpoint without its frozen part takes it from `base` (a fresh state of this trainer, from
    the same source), after checking it against the saved fingerprint.

    Each device reads only its own slice; nothing is gathered. Raises `UserError` for a checkpoint of
    another model or optimizer, or a damaged one, before any state is changed.
    """
    ocp = _ocp()
    meta = read_meta(step_dir)
    prep = trainer.prepare(key, batch) if hasattr(trainer, "prepare") else trainer
    frozen = (meta.get("frozen") or {}).get("params", [])
    if frozen and base is None:
        raise UserError(
            f"checkpoint {step_dir!r} holds only the trainable params; restore it with the frozen part's source."
        )
    target = frozen_part.left_out(prep.abstract_state().saved(), frozen)
    _check_model(meta, prep.layout, step_dir)
    _check_leaves(meta, target, step_dir)
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)

    def args_for(path, t):
        stored = tuple(meta["leaves"][path_str(path)]["shape"])
        # Only leaves whose padding differs between the two layouts may be padded or cropped.
        return ocp.ArrayRestoreArgs(
            sharding=t.sharding, global_shape=t.shape, dtype=t.dtype, strict=stored == tuple(t.shape)
        )

    restore_args = jax.tree_util.tree_unflatten(treedef, [args_for(p, t) for p, t in flat])
    try:
        saved = state_handler().restore(
            item_path(step_dir, "state"), args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
        )
    except Exception as e:  # noqa: BLE001 - tensorstore and orbax raise many types for damaged files
        raise unreadable(step_dir, "arrays", e) from None
    _verify(meta, saved, step_dir)
    if frozen:
        saved = frozen_part.rebuilt(meta, saved, base.params, step_dir)
    state = trainer.restore_state(saved, key, batch) if hasattr(trainer, "prepare") else prep.restore_state(saved)
    return state, meta


def _verify(meta: dict, saved: dict, step_dir: str) -> None:
    """Checksums of the leaves restored at their stored shape (padded or cropped ones can't match)."""
    flat = jax.tree_util.tree_flatten_with_path(saved)[0]
    for (p, x), c in zip(flat, device_checksums(saved)):
        want = meta["leaves"][path_str(p)]
        if list(x.shape) == want["shape"] and want.get("checksum", c) != c:
            raise UserError(f"checkpoint {step_dir!r} is corrupted: {path_str(p)!r} does not match its checksum.")
