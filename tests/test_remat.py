"""Activation-checkpoint policies (`model.remat`): what each keeps for the backward, measured.

none / dots / full are compiled here on 8 simulated CPU devices: temp bytes order none >= dots >=
full and full recomputes the most. `offload` cannot run on XLA:CPU (JAX lowers the move to host
memory as the identity there), so on CPU it is a UserError, and the offload itself is checked on
the program lowered for a GPU: its saved activations carry the host placement.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax.accounting.activations import host_activation_bytes_gpt
from zerojax.core import remat as remat_lib
from zerojax.errors import UserError
from zerojax.models.gpt import GPT, gpt_config

P = 8
SMALL = dict(d_model=256, n_layers=2, n_heads=4, d_ff=768, seq_len=128)  # the 20m preset, narrower


def _loss(graphdef, params, tokens):
    logits = nnx.merge(graphdef, params)(tokens)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])


def _split(cfg):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))))
    return graphdef, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)


@pytest.fixture(scope="module")
def compiled():
    """Each CPU policy's data-parallel gradient step on 8 devices: (temp bytes, FLOPs)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:P]), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    out = {}
    for policy in ("none", "dots", "full"):
        graphdef, params = _split(gpt_config("20m", **SMALL, remat=policy))
        tokens = jax.ShapeDtypeStruct((2 * P, SMALL["seq_len"]), jnp.int32, sharding=rows)
        c = jax.jit(jax.grad(functools.partial(_loss, graphdef))).lower(params, tokens).compile()
        cost = c.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        out[policy] = (c.memory_analysis().temp_size_in_bytes, cost.get("flops", 0.0))
    return out


def test_temp_bytes_order_none_dots_full(compiled):
    temp = {k: v[0] for k, v in compiled.items()}
    assert temp["none"] >= temp["dots"] >= temp["full"], temp
    assert temp["none"] > 1.5 * temp["full"], temp  # remat buys a real saving, not noise


def test_full_recomputes_the_most(compiled):
    flops = {k: v[1] for k, v in compiled.items()}
    if not all(flops.values()):
        pytest.skip("this XLA reports no FLOP count")
    assert flops["full"] > flops["dots"] >= flops["none"] * 0.999, flops


def test_remat_names_are_checked():
    with pytest.raises(UserError, match="model.remat must be one of"):
        gpt_config("tiny", remat="selective")
    assert gpt_config("tiny", remat="offload").remat == "offload"  # valid: checked against the backend when traced


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's refusal")
def test_offload_on_cpu_is_a_clear_error():
    graphdef, params = nnx.split(GPT(gpt_config("tiny", remat="offload"), nnx.Rngs(0)))
    with pytest.raises(UserError, match="host memory.*cpu backend cannot place"):
        jax.grad(functools.partial(_loss, graphdef))(params, jnp.zeros((2, 16), jnp.int32))


_PLACED = re.compile(
    r"annotate_device_placement.*_xla_buffer_placement = \"pinned_host\".*"
    r"-> tensor<([0-9x]+)x(f32|bf16)>"
)


def test_offload_places_the_saved_activations_in_host_memory(monkeypatch):
    """Lowered for a GPU (jax.export), every residual `dots` would save is annotated for pinned_host,
    and their bytes are those the planner counts as host activations."""
    monkeypatch.setattr(remat_lib, "platform", lambda: "gpu")
    cfg = gpt_config("tiny", remat="offload")
    graphdef, params = _split(cfg)
    batch, seq = 4, 64
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    exported = jax.export.export(jax.jit(jax.grad(functools.partial(_loss, graphdef))), platforms=["cuda"])(
        params, tokens
    )
    placed = _PLACED.findall(exported.mlir_module())
    assert placed, "no activation was placed in host memory"
    # One scanned layer body carries the annotations; the scan stacks them over the layers.
    per_layer = sum(
        int(np.prod([int(d) for d in shape.split("x")])) * (4 if dt == "f32" else 2) for shape, dt in placed
    )
    assert per_layer * cfg.n_layers == host_activation_bytes_gpt(
        cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, seq, batch, 4, "offload"
    )
    # and none of them without offload
    graphdef, params = _split(gpt_config("tiny", remat="dots"))
    plain = jax.export.export(jax.jit(jax.grad(functools.partial(_loss, graphdef))), platforms=["cuda"])(params, tokens)
    assert "pinned_host" not in plain.mlir_module()
