"""Accounting: the analytic memory / traffic model and measurement from compiled programs.

`analytic`, `planning`, `picks`, `activations` and `hardware` are pure arithmetic (no JAX import); `params` is
the one parameter count; `hlo` counts collective bytes in HLO text and compiles a lowered program to get the
post-partitioning HLO; `placed_bytes` counts bytes by memory space (device or host); `measure` sets a built
trainer beside the analytic model and `compare.measured_row` measures and times its step. Building the
trainer from a config is the caller's (`zerojax.cli.commands.compare_run`): accounting imports no experiment.
"""

from zerojax.accounting.activations import ACTIVATION_MODEL, GPTShape, activation_bytes_gpt
from zerojax.accounting.analytic import (
    comm_bound_tokens_per_device,
    flops_per_step,
    kept_state_bytes,
    model_state_bytes,
    peak_bytes,
    step_time_estimate,
    traffic_bytes,
)
from zerojax.accounting.hardware import HARDWARE, Hardware, get_hardware
from zerojax.accounting.hlo import collective_bytes, shape_bytes
from zerojax.accounting.partitioned import compile_partitioned, partitioned_hlo_text
from zerojax.accounting.planning import Plan, plan, plan_dict
from zerojax.core.optim import get_optimizer
from zerojax.core.precision import get_precision

__all__ = [
    "ACTIVATION_MODEL",
    "GPTShape",
    "HARDWARE",
    "Hardware",
    "Plan",
    "activation_bytes_gpt",
    "collective_bytes",
    "comm_bound_tokens_per_device",
    "compile_partitioned",
    "flops_per_step",
    "get_hardware",
    "get_optimizer",
    "get_precision",
    "kept_state_bytes",
    "model_state_bytes",
    "partitioned_hlo_text",
    "peak_bytes",
    "plan",
    "plan_dict",
    "shape_bytes",
    "step_time_estimate",
    "traffic_bytes",
]
