"""The exceptions the CLI turns into one line and a documented exit status, never a traceback.

UserError  bad input (config, data path, checkpoint, output folder, device counts): exit 2
Diverged   train.max_bad_steps non-finite steps in a row; the last good checkpoint is kept: exit 3
Preempted  SIGTERM (or JAX's preemption notice): a checkpoint of the last step is complete: exit 75
"""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message ("" for an empty one): what a one-line report quotes."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


class UserError(ValueError):
    """Bad input from the user (config, data path, checkpoint, device counts): one clear sentence."""

    exit_code = 2


class WriteFailed(UserError):
    """A checkpoint could not be written (disk full, quota, permission); the earlier ones are intact."""


class Diverged(UserError):
    """Training stopped after `train.max_bad_steps` consecutive non-finite steps."""

    exit_code = 3


class Preempted(Exception):
    """Training stopped on a termination request after a complete checkpoint (resume with --resume)."""

    exit_code = 75  # EX_TEMPFAIL: try again later
