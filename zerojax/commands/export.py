"""`zerojax export CKPT OUT`: a checkpoint's master params as one fp32 .npz keyed by parameter path."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint's params, consolidated fp32, to an .npz")
    p.add_argument("checkpoint", help="a checkpoint step folder, a checkpoint folder (latest step) or a run's --out")
    p.add_argument("out", help="the .npz file to write (load it with zerojax.load_params)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os

    # One host device is enough: leaves are read one at a time into host memory.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from zerojax.export import export_params
    from zerojax.log import quiet_orbax

    quiet_orbax()
    info = export_params(args.checkpoint, args.out)
    print(
        f"exported {info['params']} parameters of step {info['step']} from {info['from']} to {info['path']}",
        file=sys.stderr,
    )
    return 0
