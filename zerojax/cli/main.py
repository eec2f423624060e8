"""`zerojax` command line: one module per subcommand under `zerojax/cli/commands/`.

JAX is imported lazily by the subcommands, so `--devices N` can still set `XLA_FLAGS` before the
backend starts.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from zerojax.errors import Preempted, UserError

COMMANDS = ("train", "plan", "compare", "inspect", "verify", "export", "import_hf", "launch", "tokenize", "sample")


def _available_commands() -> list:
    found = []
    for name in COMMANDS:
        try:
            found.append(importlib.import_module(f"zerojax.cli.commands.{name}"))
        except ModuleNotFoundError as e:
            if e.name != f"zerojax.cli.commands.{name}":
                raise
    return found


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one `error:` line with exit status 2."""

    def error(self, message: str):
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zerojax", description="ZeRO stages 0-3 and FSDP for JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in _available_commands():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        return e.exit_code
    except Preempted as e:
        sys.stderr.write(f"stopped: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
