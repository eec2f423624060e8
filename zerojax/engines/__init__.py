"""Train-step engines behind one interface.

An engine is a builder registered under a name:

    build(layout, model, static, loss_fn, tx, options, inputs) -> BuiltStep(grads, update, report)

An engine that lists "grad_accum" in its `SUPPORTS` also takes `grad_accum=k` (k > 1): k micro-batches
per step (see `zerojax.engines.accum`).

`grads` and `update` are pure, and so is their composition `step(state, batch) -> (state, metrics)`
(the trainer jits it); `report` says how the compute params are materialised, decided when the step
is built. `options` is one `EngineOptions`;
an engine names the options it supports (`Engine.supports`), and any other option set away from its
default is a `UserError` naming the engine. A new engine is a module with a `build` function and
its entry in `_BUILTIN` (or a `register` call).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from zerojax.errors import UserError

_BUILTIN = {"gspmd": "zerojax.engines.gspmd", "shard_map": "zerojax.engines.shard_map"}
ENGINES = tuple(_BUILTIN)  # the names a config may choose


@dataclass(frozen=True)
class EngineOptions:
    """Every engine option; each engine supports some of them (see `Engine.supports`)."""

    # a model taking `layer_hook` that declares no `layer_stacks` of its own: the top-level param names
    # stacking its layers on axis 0 (an explicit opt-in; never guessed from a name)
    layer_stacks: tuple[str, ...] = ()
    prefetch: bool = False  # stage 3: gather layer (or FSDP unit) i+1 while layer i computes
    wrap: Any = "auto"  # FSDP units for models without a layer hook: "auto", "none", classes, a WrapRule
    # stage 3: False keeps the gathered weights for the whole step (every micro-batch of a gradient
    # accumulation, forward and backward): one gather and one reduce-scatter per step, full-size weights
    # and gradient held meanwhile (FSDP2's name)
    reshard_after_forward: bool = True
    # ZeRO++ (see `zerojax.engines.quantize`): "int8" or "fp8" stage-3 weight gathers (qwZ), "int8"
    # gradient reduce-scatters as all-to-alls summed in fp32 (qgZ); one fp32 scale per block of elements
    quantize_weights: str | None = None
    quantize_grads: str | None = None
    quantize_block: int = 256
    # ZeRO++ hpZ, stage 3: the fp32 state sharded over fsdp x data, a compute-dtype secondary copy over
    # fsdp only, gathered over data once per step; the layers' gathers then never cross data
    hierarchical: bool = False
    # also refuse a step whose new state (not only its loss and gradient norm) is non-finite: two
    # optimizer passes, several times the compile time (docs/engines.md, "The update")
    checked_update: bool = False
    # stage 3 on a `pipeline` mesh axis: "per_step" gathers each pipeline stage's weights once per
    # step and keeps them for every microbatch; "per_microbatch" gathers each layer as it runs, for
    # every microbatch (least memory, m + p - 1 times the gathers)
    pipeline_gather: str = "per_step"
    # gspmd, grad_accum > 1 at stages 0-2: run each micro-batch on all of its rows and reduce its
    # gradient as it is made (k reductions a step), drawing random numbers and computing a model's own
    # statistics as stage 3 does. Default: once per data-parallel group, one reduction a step
    # (docs/engines.md, "Gradient accumulation")
    whole_micro_batches: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_stacks", tuple(self.layer_stacks))

    @classmethod
    def of(cls, options: EngineOptions | dict | None) -> EngineOptions:
        if isinstance(options, cls):
            return options
        options = dict(options or {})  # type: ignore[arg-type]
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            valid = ", ".join(f.name for f in dataclasses.fields(cls))
            raise UserError(f"unknown engine option {unknown[0]!r}; valid options are {valid}.")
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name, value in options.items():  # a truthy "no" for a switch would turn it on
            if types[name] == "bool" and not isinstance(value, bool):
                raise UserError(f"engine option {name} is True or False; got {value!r}.")
            if types[name] == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise UserError(f"engine option {name} is an integer; got {value!r}.")
        return cls(**options)


@dataclass(frozen=True)
class GatherReport:
    """How compute params are materialised: `route` is "replicated", "layers", "units" or "whole"."""

    route: str
    description: str
    # what the model's traces dropped from its own shardings (`zerojax.core.model_mesh`), once traced
    notes: tuple[str, ...] = ()


def replicated_report(stage) -> GatherReport:
    """Stages that keep the compute params whole on every device."""
    return GatherReport("replicated", f"stage {stage.index}: compute params are replicated")


def kept_whole_report(stage) -> GatherReport:
    """Stage 3 with `reshard_after_forward=False`."""
    text = "the whole model gathered once per step and kept for every micro-batch"
    return GatherReport("whole", f"stage {stage.index}, reshard_after_forward=False: {text}")


class BuiltStep(NamedTuple):
    # (state, batch) -> (loss, grads, model_state): the gradients reduced and laid out as the stage
    # stores them (shards from stage 2 on)
    grads: Callable
    # (state, loss, grads, model_state) -> (state, metrics): the sharded optimizer update, which keeps
    # the old state where the loss or the gradient norm is not finite
    update: Callable
    report: GatherReport
    # (state, batch, loss_fn) -> loss in eval mode, gathering as the step's forward does; None: the
    # trainer's plain eval (the model applied to the compute params, partitioned by XLA)
    evaluate: Callable | None = None
    # XLA options the step is compiled with (`jax.jit(..., compiler_options=dict(...))`)
    compiler_options: tuple[tuple[str, str], ...] = ()

    def step(self, state, batch):
        """(state, batch) -> (state, metrics): `update` after `grads`."""
        return self.update(state, *self.grads(state, batch))


@dataclass(frozen=True)
class Engine:
    name: str
    build: Callable[..., BuiltStep]
    supports: frozenset[str]  # the EngineOptions fields this engine honours

    def check(self, options: EngineOptions) -> None:
        default = EngineOptions()
        for f in dataclasses.fields(EngineOptions):
            value = getattr(options, f.name)
            if f.name not in self.supports and value != getattr(default, f.name):
                raise UserError(
                    f"the {self.name} engine does not support the option {f.name}={value!r}; "
                    f"engines that do: {', '.join(_supporting(f.name)) or 'none'}."
                )


_REGISTRY: dict[str, Engine] = {}


def register(name: str, build: Callable[..., BuiltStep], supports) -> None:
    _REGISTRY[name] = Engine(name, build, frozenset(supports))


def unregister(name: str) -> None:
    """Forget an engine `register` added (a built-in one is registered again when next asked for)."""
    _REGISTRY.pop(name, None)


def get_engine(name: str) -> Engine:
    if name not in _REGISTRY and name in _BUILTIN:
        module = importlib.import_module(_BUILTIN[name])
        register(name, module.build, module.SUPPORTS)
    return _REGISTRY[check_name(name)]


def check_name(name: str, known: tuple[str, ...] | None = None) -> str:
    """`name` if it is among `known` (default: every engine, built-in or registered)."""
    known = names() if known is None else known
    if name not in known:
        raise UserError(f"zero.engine must be one of {', '.join(known)}, got {name!r}.")
    return name


def names() -> tuple[str, ...]:
    return tuple(dict.fromkeys((*ENGINES, *_REGISTRY)))


def _supporting(option: str) -> list[str]:
    return [n for n in names() if option in get_engine(n).supports]
