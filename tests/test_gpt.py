import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zerojax.errors import UserError
from zerojax.models import GPT, PRESETS, REMAT_POLICIES, GPTConfig, gpt_config

TINY = gpt_config("tiny")


def _tokens(seed: int, batch: int = 2, length: int = 32) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, 256, dtype=jnp.int32)


def _functional(cfg: GPTConfig = TINY, seed: int = 0):
    graphdef, params, rest = nnx.split(GPT(cfg, nnx.Rngs(seed)), nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), rest


def _apply(graphdef, rest, params: dict, tokens_BxL: jax.Array, **kw) -> jax.Array:
    return nnx.merge(graphdef, nnx.State(params), rest)(tokens_BxL, **kw)


def _loss(graphdef, rest, params: dict, tokens_BxL: jax.Array) -> jax.Array:
    logits_BxLxV = _apply(graphdef, rest, params, tokens_BxL[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, tokens_BxL[:, 1:]).mean()


def _stacked_shapes(cfg: GPTConfig) -> dict:
    abstract = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(GPT(cfg, nnx.Rngs(0)), nnx.Param)))
    return jax.tree.map(lambda a: a.shape, abstract)


def test_forward_shape_dtype_and_causality():
    model = GPT(TINY, nnx.Rngs(0))
    forward = nnx.jit(lambda m, t: m(t))
    tokens = _tokens(1)
    logits = forward(model, tokens)
    assert logits.shape == (2, 32, 256) and logits.dtype == jnp.float32
    assert abs(float(jax.nn.logsumexp(logits, -1).mean()) - math.log(256)) < 0.1  # near-uniform init

    t = 20
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % 256)
    diff_BxL = jnp.abs(forward(model, changed) - logits).max(-1)
    assert float(diff_BxL[:, :t].max()) < 1e-6
    assert float(diff_BxL[:, t:].min()) > 1e-4  # the change reaches t and everything after

    with pytest.raises(UserError, match="seq_len=64"):
        model(_tokens(1, length=65))


def test_num_params_matches_real_leaves_tiny():
    _, params, _ = _functional()
    real = sum(x.size for x in jax.tree.leaves(params))
    assert real == TINY.num_params() == 115_008
    assert len(jax.tree.leaves(params)) == 3 + 9  # embed, final_norm, head + 9 stacked block leaves


def test_num_params_7b_without_allocation_and_stacked_layer_axis():
    cfg = gpt_config("7b")
    shapes = _stacked_shapes(cfg)
    assert (
        sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))) == cfg.num_params()
    )
    assert 6.4e9 < cfg.num_params() < 7.0e9
    assert shapes["blocks"]["wq"] == (32, 4096, 4096)
    assert shapes["blocks"]["w_down"] == (32, 11008, 4096)
    assert shapes["embed"] == (256, 4096) and shapes["head"] == (4096, 256)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_stack_layers_and_shard_by_eight(preset):
    cfg = gpt_config(preset)
    shapes = _stacked_shapes(cfg)
    leaves = jax.tree_util.tree_leaves_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    assert sum(math.prod(s) for _, s in leaves) == cfg.num_params()
    for path, shape in leaves:
        if path[0].key == "blocks":
            assert shape[0] == cfg.n_layers, (path, shape)
            shape = shape[1:]  # the layer axis is scanned over, never sharded
        assert all(d % 8 == 0 for d in shape), (path, shape)
    assert len(shapes["blocks"]) == 9


def test_preset_sizes_and_overrides():
    millions = {k: c.num_params() / 1e6 for k, c in PRESETS.items()}
    assert 0.1 <= millions["tiny"] <= 0.3 and millions["20m"] >= 20 and 45 <= millions["50m"] <= 60
    assert 115 <= millions["124m"] <= 130 and 0.9e3 <= millions["1b"] <= 1.2e3
    assert gpt_config("tiny", remat="dots", seq_len=128) == GPTConfig(64, 2, 4, 128, 128, remat="dots")
    with pytest.raises(UserError, match="unknown"):
        gpt_config("3b")
    with pytest.raises(UserError, match="remat"):
        gpt_config("tiny", remat="some")
    with pytest.raises(UserError, match="n_heads"):
        gpt_config("tiny", n_heads=3)


def test_layer_hook_runs_per_layer_inside_scan():
    graphdef, params, rest = _functional()
    tokens = _tokens(2)
    seen: list[tuple[int, ...]] = []

    def identity(layer_state):
        seen.extend(x.shape for x in jax.tree.leaves(layer_state))
        return jax.tree.map(lambda a: a * 1, layer_state)

    plain = jax.jit(functools.partial(_apply, graphdef, rest))(params, tokens)
    # Both jitted: the same program but for the hook, so the identity hook must change no bit
    # (an eager run differs from a jitted one in the last bit wherever XLA fuses differently).
    hooked = jax.jit(functools.partial(_apply, graphdef, rest, layer_hook=identity))(params, tokens)
    np.testing.assert_array_equal(np.asarray(hooked), np.asarray(plain))
    assert len(seen) == 9 and (64, 64) in seen and (128, 64) in seen  # one layer's slice, traced once

    # Zeroed blocks are identities on the residual stream, leaving embed -> final norm -> head.
    zeroed = _apply(graphdef, rest, params, tokens, layer_hook=lambda s: jax.tree.map(jnp.zeros_like, s))
    x = params["embed"][tokens]
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * params["final_norm"]
    np.testing.assert_allclose(zeroed, x @ params["head"], atol=1e-5)
    assert float(jnp.abs(zeroed - plain).max()) > 1e-3


