"""zerojax: ZeRO stages 0-3 and FSDP for JAX, expressed as NamedShardings on a device mesh.

Attributes load lazily so that `zerojax.cli` can set `XLA_FLAGS` before JAX starts its backends.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "Trainer": "zerojax.trainer",
    "shard": "zerojax.functional",
    "Sharded": "zerojax.functional",
    "TrainState": "zerojax.state",
    "EngineOptions": "zerojax.engines",
    "make_mesh": "zerojax.mesh",
    "simulate_cpu_devices": "zerojax.mesh",
    "STAGES": "zerojax.stages",
    "get_stage": "zerojax.stages",
    "make_layout": "zerojax.layout",
    "UserError": "zerojax.errors",
    "load_params": "zerojax.export",
    "load_model_state": "zerojax.export",
    "fit": "zerojax.run",
    "FitOptions": "zerojax.run",
    "ArraySource": "zerojax.sources",
    "IterableSource": "zerojax.sources",
    "Stacked": "zerojax.stacked",
    "DEFAULT_AXIS_RULES": "zerojax.axis_rules",
    "SEQUENCE_PARALLEL_RULES": "zerojax.activations",
    "with_logical_constraint": "zerojax.activations",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'zerojax' has no attribute {name!r}")
