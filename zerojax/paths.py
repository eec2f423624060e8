"""Output folders: checked before anything is computed or written, as one sentence naming the key."""

from __future__ import annotations

import os

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
