"""`verify`: the user's model at its stage and engine against the same model at stage 0.

Both trainers start from the same key and train on the same batches for a few steps; the check
reports the largest relative difference of the loss and of the gradient norm over those steps, and
of each parameter's total update (params after minus params before). A parameter the model saw as
a shard, or whose gradient was reduced wrongly, moves differently from stage 0's: the worst leaf is
named. Above the tolerance of the precision, the check fails.

Tolerances, (loss and gradient norm, updates): fp32 (1e-5, 1e-4): the same arithmetic summed in
another order (measured on the test models: 1e-7 and 2e-6). bf16 (2e-3, 0.1): gathers and reductions
round at other points (measured: 1e-4 to 4e-4 in the loss and gradient norm, and up to 5e-2 in an
update, since Adam's first steps move every element by about the learning rate whatever its
gradient's size, so a rounding that flips a tiny gradient's sign moves the element the other way).
A model handed a shard, or a gradient reduced wrongly, is off by 1e-1 to 1 or more.

The reference runs under `gspmd`, which draws random numbers (dropout masks, noise) over the global
batch at every stage. `shard_map` draws them per device, so for a step that draws any (found in its
traced program) the reference runs under `shard_map` too, and draws the same. Accumulating
micro-batches, it runs them as the step does, whole or per data-parallel group (`Setup.reference`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import jax
import numpy as np

from zerojax.core.jaxprs import inner_jaxprs
from zerojax.core.trees import path_str
from zerojax.errors import UserError
from zerojax.train.shard import prepare

TOLERANCE = {"fp32": (1e-5, 1e-4), "bf16": (2e-3, 0.1)}  # (loss and gradient norm, updates)


@dataclass(frozen=True)
class Verification:
    """What `verify` measured; `passed` when every difference is within `tolerance`."""

    steps: int
    losses: list[float]  # the trainer's, per step
    reference_losses: list[float]  # stage 0's
    loss_diff: float  # the largest relative difference of the loss over the steps
    grad_norm_diff: float  # ... of the gradient norm
    worst_leaf: str  # the parameter whose total update differs most from stage 0's
    update_diff: float  # its relative difference (norm of the difference / norm of stage 0's update)
    tolerance: tuple[float, float]  # (loss and gradient norm, updates)
    update_diffs: dict  # every parameter's relative update difference, by path
    route: str  # how the trainer gathers the params (its gather report)
    reference_engine: str = "gspmd"  # the engine stage 0 ran under: the trainer's, where it draws per device

    @property
    def passed(self) -> bool:
        return max(self.loss_diff, self.grad_norm_diff) <= self.tolerance[0] and self.update_diff <= self.tolerance[1]

    def lines(self) -> list[str]:
        def row(name, value, tol, what=""):
            return f"  {name:<14} {value:.2e} (tolerance {tol:.0e}){what}{'' if value <= tol else '  <- over'}"

        return [
            f"{'PASS' if self.passed else 'FAIL'}: {self.steps} steps against stage 0"
            + (
                " under shard_map (the step draws random numbers per device)"
                if self.reference_engine != "gspmd"
                else ""
            )
            + ", largest relative differences:",
            row("loss", self.loss_diff, self.tolerance[0]),
            row("gradient norm", self.grad_norm_diff, self.tolerance[0]),
            row("update", self.update_diff, self.tolerance[1], f", parameter {self.worst_leaf}"),
            f"  gathers        {self.route}",
        ]


def verify(
    trainer,
    batches: dict | Iterable[dict],
    steps: int = 3,
    key=None,
    tolerance: tuple[float, float] | None = None,
    reference=None,
) -> Verification:
    """Train `trainer` and its stage-0 reference (`Setup.reference`, or the `reference` Setup given)
    for `steps` steps on `batches` (one dict, repeated, or one per step) from the same `key`, and
    compare them (see the module doc)."""
    batches = [batches] * steps if isinstance(batches, dict) else list(batches)[:steps]
    if len(batches) < steps or steps < 1:
        raise ValueError(
            f"verify needs at least one step and a batch per step, got {steps} steps, {len(batches)} batches"
        )
    key = jax.random.key(0) if key is None else key
    if reference is None:
        draws = _per_group_alone(trainer) or trainer.engine == "shard_map"
        draws = draws and _draws(trainer, key, batches[0])
        if draws and _per_group_alone(trainer):
            raise UserError(
                "verify cannot compare this step: keeping its gathered weights without accumulation, the gspmd "
                "engine runs the model once per data-parallel group and draws its random numbers per group, as no "
                "stage-0 step does; verify it with zero.reshard_after_forward=true (the same state and sharding)."
            )
        reference = trainer.setup.reference(same_engine=draws)
    ref = prepare(reference, key, batches[0])
    runs = [
        _train(lambda: trainer.init(key, batches[0]), trainer.step, lambda: trainer.layout, batches),
        _train(
            lambda: ref.init(key), lambda state, b: ref.step_fn(state, ref.shard_batch(b)), lambda: ref.layout, batches
        ),
    ]
    (losses, norms, before, after), (ref_losses, ref_norms, ref_before, ref_after) = runs
    diffs = {path: _relative(after[path] - before[path], ref_after[path] - ref_before[path]) for path in ref_after}
    worst = max(diffs, key=diffs.get) if diffs else "-"  # type: ignore[arg-type]
    if tolerance is None:
        tolerance = TOLERANCE["bf16" if trainer.precision.compute_dtype != np.float32 else "fp32"]
    return Verification(
        steps,
        losses,
        ref_losses,
        _largest(losses, ref_losses),
        _largest(norms, ref_norms),
        worst,
        diffs.get(worst, 0.0),
        tolerance,
        diffs,
        trainer.gather_report().description,
        ref.setup.choices.engine,
    )


_RANDOM_PRIMITIVES = ("random_bits", "threefry2x32")  # what drawing random numbers traces to


def _per_group_alone(trainer) -> bool:
    """gspmd at stage 3 keeping its gathered weights without accumulation: the one step that runs
    the model per data-parallel group (`zerojax.engines.gspmd_accum`) where no stage-0 step does."""
    return trainer.setup.runs_per_group and trainer.grad_accum == 1


def _draws(trainer, key, batch: dict) -> bool:
    """Whether the trainer's step draws random numbers (its traced program holds a draw: the step
    key's folds alone are not one)."""
    prep = trainer.prepare(key, batch)
    return _holds_draw(prep.step_fn.trace(prep.abstract_state(), trainer.shard_batch(batch)).jaxpr.jaxpr)


def _holds_draw(jaxpr) -> bool:
    return any(
        eqn.primitive.name in _RANDOM_PRIMITIVES or any(_holds_draw(inner) for inner in inner_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def _train(init, step, layout_of, batches: list[dict]):
    """(losses, gradient norms, params before, params after) of a step per batch from `init()` (the
    layout, `layout_of()`, is known once the state is)."""
    state = init()
    layout = layout_of()
    before = _logical(layout, state)
    losses, norms = [], []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return losses, norms, before, _logical(layout, state)


def _logical(layout, state) -> dict[str, np.ndarray]:
    """The master params in their logical shapes, on this host, by path."""
    whole = jax.jit(lambda p: layout.to_layout(p, sharded=False), out_shardings=layout.replicated)(state.params)
    flat = jax.tree_util.tree_flatten_with_path(whole)[0]
    return {path_str(path): np.asarray(x, np.float64) for path, x in flat}


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.linalg.norm(want))
    diff = float(np.linalg.norm(got - want))
    return diff / scale if scale > 0 else diff


def _largest(got: list[float], want: list[float]) -> float:
    return (
        max((abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want)), default=0.0)
        if all(np.isfinite(got))
        else float("inf")
    )
