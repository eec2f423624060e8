"""The face: the config file, the experiment it builds, user code by dotted name, the launcher and one
module per subcommand. Nothing below imports it."""
