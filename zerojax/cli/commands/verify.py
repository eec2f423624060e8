"""`zerojax verify CONFIG [--set KEY=VALUE]... [--devices N] [--steps 3]`: the config's model at its
stage and engine against the same model at stage 0 (`zerojax.train.verify`); exit 1 above tolerance."""

from __future__ import annotations

import argparse

from zerojax.cli.commands import add_devices, add_overrides


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="check the config's model trains as at stage 0 (run once on a new model)")
    p.add_argument("config", help="YAML experiment config, e.g. configs/tiny.yaml")
    add_overrides(p)
    add_devices(p)
    p.add_argument("--steps", type=int, default=3, help="steps to compare (default 3)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zerojax.cli.config import load_config
    from zerojax.core.mesh import simulate_cpu_devices
    from zerojax.errors import UserError

    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}.")
    config = load_config(args.config, args.overrides)
    if args.devices is not None:
        simulate_cpu_devices(args.devices)

    import jax

    from zerojax.cli.experiment import build_experiment
    from zerojax.data import sources
    from zerojax.train.progress import compiling

    exp = build_experiment(config)
    trainer, c = exp.trainer, config
    batches = [sources.host_batch(exp.train_data, step) for step in range(args.steps)]
    print(
        f"zerojax verify: stage {c.zero.stage}, {c.zero.engine}, {c.precision}, {trainer.mesh.size} devices, "
        f"against stage 0 for {args.steps} steps",
        flush=True,
    )
    with compiling("the step and its stage-0 reference"):
        result = trainer.verify(batches, steps=args.steps, key=jax.random.key(c.train.seed))
    print("\n".join(result.lines()))
    return 0 if result.passed else 1
