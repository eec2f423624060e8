"""One module per `zerojax` subcommand: each defines `add_parser(subparsers)`; the parser sets `run`."""
