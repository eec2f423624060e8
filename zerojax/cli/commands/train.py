"""`zerojax train CONFIG [--set KEY=VALUE]... [--devices N] [--out DIR] [--resume]`."""

from __future__ import annotations

import argparse
import sys

from zerojax.cli import distributed
from zerojax.cli.commands import add_devices, add_overrides


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train the shipped GPT, or the model.target / data.target a YAML config names")
    p.add_argument("config", help="YAML experiment config, e.g. configs/tiny.yaml")
    add_overrides(p)
    add_devices(p)
    p.add_argument("--out", default="runs/latest", help="output folder for metrics.jsonl and summary.json")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in OUT (or checkpoint.dir); "
        "start from scratch with a warning when there is none yet",
    )
    distributed.add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zerojax.cli.config import load_config
    from zerojax.core.mesh import simulate_cpu_devices
    from zerojax.folders import check_writable_dir

    config = load_config(args.config, args.overrides)  # before JAX starts: bad input fails fast
    check_writable_dir(args.out, "--out")
    if config.checkpoint.dir:
        check_writable_dir(config.checkpoint.dir, "checkpoint.dir")
    spec = distributed.spec_from_args(args)
    distributed.apply_compiler_flags(config.xla.flags, config.xla.libtpu_flags)
    if args.devices is not None:
        simulate_cpu_devices(args.devices)
    distributed.initialize(spec)  # before any other JAX call
    if spec.enabled:
        print(f"zerojax: {distributed.describe()}", file=sys.stderr, flush=True)

    import logging

    from zerojax.cli.experiment import build_experiment, fit_options
    from zerojax.errors import WriteFailed
    from zerojax.log import quiet_orbax, release_thread_errors
    from zerojax.train.fit import begin, fit
    from zerojax.train.progress import compiling, summary_table, training_progress

    quiet_orbax(logging.CRITICAL)  # a failed write is reported once, as an `error:` line
    with distributed.fail_fast(spec):  # a dead peer ends this process too, never a hang
        exp = build_experiment(config)
        options = fit_options(config, exp.model_meta)
        # A bad checkpoint fails here, before the progress bar.
        with compiling("the step"):
            start = begin(exp.trainer, exp.train_data, args.out, options, resume=args.resume)
        try:
            with training_progress(config.train.steps) as on_step:
                summary = fit(
                    exp.trainer,
                    exp.train_data,
                    args.out,
                    eval_source=exp.eval_data,
                    options=options,
                    on_step=on_step,
                    start=start,
                )
        except WriteFailed as e:
            _leave_now(e)
        release_thread_errors()
        summary_table(summary, args.out)
    return 0


def _leave_now(e) -> None:
    """After a failed checkpoint write: the one line, then exit at once. Orbax's writes still in
    flight would otherwise print tracebacks from tensorstore's threads while Python shuts down."""
    import os

    sys.stderr.write(f"error: {e}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(e.exit_code)
