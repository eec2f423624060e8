"""The `zerojax` subcommands: a module per subcommand defines `add_parser(subparsers)`, whose parser
sets `run`; a subcommand with parts is a package (`plan/`: its inputs, tables and tensor section), or
names its part (`compare_run`)."""


def add_overrides(parser, help: str = "override a config key, e.g. --set zero.stage=2 (repeatable)") -> None:
    """`--set KEY=VALUE`, repeatable, into `args.overrides`."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def add_devices(parser) -> None:
    """`--devices N`: simulate N CPU devices, set before JAX starts."""
    parser.add_argument("--devices", type=int, default=None, help="simulate N CPU devices (keeps other XLA_FLAGS)")
