"""`zerojax.adapt.model`: a user's model as pure functions; every trace of it runs under `on_mesh`'s context."""

import contextlib

import jax
import numpy as np
from flax import nnx

from tests.models import UnevenMLP
from zerojax.adapt.model import functional, param_shapes


def test_an_nnx_class_becomes_pure_init_and_apply():
    fm = functional(UnevenMLP)
    x = np.zeros((2, 37), np.float32)
    params, model_state, static = fm.init(jax.random.key(0), x)
    assert jax.tree.map(np.shape, params) == {
        "hidden": {"bias": (129,), "kernel": (37, 129)},
        "out": {"bias": (10,), "kernel": (129, 10)},
    }
    out, _ = fm.apply(params, model_state, static, x)
    assert out.shape == (2, 10)
    assert isinstance(UnevenMLP(nnx.Rngs(0)), nnx.Module)


def test_on_mesh_enters_its_context_around_every_trace():
    entered = []

    @contextlib.contextmanager
    def context():
        entered.append(True)
        yield

    fm = functional(UnevenMLP).on_mesh(context)
    param_shapes(fm, jax.random.key(0), jax.ShapeDtypeStruct((2, 37), np.float32))
    assert entered == [True]
