"""Output folders: checked before anything is computed or written (one sentence naming the key), and
written whole or not at all (built in a hidden sibling, then renamed into place)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable

from zerojax.errors import UserError


def check_writable_dir(path: str, key: str) -> None:
    """`path` is a folder this process can write, or can be created as one; else a `UserError`."""
    full = os.path.abspath(path)
    probe = full
    while not os.path.exists(probe):  # the nearest existing ancestor must be a writable folder
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        where = "is a file" if probe == full else f"is under {probe!r}, which is a file"
        raise UserError(f"{key} {path!r} {where}; give a folder (it is created if missing).")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "" if probe == full else f" (its existing parent {probe!r} is not)"
        raise UserError(f"{key} {path!r} is not writable{where}; give a folder you can write to.")


def check_out_folder(out: str, ours: Iterable[str], what: str) -> None:
    """`out` can be (re)written: its parent is a writable folder and `out` is missing, empty, or holds
    only the files `ours` names (an earlier `what`, which it replaces); else one `UserError`."""
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UserError(f"output folder {out!r} cannot be made: its parent {parent!r} is not a folder.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"output folder {out!r} cannot be made: its parent {parent!r} is not writable.")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"{out!r} is a file; give a new folder for the {what}.")
    other = sorted(set(os.listdir(out)) - set(ours)) if os.path.isdir(out) else []
    if other:
        raise UserError(f"{out!r} already holds {other[0]!r}, which is not part of a {what}; give a new folder.")


def write_folder(out: str, write: Callable[[str], None]) -> None:
    """`write(folder)` fills a hidden sibling of `out`, which then replaces `out`: a failure leaves
    `out` as it was and no sibling behind."""
    out = os.path.abspath(out)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=os.path.dirname(out))
    try:
        os.chmod(staging, 0o755)  # mkdtemp's folder is private; an output folder is not
        write(staging)
        if os.path.isdir(out):  # an earlier output of the same kind (check_out_folder)
            old = staging + ".old"
            os.rename(out, old)
            os.rename(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
