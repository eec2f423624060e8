"""The one exception type for bad user input; the CLI turns it into `error: ...` and exit status 2."""


class UserError(ValueError):
    """Bad input from the user (config, data path, checkpoint, device counts): one clear sentence."""