@pytest.mark.parametrize("policy,runs", [("full", 3), ("none", 2)])
def test_layer_hook_is_rematerialised_in_backward(policy, runs):
    # A distinctive identity op: with remat the backward pass re-runs the hook (FSDP re-gathers).
    graphdef, params, rest = _functional(gpt_config("tiny", remat=policy))

    def hook(s):
        return jax.tree.map(lambda a: jax.lax.reduce_precision(a, exponent_bits=8, mantissa_bits=23), s)

    def loss(p, t):
        return _apply(graphdef, rest, p, t, layer_hook=hook).mean()

    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params, _tokens(0, 1, 8)))
    assert jaxpr.count("reduce_precision") == runs * 9  # forward + transpose (+ recompute)


def test_remat_policies_give_same_loss_and_grads():
    tokens = _tokens(3, batch=2, length=16)
    results = {}
    assert set(REMAT_POLICIES) == {"none", "full", "dots", "offload"}  # offload: GPU/TPU only, tests/test_remat.py
    for policy in ("none", "full", "dots"):
        graphdef, params, rest = _functional(gpt_config("tiny", remat=policy))
        results[policy] = jax.jit(jax.value_and_grad(functools.partial(_loss, graphdef, rest)))(params, tokens)
    loss0, grads0 = results["none"]
    for policy in ("full", "dots"):
        loss, grads = results[policy]
        np.testing.assert_allclose(loss, loss0, rtol=1e-6, atol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), grads, grads0)
    assert float(jnp.abs(grads0["blocks"]["wq"]).max()) > 0


def test_bf16_params_forward_and_grad():
    graphdef, params, rest = _functional()
    tokens = _tokens(4)
    params_bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    apply = jax.jit(functools.partial(_apply, graphdef, rest))
    logits32, logits16 = apply(params, tokens), apply(params_bf16, tokens)
    assert logits16.dtype == jnp.float32
    diff = float(jnp.abs(logits16 - logits32).max())
    assert 0 < diff < 0.05  # bf16 compute really happened, and stayed close

    grads = jax.jit(jax.grad(functools.partial(_loss, graphdef, rest)))(params_bf16, tokens)
    assert grads["blocks"]["w_up"].dtype == jnp.bfloat16
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in jax.tree.leaves(grads))


def test_adam_steps_reduce_loss_on_random_bytes():
    graphdef, params, rest = _functional()
    tokens = _tokens(5, batch=8, length=33)
    opt = optax.adam(3e-3)
    loss_fn = functools.partial(_loss, graphdef, rest)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    losses = []
    for _ in range(15):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert abs(losses[0] - math.log(256)) < 0.1
    assert losses[-1] < losses[0] - 1.5, losses  # memorising one fixed batch


LLAMA_FAMILY = {
    "gqa": {"n_kv_heads": 2},
    "rope_scaling": {
        "n_kv_heads": 2,
        "rope_scaling": {  # wavelengths 6.3 (kept), 19.9 (interpolated) and longer (slowed 8x)
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "tied": {"n_kv_heads": 1, "head_dim": 8, "tie_embeddings": True, "norm_eps": 1e-5},
    "biases": {"n_kv_heads": 2, "qkv_bias": True, "norm_eps": 1e-5},
}


@pytest.mark.parametrize("name", sorted(LLAMA_FAMILY))
def test_llama_family_shapes_match_a_numpy_reference(name):
    """Grouped-query attention, Llama 3.1's rope scaling, an explicit head size with tied embeddings,
    and Qwen2's q/k/v biases: the GPT's fp32 logits equal an independent numpy forward written
    from Hugging Face's Llama code within 1e-4."""
    from flax import nnx

    from tests.llama_reference import forward
    from zerojax.core.trees import path_str
    from zerojax.models.gpt import GPT, gpt_config

    cfg = gpt_config("tiny", remat="none", **LLAMA_FAMILY[name])
    model = GPT(cfg, rngs=nnx.Rngs(3))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    flat = {path_str(p): np.asarray(x) for p, x in leaves}
    rng = np.random.default_rng(0)
    for key in [k for k in flat if k.startswith("blocks/b")]:  # biases start at zero: make them count
        flat[key] = rng.normal(size=flat[key].shape).astype(np.float32) * 0.5
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, list(flat.values())))
    nnx.update(model, state)
    tokens = rng.integers(0, cfg.vocab_size, size=(2, 24))
    got = np.asarray(model(jnp.asarray(tokens)))
    want = forward(
        flat,
        tokens,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.kv_heads,
        head_dim=cfg.head_size,
        eps=cfg.norm_eps,
        theta=cfg.rope_base,
        scaling=LLAMA_FAMILY[name].get("rope_scaling"),
        tied=cfg.tie_embeddings,
    )
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert sum(x.size for x in flat.values()) == cfg.num_params()
