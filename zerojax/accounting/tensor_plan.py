"""Choosing the tensor-parallel size on a pod: stage 3 over `fsdp`, Megatron's split over `tensor`.

For a GPT of `params` parameters on `devices` chips, each tensor size t (a power of two within one
node's fast links, dividing the heads and the MLP width) leaves f = devices / t FSDP shards of one
tensor slice (params / t). Per step and device, with T tokens per device:

  compute   6 * params * T / (peak * efficiency): tensor parallelism splits the work, not adds to it
  fsdp      stage 3's 3 b (params / t) (f - 1) / f bytes (`analytic.traffic_units`), over the links
            between nodes where the fsdp group spans nodes, else the node's own
  tensor    Megatron's activation all-reduces over t: 4 a block (2 forward, 2 backward; +1
            recomputed under `remat: full`, measured in docs/parallelism.md), each of the group's
            t T tokens x d_model x b bytes, sending 2 (t - 1) / t of it, over the node's links
  latency   a fixed cost per collective (`LATENCY_S`): stage 3's three a layer over fsdp, the
            all-reduces above over tensor; it does not overlap

The step takes max(compute, fsdp, tensor) + latency. Tensor parallelism pays where the fsdp traffic
of one whole model outweighs the compute of too few tokens; `crossover` finds the tokens per device
below which it does. Activation memory is not modelled here (the state is: 16 params / (f t) bytes
at stage 3 with bf16 Adam).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerojax.accounting.activations import GPTShape
from zerojax.accounting.analytic import trained
from zerojax.accounting.hardware import Hardware, group_links, node_links

# Per-collective latency: NCCL's small-message all-reduce times (nccl-tests) are ~10 us inside an
# NVLink node and ~25 us across InfiniBand; TPU ICI is taken as the former.
LATENCY_S = {"node": 10e-6, "between": 25e-6}


@dataclass(frozen=True)
class TensorOption:
    tensor: int
    fsdp: int
    state_bytes: float  # bf16 Adam at stage 3, per device
    compute_s: float
    fsdp_s: float
    tensor_s: float
    latency_s: float

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.fsdp_s, self.tensor_s) + self.latency_s

    @property
    def bound(self) -> str:
        """What the step waits for: the largest of its overlapped terms."""
        return max((self.compute_s, "compute"), (self.fsdp_s, "fsdp traffic"), (self.tensor_s, "tensor traffic"))[1]


def sizes(devices: int, shape: GPTShape, node: int) -> list[int]:
    """The tensor sizes to try: powers of two within a node that divide the devices, heads and MLP."""
    out, t = [], 1
    while t <= min(node, devices):
        if devices % t == 0 and shape.n_heads % t == 0 and shape.d_ff % t == 0:
            out.append(t)
        t *= 2
    return out


def option(
    t: int,
    params: float,
    devices: int,
    hw: Hardware,
    shape: GPTShape,
    tokens: float,
    efficiency: float,
    remat: str,
    trainable: float | None = None,
) -> TensorOption:
    """One tensor size's figures for `tokens` per device per step (bf16 compute); of `trainable`
    parameters only (None: all) are gradients reduced and optimizer state kept, the rest frozen."""
    node, _ = node_links(hw, devices)
    f, b = devices // t, 2
    trains = trained(params, trainable)
    fsdp_link = group_links(hw, devices).link_bytes_per_s  # the ring spans nodes, or stays in one
    all_reduces = 4 + (1 if remat == "full" else 0)
    tensor_bytes = shape.n_layers * all_reduces * (t * tokens * shape.d_model * b) * 2 * (t - 1) / t
    fsdp_bytes = (2 * params + trains) * b / t * (f - 1) / f  # two gathers of all, one reduction of the trained
    latency = 3 * shape.n_layers * (LATENCY_S["between"] if devices > node else LATENCY_S["node"])
    latency += shape.n_layers * all_reduces * LATENCY_S["node"] if t > 1 else 0.0
    return TensorOption(
        t,
        f,
        (2 * (params - trains) + 16 * trains) / devices,
        (4 * params + 2 * trains) * tokens / (hw.peak_flops * efficiency),
        fsdp_bytes / fsdp_link,
        tensor_bytes / hw.link_bytes_per_s,
        latency,
    )


def options(params, devices, hw, shape, tokens, efficiency, remat="full", trainable=None) -> list[TensorOption]:
    node, _ = node_links(hw, devices)
    return [
        option(t, params, devices, hw, shape, tokens, efficiency, remat, trainable) for t in sizes(devices, shape, node)
    ]


def best(opts: list[TensorOption]) -> TensorOption:
    """The fastest step; the smaller tensor size where two are within 1% (fewer collectives to tune)."""
    fastest = min(o.step_s for o in opts)
    return min((o for o in opts if o.step_s <= fastest * 1.01), key=lambda o: o.tensor)


def crossover(params, devices, hw, shape, efficiency, remat="full", trainable=None) -> float | None:
    """Tokens per device per step below which some tensor size > 1 beats tensor = 1 (None: never,
    between 64 and 2**24 tokens); found by bisection, the advantage falling as tokens grow."""

    def pays(tokens: float) -> bool:
        return best(options(params, devices, hw, shape, tokens, efficiency, remat, trainable)).tensor > 1

    low, high = 64.0, float(2**24)
    if not pays(low):
        return None
    if pays(high):
        return high
    for _ in range(40):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if pays(mid) else (low, mid)
    return low
