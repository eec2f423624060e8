"""The choices a sharded step is built from: the keyword arguments of `Trainer`, `zj.shard` and
`Setup.of`, declared once here with their types and defaults."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerojax.errors import UserError


@dataclass(frozen=True)
class Choices:
    mesh: Any = None  # a `zj.make_mesh` mesh; None: every device on fsdp
    stage: int = 0  # the ZeRO stage, 0-3
    engine: str = "gspmd"  # "gspmd" or "shard_map" (docs/engines.md)
    precision: str = "fp32"  # "fp32" or "bf16" (bf16 compute, fp32 master and moments)
    loss_fn: Callable | None = None  # (outputs, batch) -> scalar or zj.WeightedLoss; None: cross-entropy
    reduce_dtype: str | None = None  # the gradient reduction's dtype; None: the precision's
    replicate_below_bytes: int = 2048  # leaves smaller than this stay whole on every device
    engine_options: Any = None  # `EngineOptions` or a dict of its fields
    rng_streams: tuple[str, ...] | None = None  # a Linen model's make_rng streams, keyed each step; None: dropout
    grad_accum: int = 1  # micro-batches per step
    microbatches: int | None = None  # a `pipeline` mesh axis: GPipe microbatches per step; None: one a stage
    pipeline_repeats: int = 1  # layer chunks per pipeline device: more than 1 runs the circular schedule
    offload: str = "none"  # "none", "optimizer" or "optimizer+params" (docs/offload.md)
    axis_rules: Any = None  # logical or foreign axis name -> mesh axis (`zerojax.core.axis_rules`)
    # what trains (`zerojax.core.trainable`): a regex over param paths, (path, leaf) -> bool, an NNX
    # filter; None: everything, or the `nnx.LoRAParam`s alone where the model holds some
    trainable: Any = None

    @classmethod
    def of(cls, **given) -> Choices:
        """The choices given by keyword; an unknown keyword is one `UserError` listing the valid ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise UserError(f"unknown option {unknown[0]!r}; the options are {', '.join(names)}.")
        return cls(**given)

    def given(self) -> dict:
        """The choices as keyword arguments (shallow: the mesh and model functions are not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def with_choices(fn: Callable) -> Callable:
    """`fn(..., **choices)` with the choices' keywords in its signature (for `help` and editors)."""
    signature = inspect.signature(fn)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(Choices)
    ]
    fn.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return fn
