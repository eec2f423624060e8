"""zerojax: ZeRO stages 0-3 and FSDP for JAX, expressed as NamedShardings on a device mesh.

Attributes load lazily so that `zerojax.cli.main` can set `XLA_FLAGS` before JAX starts its backends.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "Trainer": "zerojax.train.trainer",
    "shard": "zerojax.train.shard",
    "Sharded": "zerojax.train.shard",
    "TrainState": "zerojax.core.state",
    "EngineOptions": "zerojax.engines",
    "make_mesh": "zerojax.core.mesh",
    "simulate_cpu_devices": "zerojax.core.mesh",
    "STAGES": "zerojax.core.stages",
    "get_stage": "zerojax.core.stages",
    "make_layout": "zerojax.core.layout",
    "UserError": "zerojax.errors",
    "WeightedLoss": "zerojax.core.loss",
    "load_params": "zerojax.train.params_file",
    "load_model_state": "zerojax.train.params_file",
    "fit": "zerojax.train.fit",
    "FitOptions": "zerojax.train.fit",
    "ArraySource": "zerojax.data.sources",
    "IterableSource": "zerojax.data.sources",
    "Stacked": "zerojax.adapt.stacked",
    "WrapRule": "zerojax.adapt.units",
    "DEFAULT_AXIS_RULES": "zerojax.core.axis_rules",
    "SEQUENCE_PARALLEL_RULES": "zerojax.core.constraints",
    "with_logical_constraint": "zerojax.core.constraints",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'zerojax' has no attribute {name!r}")
